"""The peer's allocator setting: glibc takes the arena cap; another C library is left as it is. While
a round reduces, glibc's free pages go back on a thread of its own."""

from __future__ import annotations

import platform

import pytest

from children import wait_until
from lowcomm.collectives import allocator
from lowcomm.collectives.allocator import Trimming, tune_allocator

GLIBC = platform.libc_ver()[0] == "glibc"


def test_glibc_takes_the_arena_cap():
    assert tune_allocator() == GLIBC


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_free_pages_go_back_once_a_round_grows_past_its_bound(monkeypatch):
    monkeypatch.setattr(allocator, "TRIM_FLOOR_BYTES", 1 << 20)
    trimming = Trimming(look_s=0.01)
    with trimming.round(0):
        thread = trimming._thread
        with trimming.round(0):  # two rounds at once (the overlap): one trimmer
            grown = bytearray(b"x" * (16 << 20))  # resident: 16 MiB past both rounds' start
            wait_until(lambda: trimming.trims >= 1, 10, "a trim past the bound")
        del grown
    with trimming.round(1 << 30):
        assert trimming._thread is thread and thread.daemon
