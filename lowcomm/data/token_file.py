"""`corpus = "tokens"`: a nanoGPT-style token file, raw little-endian uint16 or uint32, memmapped.

`data.path` names either one `.bin` file (its last `holdout_fraction` of tokens is held out) or a
folder holding nanoGPT's `train.bin` and `val.bin` (`val.bin` is the held-out split). Nothing is
copied: every peer memmaps the file and reads only the windows it samples. The one whole read is
the check that every id fits the model (`largest_token_in_file`); its answer is remembered in the
cache folder (data.cache) by the file's path, size and modification time, so a file is scanned
once per machine, not on every load.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from lowcomm.data.cache import cache_root, write_atomic

log = logging.getLogger(__name__)

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLIT_FILES = ("train.bin", "val.bin")  # nanoGPT's prepare.py writes these
SCAN_TOKENS = 1 << 24  # the largest-id check reads this many tokens at a time
LARGEST_DIR = "token-ids"  # under the cache root: one small JSON per scanned file


class TokenFileError(ValueError):
    """A token file that cannot be used as it is; the message says what to do."""


def token_file_splits(path: str, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(train, held-out) memmaps of `path`; held-out is None for a single file (the caller splits it)."""
    if dtype not in DTYPES:
        raise TokenFileError(f"data.dtype = {dtype!r}: use one of {', '.join(DTYPES)}")
    if not path:
        raise TokenFileError('data.corpus = "tokens" needs data.path: a .bin token file or a folder holding '
                             "train.bin and val.bin")
    where = Path(path).expanduser()
    if where.is_dir():
        missing = [name for name in SPLIT_FILES if not (where / name).is_file()]
        if missing:
            raise TokenFileError(f"data.path = {path!r} is a folder without {' and '.join(missing)}; point it at "
                                 "a .bin token file or at a folder holding nanoGPT's train.bin and val.bin")
        train, heldout = (open_token_file(where / name, dtype) for name in SPLIT_FILES)
        return train, heldout
    return open_token_file(where, dtype), None


def open_token_file(path: Path, dtype: str) -> np.ndarray:
    """The tokens of one raw file as a read-only memmap (checked: present, non-empty, whole tokens)."""
    kind = DTYPES[dtype]
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise TokenFileError(f"data.path: {path} does not exist; write the token file there or fix the path "
                             "(a relative path is resolved in each peer's working directory)") from None
    if not path.is_file():
        raise TokenFileError(f"data.path: {path} is not a regular file; name a .bin token file")
    if size == 0 or size % kind.itemsize:
        raise TokenFileError(f"data.path: {path} holds {size} bytes, not a whole number of {dtype} tokens "
                             f"({kind.itemsize} bytes each); check data.dtype or the file")
    return np.memmap(path, dtype=kind, mode="r")


def largest_token(tokens: np.ndarray) -> int:
    """The largest token id in `tokens`, read SCAN_TOKENS at a time (a memmap is never loaded whole)."""
    return max(int(tokens[i:i + SCAN_TOKENS].max()) for i in range(0, len(tokens), SCAN_TOKENS))


def largest_token_in_file(path: Path, dtype: np.dtype) -> int:
    """The largest token id of the raw token file `path`, scanned once and remembered (cache_root()/token-ids)
    under the file's resolved path, size, modification time (ns) and dtype: a changed file is scanned again."""
    path = Path(path).resolve()
    stat = path.stat()
    key = [str(path), stat.st_size, stat.st_mtime_ns, np.dtype(dtype).str]
    note = cache_root() / LARGEST_DIR / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"
    try:
        saved = json.loads(note.read_text())
        if saved["key"] == key:
            return int(saved["largest"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not scanned yet (or an unreadable note): scan
    largest = largest_token(np.memmap(path, dtype=dtype, mode="r"))
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(note, lambda f: f.write(json.dumps({"key": key, "largest": largest}).encode()))
    except OSError as e:  # a read-only cache only costs the next load another scan
        log.info("cannot remember the largest token id of %s in %s: %s", path, note.parent, e)
    return largest
