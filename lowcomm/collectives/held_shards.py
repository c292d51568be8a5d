"""The reduced shards of landed rounds that a member keeps for the others: a reply one of them lost
(hole filling) and a round a late member or a joiner catches up.

The newest round's shards stay in memory: hole filling asks for them while the round still reduces.
A round below the newest goes to a spool file of its own (an anonymous temporary file, gone with
the round), so a worker's memory holds one round of shards instead of KEEP_ROUNDS + 1 of them
(Decision 35 in docs/round-protocol.md). Rounds that are small (below ``SPOOL_MIN_BYTES``) stay in
memory: their file would cost more than it saves. A spooled round is read back only when asked for.

A round is forgotten once it is more than KEEP_ROUNDS below the newest, unless it landed under
HOLD_S ago, is at most MAX_HELD_ROUNDS back and fits HOLD_BYTES with the rounds past KEEP_ROUNDS
newer than it: a joiner slower than its members catches up at its own pace, and a large model's
round, bigger than HOLD_BYTES, is forgotten as before.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lowcomm.collectives.allocator import release_free_memory

logger = logging.getLogger(__name__)
KEEP_ROUNDS = 2  # a round's shards live while this peer runs the next KEEP_ROUNDS rounds
HOLD_S = 30.0  # and on, this long after they landed: a joiner catches up at its own pace
MAX_HELD_ROUNDS = 8  # but never more rounds back than this (memory, where rounds take a second)
HOLD_BYTES = 32 << 20  # nor more bytes past KEEP_ROUNDS than this: a large model's round is forgotten
SPOOL_MIN_BYTES = 1 << 20  # a round below the newest with fewer bytes than this stays in memory
# where spool files go: LOWCOMM_SPOOL_DIR, else /var/tmp (on disk where /tmp is a tmpfs, which is memory)
SPOOL_DIR = os.environ.get("LOWCOMM_SPOOL_DIR") or ("/var/tmp" if os.path.isdir("/var/tmp") else None)


class Pieces(tuple):
    """A streamed shard's encoded pieces, in order: what an owner replies and a member holds."""


def size(blob) -> int:
    """Bytes of a held reply: one blob, or a streamed shard's Pieces."""
    return sum(len(piece) for piece in blob) if isinstance(blob, tuple) else len(blob)


@dataclass
class _Spooled:
    """A reply in a round's spool file: where its bytes are, and whether they were Pieces."""
    file: object
    spans: list[tuple[int, int]]  # (offset, length) of the blob, or of each piece
    pieces: bool

    def read(self):
        parts = [os.pread(self.file.fileno(), length, offset) for offset, length in self.spans]
        for (_, length), part in zip(self.spans, parts):
            if len(part) != length:
                raise OSError(f"spool file ended after {len(part)} of {length} bytes")
        return Pieces(parts) if self.pieces else parts[0]


@dataclass
class _Held:
    blob: object  # bytes, Pieces or _Spooled
    contributors: list[str]
    manifest: bytes
    landed: float  # time.monotonic()
    nbytes: int


class HeldShards:
    """Held replies by (group, round, shard); thread-safe. ``get`` reads a spooled one back."""

    def __init__(self):
        self._held: dict[tuple[str, int, int], _Held] = {}
        self._lock = threading.Lock()

    def put(self, group: str, round_: int, shard: int, blob, contributors: Sequence[str], manifest: bytes) -> None:
        with self._lock:
            self._held[(group, round_, shard)] = _Held(blob, list(contributors), manifest, time.monotonic(),
                                                       size(blob))

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        with self._lock:
            return key in self._held

    def get(self, key: tuple[str, int, int]):
        """(blob, contributors, manifest) of ``key``, or None; a spooled blob is read back."""
        with self._lock:
            held = self._held.get(key)
        if held is None:
            return None
        blob = held.blob
        if isinstance(blob, _Spooled):
            try:
                blob = blob.read()
            except OSError as e:
                logger.warning("held round %d shard %d unreadable from its spool file: %s", key[1], key[2], e)
                return None
        return blob, held.contributors, held.manifest

    def resident_bytes(self) -> int:
        """Bytes of the replies held in memory (the spooled ones are on disk)."""
        with self._lock:
            return sum(h.nbytes for h in self._held.values() if not isinstance(h.blob, _Spooled))

    def forget(self, group: str, newest: int) -> list[tuple[str, int]]:
        """Forgets what ``newest`` leaves behind; returns the rounds to ``spool`` (called without a lock
        held: it writes). A spool file closes, and its disk space is freed, with its last reply."""
        floor, oldest, now = newest - KEEP_ROUNDS, newest - MAX_HELD_ROUNDS, time.monotonic()
        with self._lock:
            past = sorted((k for k in self._held if k[0] == group and k[1] < floor), key=lambda k: -k[1])
            budget = HOLD_BYTES
            for key in past:  # newest first: the budget goes to the rounds a catch-up reaches soonest
                held = self._held[key]
                budget -= held.nbytes
                if key[1] < oldest or now - held.landed > HOLD_S or budget < 0:
                    del self._held[key]
            rounds: dict[int, int] = {}
            for (g, round_, _), held in self._held.items():
                if g == group and round_ < newest and not isinstance(held.blob, _Spooled):
                    rounds[round_] = rounds.get(round_, 0) + held.nbytes
            return [(group, r) for r, nbytes in sorted(rounds.items()) if nbytes >= SPOOL_MIN_BYTES]

    def spool(self, rounds: list[tuple[str, int]]) -> None:
        """Writes each round's in-memory replies to a file of its own and drops them from memory."""
        for group, round_ in rounds:
            with self._lock:
                todo = {k: h for k, h in self._held.items()
                        if k[:2] == (group, round_) and not isinstance(h.blob, _Spooled)}
            if not todo:
                continue
            try:
                # unlinked at once: the file is gone with the last reference to it (the round's last reply)
                file = tempfile.TemporaryFile(prefix="lowcomm-held-", dir=SPOOL_DIR)
                written = {key: _write(file, held.blob) for key, held in todo.items()}
            except OSError as e:  # a full disk: the round stays in memory
                logger.warning("spooling round %d's shards failed, they stay in memory: %s", round_, e)
                continue
            with self._lock:
                for key, spooled in written.items():
                    if self._held.get(key) is todo[key]:  # not forgotten or replaced meanwhile
                        todo[key].blob = spooled
            release_free_memory()  # glibc keeps what the round freed in its arenas (collectives/allocator.py)

    def close(self) -> None:
        with self._lock:
            self._held.clear()


def _write(file, blob) -> _Spooled:
    spans = []
    for part in (list(blob) if isinstance(blob, tuple) else [blob]):
        spans.append((file.seek(0, os.SEEK_END), len(part)))
        file.write(part)
    file.flush()
    return _Spooled(file, spans, isinstance(blob, tuple))
