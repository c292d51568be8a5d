"""The embedded default corpus: the text of the Python standard library, tokenized byte-level.

Nothing is downloaded. Every `*.py` file under the interpreter's stdlib directory (skipping
site-packages, dist-packages and directories named `test` or `tests`) is read as raw bytes, in
order of relative path, and joined with b"\\n". Each byte is one token, stored as uint16.

The token stream is cached once per Python version as a raw uint16 file (`tokens.bin`, memmapped
on load) and a small `meta.json`. Peers on one machine may build it at the same moment: each
file is written to a temporary name and moved into place with `os.replace`, `meta.json` last, so
a reader sees either no cache or a complete one; racing builders write identical bytes.

The held-out split is the LAST `holdout_fraction` of the stream, fixed, so every run and every
algorithm is evaluated on the same text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests"})
TOKEN_DTYPE = np.dtype("<u2")
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"


CORPORA = ("stdlib",)


@dataclass
class DataConfig:
    """The [data] section: which corpus, its held-out split, and how often the run evaluates."""

    corpus: str = "stdlib"  # one of CORPORA
    holdout_fraction: float = 0.02  # the last fraction of the token stream, in (0, 1)
    eval_batches: int = 16  # held-out batches per evaluation
    eval_every_tokens: int = 61440  # the run's leader evaluates each time the global token count crosses this


class CorpusError(RuntimeError):
    """The corpus cannot be built or its cache is unusable; the message says what to do."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray      # uint16 tokens, memmapped
    heldout: np.ndarray    # uint16 tokens, memmapped; the last holdout_fraction of the stream
    sha256: str            # of the whole token stream as little-endian uint16
    n_tokens: int          # train + heldout
    python_version: str    # whose standard library the text is


def cache_dir(python_version: str | None = None) -> Path:
    """`$LOWCOMM_CACHE` (or ~/.cache/lowcomm) / corpus-stdlib-<python version>."""
    root = os.environ.get("LOWCOMM_CACHE") or Path.home() / ".cache" / "lowcomm"
    return Path(root) / f"corpus-stdlib-{python_version or platform.python_version()}"


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


def load_corpus(config: DataConfig) -> Corpus:
    """The cached stdlib corpus (built on first use), split into train and held-out tokens."""
    if config.corpus not in CORPORA:
        raise CorpusError(f"data.corpus = {config.corpus!r}: this version ships only 'stdlib'")
    if not 0.0 < config.holdout_fraction < 1.0:
        raise CorpusError(f"data.holdout_fraction = {config.holdout_fraction}: must lie in (0, 1)")
    directory = cache_dir()
    meta = _read_meta(directory)
    if meta is None:
        meta = build_cache(directory)
    tokens = np.memmap(directory / TOKENS_FILE, dtype=TOKEN_DTYPE, mode="r")
    n_heldout = int(round(len(tokens) * config.holdout_fraction))
    split = len(tokens) - n_heldout
    return Corpus(train=tokens[:split], heldout=tokens[split:], sha256=meta["sha256"],
                  n_tokens=len(tokens), python_version=meta["python_version"])


def build_cache(directory: Path) -> dict:
    """Tokenizes the stdlib into `directory`, atomically; returns the meta written."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = tokenize_stdlib()
    meta = {
        "corpus": "stdlib",
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
        "n_tokens": int(len(tokens)),
        "dtype": "uint16-le",
        "python_version": platform.python_version(),
    }
    _write_atomic(directory / TOKENS_FILE, tokens.tobytes())
    # meta.json last: its presence says tokens.bin is complete.
    _write_atomic(directory / META_FILE, json.dumps(meta, indent=1).encode())
    log.info("built stdlib corpus: %d tokens in %s", meta["n_tokens"], directory)
    return meta


def _read_meta(directory: Path) -> dict | None:
    """The cache's meta if the cache is complete and consistent, else None (rebuild)."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
        size = (directory / TOKENS_FILE).stat().st_size
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if size != meta.get("n_tokens", -1) * TOKEN_DTYPE.itemsize:
        log.warning("corpus cache in %s is inconsistent; rebuilding it", directory)
        return None
    return meta


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
