"""The C allocator of a peer process: few arenas, so the reduce's short-lived pieces do not pile up.

A streamed reduce (collectives.pieces) allocates and frees megabyte pieces on a dozen threads.
glibc gives each thread an arena of its own (up to 8 per core) and keeps what a piece freed in
that arena: with its default, a worker of the 64 MB benchmark reached 5.6 times the payload in
its first round, with two arenas 4.0-4.2 (experiments/RESULTS.md, "The streamed reduce").

glibc also raises its mmap threshold to the size of each large block freed, so after the first
round the pieces come from the arenas too, and what a round freed stays in them: the worker grew
by about one payload a round, to 7.9 in its fourth. A fixed threshold would map every piece on its
own and give it back when freed (4.2 in the fourth round), at 12% more CPU per round and 0.74
efficiency instead of 0.83; instead, collectives.held_shards hands the arenas' free pages back once
a round (``malloc_trim``) as it spools the rounds below the newest (experiments/RESULTS.md, "Held
rounds on disk"). Other C libraries are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
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


TRIM_EVERY_S = 0.5  # how often free pages go back while a round reduces (trimming)


class Trimming:
    """While at least one round reduces (``with trimming:``), hands glibc's free pages back every
    ``every_s`` on a thread of its own: the pieces a round allocates and frees on a dozen threads
    leave its arenas fragmented, and what they free would stay resident until the round ends."""

    def __init__(self, every_s: float = TRIM_EVERY_S):
        self.every_s = every_s
        self.trims = 0
        self._rounds = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Trimming:
        with self._cond:
            self._rounds += 1
            if self._thread is None and _GLIBC is not None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="malloc-trim")
                self._thread.start()
            self._cond.notify_all()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._rounds -= 1

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._rounds == 0:
                    self._cond.wait()
                self._cond.wait(self.every_s)
                if self._rounds == 0:
                    continue
            release_free_memory()
            self.trims += 1


trimming = Trimming()  # the process's one trimmer, shared by its collectives
