"""The peer's allocator setting: glibc takes the arena cap; another C library is left as it is."""

from __future__ import annotations

import platform

from lowcomm.collectives.allocator import tune_allocator


def test_glibc_takes_the_arena_cap():
    assert tune_allocator() == (platform.libc_ver()[0] == "glibc")
