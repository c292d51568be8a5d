"""Token caches on disk: one folder per corpus under `$LOWCOMM_CACHE` (or ~/.cache/lowcomm).

A cache folder holds `tokens.bin` (raw little-endian uint16 tokens, memmapped on load) and a small
`meta.json` written after it. Peers on one machine may build a cache at the same moment: each file
is written to a temporary name and moved into place with `os.replace`, `meta.json` last, so a
reader sees either no cache or a complete one; racing builders write identical bytes. The largest
token id of a token file is remembered here too (data.token_file), under `token-ids/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

TOKEN_DTYPE = np.dtype("<u2")
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"


def cache_root() -> Path:
    return Path(os.environ.get("LOWCOMM_CACHE") or Path.home() / ".cache" / "lowcomm")


def read_meta(directory: Path) -> dict | None:
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


def write_cache(directory: Path, pieces: Iterable[np.ndarray], meta: dict) -> dict:
    """Writes the uint16 token `pieces` in order as `tokens.bin`, then `meta.json` (with `sha256` and
    `n_tokens` of the stream added); returns the meta written. Pieces are streamed, never joined."""
    directory.mkdir(parents=True, exist_ok=True)
    digest, n_tokens = hashlib.sha256(), 0

    def write(f) -> None:
        nonlocal n_tokens
        for piece in pieces:
            data = np.ascontiguousarray(piece, dtype=TOKEN_DTYPE).tobytes()
            digest.update(data)
            f.write(data)
            n_tokens += len(piece)

    write_atomic(directory / TOKENS_FILE, write)
    meta = {**meta, "sha256": digest.hexdigest(), "n_tokens": n_tokens, "dtype": "uint16-le"}
    # meta.json last: its presence says tokens.bin is complete.
    write_atomic(directory / META_FILE, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return meta


def open_tokens(directory: Path) -> np.ndarray:
    return np.memmap(directory / TOKENS_FILE, dtype=TOKEN_DTYPE, mode="r")


def write_atomic(path: Path, write) -> None:
    """`write(f)` to a temporary file beside `path`, moved into place once complete (readers never see half)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
