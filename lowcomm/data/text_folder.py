"""`corpus = "text"`: a folder of text files, tokenized byte-level (one uint16 token per byte).

Every file under `data.path`, recursively, is read as raw bytes in order of its relative path
(files and folders whose names start with "." are skipped), and the files are joined with b"\\n",
as the stdlib corpus is. The tokens are cached (data.cache) in a folder named by a fingerprint of
the listing: the folder's absolute path and each file's relative path, size and modification time.
Editing, adding or removing a file therefore builds a fresh cache on the next load; the cache is
built once per machine and memmapped by every peer on it. Files are read and written out
READ_BYTES at a time, so a build holds a few chunks in memory, whatever the size of a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lowcomm.data.cache import TOKEN_DTYPE, cache_root, open_tokens, read_meta, write_cache

log = logging.getLogger(__name__)
SEPARATOR = np.frombuffer(b"\n", dtype=np.uint8).astype(TOKEN_DTYPE)
READ_BYTES = 64 << 20  # one chunk of a file: 64 MiB read, 128 MiB of uint16 tokens


class TextFolderError(ValueError):
    """A text folder that cannot be used as it is; the message says what to do."""


def text_files(folder: Path) -> list[Path]:
    """The folder's files (not hidden, recursively), sorted by their path relative to it."""
    found = []
    for directory, subdirs, files in os.walk(folder):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        found += [Path(directory, f).relative_to(folder) for f in files if not f.startswith(".")]
    return [folder / rel for rel in sorted(found, key=lambda p: p.as_posix())]


def load_text_folder(path: str) -> tuple[np.ndarray, dict]:
    """The folder's byte-level token stream (a memmap of its cache, built on first use) and its meta."""
    if not path:
        raise TextFolderError('data.corpus = "text" needs data.path: a folder of text files')
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise TextFolderError(f"data.path = {path!r} is not a folder; name a folder of text files "
                              "(a relative path is resolved in each peer's working directory)")
    files = text_files(folder)
    stats = [(f.relative_to(folder).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    if sum(size for _, size, _ in stats) == 0:
        raise TextFolderError(f"data.path = {path!r} holds no text (no non-empty files); put text files in it")
    listing = json.dumps([str(folder), stats]).encode()
    directory = cache_root() / f"corpus-text-{hashlib.sha256(listing).hexdigest()[:16]}"
    meta = read_meta(directory)
    if meta is None:
        meta = write_cache(directory, _pieces(files), {"corpus": "text", "folder": str(folder), "files": len(files)})
        log.info("tokenized %d files under %s: %d tokens in %s", len(files), folder, meta["n_tokens"], directory)
    return open_tokens(directory), meta


def _pieces(files: list[Path]) -> Iterator[np.ndarray]:
    """The files' tokens in order, READ_BYTES of a file at a time, SEPARATOR between two files."""
    for i, path in enumerate(files):
        if i:
            yield SEPARATOR
        with path.open("rb") as f:
            while chunk := f.read(READ_BYTES):
                yield np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPE)
