"""The peer's allocator setting: glibc takes the arena cap; another C library is left as it is."""

from __future__ import annotations

import platform

from lowcomm.runtime.allocator import limit_arenas


def test_glibc_takes_the_arena_cap():
    assert limit_arenas() == (platform.libc_ver()[0] == "glibc")
