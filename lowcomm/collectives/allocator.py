"""The C allocator of a peer process: few arenas, so the reduce's short-lived pieces do not pile up.

A streamed reduce (collectives.pieces) allocates and frees megabyte pieces on a dozen threads.
glibc gives each thread an arena of its own (up to 8 per core) and keeps what a piece freed in
that arena: with its default, a worker of the 64 MB benchmark reached 5.6 times the payload in
its first round, with two arenas 4.0-4.2 (experiments/RESULTS.md, "The streamed reduce").

glibc also raises its mmap threshold to the size of each large block freed, so after the first
round the pieces come from the arenas too, and what a round freed stays in them: the worker grew
by about one payload a round, to 7.9 in its fourth. A fixed threshold would map every piece on its
own and give it back when freed (4.2 in the fourth round), at 12% more CPU per round and 0.74
efficiency instead of 0.83. Instead the arenas' free pages go back (``malloc_trim``) when a round's
process grows past a bound (``Trimming``, used by collectives.sharded_reduce) and once a round is
spooled or its slots dropped (collectives.held_shards). At a worker's peak glibc's arenas held
0.3-0.6 of a payload in live blocks and 1.2-3.6 in free ones; with the bound the fourth round
peaked at 3.7-4.2 instead of 5.2-5.3, at the same CPU (experiments/RESULTS.md, "Held values and
trimming"); with a donated payload and trims as a round starts and ends, at 2.6-2.8 ("A donated
payload"). Other C libraries are left as they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)
M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2


def _glibc():
    """The C library if it is glibc, else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if getattr(libc, "gnu_get_libc_version", None) is not None else None


_GLIBC = _glibc()


def tune_allocator(arenas: int = ARENAS) -> bool:
    """Caps glibc's malloc arenas (before the process starts its threads); False where that is not glibc."""
    if _GLIBC is None:
        return False
    ok = bool(_GLIBC.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas)))
    if not ok:
        logger.info("mallopt(M_ARENA_MAX, %d) was refused", arenas)
    return ok


def release_free_memory() -> None:
    """Hands the free pages of glibc's arenas back to the system (``malloc_trim``); nothing elsewhere."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(ctypes.c_size_t(0))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_stats() -> dict:
    """What glibc's malloc holds now (``mallinfo2``, glibc 2.33 on): in use in its arenas, free in them,
    and mapped on its own; {} elsewhere. A diagnostic: it takes every arena's lock."""
    mallinfo2 = getattr(_GLIBC, "mallinfo2", None)
    if mallinfo2 is None:
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"heap_in_use": info.uordblks, "heap_free": info.fordblks, "mapped": info.hblkhd}


TRIM_LOOK_S = 0.1  # how often a reducing round's resident memory is looked at (trimming)
TRIM_ABOVE = 0.5  # free pages go back once it grew this many payloads past the least a round started at and
#                   what the round allocates for its aggregate ...
TRIM_FLOOR_BYTES = 64 << 20  # ... and at least this many bytes: a small model's rounds never pay for it


def resident_bytes() -> int:
    """This process's resident memory (Linux), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Trimming:
    """While rounds reduce (``with trimming.round(payload_bytes, allocates):``), hands glibc's free pages
    back whenever the process grew more than the round's result and TRIM_ABOVE payloads (at least
    TRIM_FLOOR_BYTES) past the least resident size a round started at: as a round starts, as the
    last one ends, and between, looked at every ``look_s`` on a thread of its own; after that
    thread's trim, not again until it grew by half the floor past the least it held since. The
    pieces a round allocates and frees on a dozen threads leave glibc's arenas fragmented, and what
    they free would stay resident until the round ends. Trimming every 0.5 s cost 7-17% more CPU
    per round in the 64 MB benchmark (each trimmed page is faulted in again when reused), so only
    growth past the bound pays for it; a bound from each round's own start would follow what the
    rounds before left behind."""

    def __init__(self, look_s: float = TRIM_LOOK_S):
        self.look_s = look_s
        self.trims = 0
        self._ceilings: dict[int, int] = {}  # round token -> the resident size past which to trim
        self._raised = 0  # after a trim: the least resident size since, plus half the floor
        self._least = float("inf")  # the least resident size a round started at
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def round(self, payload_bytes: int, allocates: int | None = None):
        """``allocates``: the bytes the round allocates for its result (default: ``payload_bytes``; none when
        it reduces into a donated payload)."""
        token = object()
        allocates = payload_bytes if allocates is None else allocates
        with self._cond:
            self._least = min(self._least, resident_bytes())  # before what earlier rounds left in the arenas
            ceiling = self._least + allocates + max(int(TRIM_ABOVE * payload_bytes), TRIM_FLOOR_BYTES)
            self._ceilings[id(token)] = ceiling
            if self._thread is None and _GLIBC is not None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="malloc-trim")
                self._thread.start()
            self._cond.notify_all()
        self._trim_above(ceiling)  # what the caller or the rounds before left, before the round adds its own
        try:
            yield self
        finally:
            with self._cond:
                del self._ceilings[id(token)]
                last = not self._ceilings
            if last:
                self._trim_above(ceiling)  # what the round freed, before the caller's next input

    def _trim_above(self, ceiling: int) -> bool:
        if _GLIBC is None or resident_bytes() <= ceiling:
            return False
        release_free_memory()
        with self._cond:
            self.trims += 1
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ceilings:
                    self._raised = 0  # a trim's raise ends with the rounds it was made in
                    self._cond.wait()
                self._cond.wait(self.look_s)
                ceiling, raised = max(self._ceilings.values(), default=None), self._raised
            if ceiling is None:
                continue
            if self._trim_above(max(ceiling, raised)):
                raised = resident_bytes() + TRIM_FLOOR_BYTES // 2  # live data past the bound: not again at once
            elif raised:  # what was live at that trim may have gone: half the floor past what is resident now
                raised = min(raised, resident_bytes() + TRIM_FLOOR_BYTES // 2)
            with self._cond:
                self._raised = raised


trimming = Trimming()  # the process's one trimmer, shared by its collectives
