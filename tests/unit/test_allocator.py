"""The peer's allocator setting: glibc takes the arena cap; another C library is left as it is. While
a round reduces, glibc's free pages go back on a thread of its own."""

from __future__ import annotations

import platform

import pytest

from children import wait_until
from lowcomm.collectives.allocator import Trimming, tune_allocator

GLIBC = platform.libc_ver()[0] == "glibc"


def test_glibc_takes_the_arena_cap():
    assert tune_allocator() == GLIBC


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_free_pages_go_back_while_rounds_reduce_on_one_thread():
    trimming = Trimming(every_s=0.01)
    with trimming:
        thread = trimming._thread
        with trimming:  # two rounds at once (the overlap): one trimmer
            wait_until(lambda: trimming.trims >= 2, 10, "two trims while two rounds reduce")
        wait_until(lambda: trimming.trims >= 4, 10, "two more while one still does")
    with trimming:
        assert trimming._thread is thread and thread.daemon
