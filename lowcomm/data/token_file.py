"""`corpus = "tokens"`: a nanoGPT-style token file, raw little-endian uint16 or uint32, memmapped.

`data.path` names either one `.bin` file (its last `holdout_fraction` of tokens is held out) or a
folder holding nanoGPT's `train.bin` and `val.bin` (`val.bin` is the held-out split). Nothing is
copied or cached: every peer memmaps the file and reads only the windows it samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLIT_FILES = ("train.bin", "val.bin")  # nanoGPT's prepare.py writes these
SCAN_TOKENS = 1 << 24  # the largest-id check reads this many tokens at a time


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
