"""Which token stream a run trains on (the [data] section) and its held-out split.

Three sources, by `data.corpus`:

- `stdlib` (the default, nothing downloaded): every `*.py` file under the interpreter's stdlib
  directory (skipping site-packages, dist-packages and directories named `test` or `tests`), read as
  raw bytes in order of relative path, joined with b"\\n"; one uint16 token per byte. Cached once
  per Python version (data.cache).
- `tokens`: a nanoGPT-style `.bin` file of uint16 or uint32 token ids, memmapped (data.token_file).
- `text`: a folder of text files, byte-level like stdlib, cached by a fingerprint of the folder's
  listing (data.text_folder).

The held-out split is fixed, so every run and every algorithm is evaluated on the same text: the LAST
`holdout_fraction` of the stream, or nanoGPT's `val.bin` when `data.path` is a folder holding
`train.bin` and `val.bin`. Each peer then reads its own shard of the train split (data.loader).
`load_corpus(config, vocab_size, context)` also checks that the stream fits the model: every token
id below `vocab_size` (the files' largest id, scanned once per file and remembered: data.token_file)
and room for a window of `context` + 1 tokens in both splits.
"""

from __future__ import annotations

import logging
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lowcomm.data.cache import TOKEN_DTYPE, TOKENS_FILE, cache_root, open_tokens, read_meta, write_cache
from lowcomm.data.text_folder import TextFolderError, load_text_folder
from lowcomm.data.token_file import DTYPES, TokenFileError, largest_token, largest_token_in_file, token_file_splits

log = logging.getLogger(__name__)

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests"})
BYTE_LEVEL = ("stdlib", "text")  # one token per byte: every id < 256
CORPORA = ("stdlib", "tokens", "text")
TOKEN_DTYPES = tuple(DTYPES)


@dataclass
class DataConfig:
    """The [data] section: which corpus, its held-out split, and how often the run evaluates."""

    corpus: str = "stdlib"  # one of CORPORA
    path: str = ""  # tokens: a .bin file, or a folder with train.bin and val.bin; text: a folder of text files
    dtype: str = "uint16"  # tokens: the file's token type, one of TOKEN_DTYPES (little-endian)
    holdout_fraction: float = 0.02  # the last fraction of the token stream, in (0, 1) (not with val.bin)
    eval_batches: int = 16  # held-out batches per evaluation
    eval_every_tokens: int = 61440  # the run's leader evaluates each time the global token count crosses this


class CorpusError(RuntimeError):
    """The corpus cannot be built or used with this model; the message says what to do."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray      # token ids (uint16, or uint32 for a uint32 token file), memmapped
    heldout: np.ndarray    # the held-out split, memmapped
    sha256: str | None     # of the cached token stream as little-endian uint16 (None for a token file: not read whole)
    n_tokens: int          # train + heldout
    python_version: str = ""  # stdlib: whose standard library the text is
    files: tuple[Path, ...] = ()  # the token files train and heldout cover together, whole (the id check's)


def cache_dir(python_version: str | None = None) -> Path:
    """`$LOWCOMM_CACHE` (or ~/.cache/lowcomm) / corpus-stdlib-<python version>."""
    return cache_root() / f"corpus-stdlib-{python_version or platform.python_version()}"


def stdlib_sources(stdlib: Path | None = None) -> list[Path]:
    """The stdlib's `*.py` files, sorted by path relative to the stdlib directory."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, files in os.walk(stdlib):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]
        found += [Path(directory, f).relative_to(stdlib) for f in files if f.endswith(".py")]
    if not found:
        raise CorpusError(f"no *.py files under {stdlib}; is the Python standard library installed?")
    return [stdlib / rel for rel in sorted(found, key=lambda p: p.as_posix())]


def tokenize_stdlib(stdlib: Path | None = None) -> np.ndarray:
    """Byte-level tokens of the concatenated stdlib sources: one uint16 token per byte."""
    text = b"\n".join(path.read_bytes() for path in stdlib_sources(stdlib))
    return np.frombuffer(text, dtype=np.uint8).astype(TOKEN_DTYPE)


