"""The C allocator of a peer process: few arenas, so the reduce's short-lived pieces do not pile up.

A streamed reduce (collectives.pieces) allocates and frees megabyte pieces on a dozen threads.
glibc gives each thread an arena of its own (up to 8 per core) and keeps what a piece freed in
that arena: with its default, a worker of the 64 MB benchmark reached 5.6 times the payload in
its first round, with two arenas 4.0-4.2 (experiments/RESULTS.md, "The streamed reduce").

glibc also raises its mmap threshold to the size of each large block freed, so after the first
round the pieces come from the arenas too, and the worker grew by about one payload a round, to
7.9 in its fourth. A fixed threshold (``MMAP_THRESHOLD``) keeps every block from half a MiB up in
a mapping of its own, returned to the system when freed: 4.2 in the fourth round
(experiments/RESULTS.md, "Held rounds on disk"). Other C libraries are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)
M_ARENA_MAX, M_MMAP_THRESHOLD = -8, -3  # glibc's mallopt parameters
ARENAS = 2
MMAP_THRESHOLD = 512 << 10  # fixed: glibc's own grows with each large block freed


def tune_allocator(arenas: int = ARENAS, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Caps glibc's malloc arenas (before the process starts its threads) and fixes its mmap threshold;
    False where that is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
        gnu = getattr(libc, "gnu_get_libc_version", None)
    except OSError:
        return False
    if mallopt is None or gnu is None:
        return False
    ok = True
    for name, param, value in (("M_ARENA_MAX", M_ARENA_MAX, arenas), ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD,
                                                                       mmap_threshold)):
        if not mallopt(ctypes.c_int(param), ctypes.c_int(value)):
            logger.info("mallopt(%s, %d) was refused", name, value)
            ok = False
    return ok
