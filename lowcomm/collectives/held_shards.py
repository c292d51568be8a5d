"""The reduced shards of landed rounds that a member keeps for the others: a reply one of them lost
(hole filling) and a round a late member or a joiner catches up.

The newest round's shards stay in memory: hole filling asks for them while the round still reduces.
A round below the newest goes to a spool file of its own (an anonymous temporary file, gone with
the round), so a worker's memory holds one round of shards instead of KEEP_ROUNDS + 1 of them
(Decision 35 in docs/round-protocol.md). Rounds that are small (below ``SPOOL_MIN_BYTES``) stay in
memory: their file would cost more than it saves. A spooled round is read back only when asked for.

A shard of a lossless codec is held as its decoded values (HeldValues), not as the pieces that came:
its pieces are encoded again when a member asks, and decode to the same values as the owner's did.
While its round reduces, those values are the round's aggregate itself, so holding them costs no
memory; before the aggregate goes to its caller (``settle``) they are copied to the round's spool
file (Decision 36).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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


class HeldValues:
    """A streamed shard of a lossless codec, held as its float32 values: ``pieces()`` encodes them again
    (``encode``, piece by piece over ``bounds``). ``alias``: the values are a slice of the round's
    aggregate, whose caller may change it once the round is settled."""

    def __init__(self, values: torch.Tensor, encode: Callable[[torch.Tensor], bytes],
                 bounds: list[tuple[int, int]], alias: bool):
        self.values, self.encode, self.bounds, self.alias = values, encode, bounds, alias

    @property
    def nbytes(self) -> int:
        return 4 * self.values.numel()

    def pieces(self) -> Pieces:
        return Pieces(self.encode(self.values[a:b]) for a, b in self.bounds)

    def copy(self) -> HeldValues:
        return HeldValues(self.values.clone(), self.encode, self.bounds, alias=False)


def size(blob) -> int:
    """Bytes of a held reply: one blob, a streamed shard's Pieces, or its HeldValues."""
    if isinstance(blob, HeldValues):
        return blob.nbytes
    return sum(len(piece) for piece in blob) if isinstance(blob, tuple) else len(blob)


@dataclass
class _Spooled:
    """A reply in a round's spool file: where its bytes are, and whether they were Pieces or (with
    ``encode`` and ``bounds``, those of the HeldValues they were) float32 values."""
    file: object
    spans: list[tuple[int, int]]  # (offset, length) of the blob, of each piece, or of the values
    pieces: bool
    encode: Callable[[torch.Tensor], bytes] | None = None
    bounds: list[tuple[int, int]] | None = None

    def read(self):
        if self.encode is not None:
            (offset, length), = self.spans
            values = torch.empty(length // 4, dtype=torch.float32)
            if os.preadv(self.file.fileno(), [memoryview(values.numpy()).cast("B")], offset) != length:
                raise OSError(f"spool file ended before the {length} bytes of a held shard's values")
            return HeldValues(values, self.encode, self.bounds, alias=False).pieces()
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
        self._settled: set[tuple[str, int]] = set()  # rounds whose aggregate went to its caller
        self._lock = threading.Lock()

    def put(self, group: str, round_: int, shard: int, blob, contributors: Sequence[str], manifest: bytes) -> None:
        with self._lock:
            if isinstance(blob, HeldValues) and blob.alias and (group, round_) in self._settled:
                blob = blob.copy()  # a reply read just before its round settled
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
            if isinstance(blob, HeldValues):  # under the lock: settle() copies an alias before its caller may change it
                blob = blob.pieces()
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
            return sum(h.nbytes for h in self._held.values()
                       if not isinstance(h.blob, _Spooled) and not (isinstance(h.blob, HeldValues) and h.blob.alias))

    def settle(self, group: str, round_: int) -> None:
        """The round's aggregate goes to its caller, who may change it: the held values that are slices of
        it are copied first, to a spool file of the round's own (in memory if small, or if the disk fails)."""
        with self._lock:  # held: a get() encodes an alias under it too
            self._settled.add((group, round_))
            todo = {k: h for k, h in self._held.items()
                    if k[:2] == (group, round_) and isinstance(h.blob, HeldValues) and h.blob.alias}
            written = _spool_file(round_, todo) if sum(h.nbytes for h in todo.values()) >= SPOOL_MIN_BYTES else {}
            for key, held in todo.items():
                held.blob = written.get(key) or held.blob.copy()

    def forget(self, group: str, newest: int) -> list[tuple[str, int]]:
        """Forgets what ``newest`` leaves behind; returns the rounds to ``spool`` (called without a lock
        held: it writes). A spool file closes, and its disk space is freed, with its last reply."""
        floor, oldest, now = newest - KEEP_ROUNDS, newest - MAX_HELD_ROUNDS, time.monotonic()
        with self._lock:
            past = sorted((k for k in self._held if k[0] == group and k[1] < floor), key=lambda k: -k[1])
            self._settled = {k for k in self._settled if k[0] != group or k[1] >= oldest}
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

    def spool(self, rounds: list[tuple[str, int]], trim: bool = False) -> None:
        """Writes each round's in-memory replies to a file of its own and drops them from memory; then, or
        if ``trim`` (the caller freed memory of its own), hands glibc's free pages back."""
        for group, round_ in rounds:
            with self._lock:
                todo = {k: h for k, h in self._held.items()
                        if k[:2] == (group, round_) and not isinstance(h.blob, _Spooled)}
            written = _spool_file(round_, todo) if todo else {}
            if not written:
                continue
            with self._lock:
                for key, spooled in written.items():
                    if self._held.get(key) is todo[key]:  # not forgotten or replaced meanwhile
                        todo[key].blob = spooled
            trim = True
        if trim:
            release_free_memory()  # glibc keeps what was freed in its arenas (collectives/allocator.py)

    def close(self) -> None:
        with self._lock:
            self._held.clear()


def _spool_file(round_: int, todo: dict) -> dict:
    """``todo``'s replies written to a new spool file of the round's own: {key: _Spooled}, or {} if the disk
    refused (the round stays in memory). The file is unlinked at once: it is gone with the last reference
    to it (the round's last reply)."""
    try:
        file = tempfile.TemporaryFile(prefix="lowcomm-held-", dir=SPOOL_DIR)
        return {key: _write(file, held.blob) for key, held in todo.items()}
    except OSError as e:  # a full disk
        logger.warning("spooling round %d's shards failed, they stay in memory: %s", round_, e)
        return {}


def _write(file, blob) -> _Spooled:
    if isinstance(blob, HeldValues):
        offset, data = file.seek(0, os.SEEK_END), memoryview(blob.values.contiguous().numpy()).cast("B")
        file.write(data)
        file.flush()
        return _Spooled(file, [(offset, len(data))], False, blob.encode, blob.bounds)
    spans = []
    for part in (list(blob) if isinstance(blob, tuple) else [blob]):
        spans.append((file.seek(0, os.SEEK_END), len(part)))
        file.write(part)
    file.flush()
    return _Spooled(file, spans, isinstance(blob, tuple))