def load_corpus(config: DataConfig, vocab_size: int | None = None, context: int | None = None) -> Corpus:
    """The configured corpus, split into train and held-out tokens; with `vocab_size` and `context`
    (the model's), also checked to fit the model. CorpusError with one line saying what to do."""
    if config.corpus not in CORPORA:
        raise CorpusError(f"data.corpus = {config.corpus!r}: use one of {', '.join(CORPORA)}")
    if not 0.0 < config.holdout_fraction < 1.0:
        raise CorpusError(f"data.holdout_fraction = {config.holdout_fraction}: must lie in (0, 1)")
    try:
        corpus = {"stdlib": _stdlib, "tokens": _token_file, "text": _text_folder}[config.corpus](config)
    except (TokenFileError, TextFolderError) as e:
        raise CorpusError(str(e)) from None
    _check_fits(corpus, config, vocab_size, context)
    return corpus


def _split(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    split = len(tokens) - int(round(len(tokens) * fraction))
    return tokens[:split], tokens[split:]


def _stdlib(config: DataConfig) -> Corpus:
    directory = cache_dir()
    meta = read_meta(directory)
    if meta is None:
        meta = build_cache(directory)
    train, heldout = _split(open_tokens(directory), config.holdout_fraction)
    return Corpus(train, heldout, meta["sha256"], len(train) + len(heldout), meta["python_version"],
                  (directory / TOKENS_FILE,))


def build_cache(directory: Path) -> dict:
    """Tokenizes the stdlib into `directory`, atomically; returns the meta written."""
    meta = write_cache(directory, [tokenize_stdlib()],
                       {"corpus": "stdlib", "python_version": platform.python_version()})
    log.info("built stdlib corpus: %d tokens in %s", meta["n_tokens"], directory)
    return meta


def _token_file(config: DataConfig) -> Corpus:
    train, heldout = token_file_splits(config.path, config.dtype)
    files = (Path(train.filename),) if heldout is None else (Path(train.filename), Path(heldout.filename))
    if heldout is None:
        train, heldout = _split(train, config.holdout_fraction)
    return Corpus(train, heldout, None, len(train) + len(heldout), files=files)


def _text_folder(config: DataConfig) -> Corpus:
    tokens, meta = load_text_folder(config.path)
    train, heldout = _split(tokens, config.holdout_fraction)
    return Corpus(train, heldout, meta["sha256"], len(tokens), files=(Path(tokens.filename),))


def _check_fits(corpus: Corpus, config: DataConfig, vocab_size: int | None, context: int | None) -> None:
    """Room for one window of `context` + 1 tokens in each split; every token id below `vocab_size`."""
    where = f"data.corpus = {config.corpus!r}" + (f" at {config.path!r}" if config.path else "")
    if context is not None:
        for name, split in (("train", corpus.train), ("held-out", corpus.heldout)):
            if len(split) < context + 1:
                raise CorpusError(f"{where}: the {name} split holds {len(split)} tokens, fewer than one window of "
                                  f"model.context + 1 = {context + 1}; use more data, a smaller model.context or "
                                  "another data.holdout_fraction")
    if vocab_size is None or config.corpus in BYTE_LEVEL and vocab_size >= 256:
        return
    if np.iinfo(corpus.train.dtype).max < vocab_size:  # no id of this dtype can be out of range: no scan
        return
    if corpus.files:
        largest = max(largest_token_in_file(path, corpus.train.dtype) for path in corpus.files)
    else:
        largest = max(largest_token(corpus.train), largest_token(corpus.heldout))
    if largest >= vocab_size:
        raise CorpusError(f"{where} holds token id {largest}, beyond model.vocab_size = {vocab_size}; set "
                          f"model.vocab_size >= {largest + 1} (or check data.dtype)")
