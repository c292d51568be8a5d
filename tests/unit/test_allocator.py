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


@pytest.mark.skipif(not GLIBC, reason="the trimming thread runs where the C library is glibc")
def test_a_trim_past_live_data_does_not_hold_off_the_next_once_that_data_is_freed(monkeypatch):
    """After a trim that left live data resident, the next waits for growth past what is resident now, not
    past what was resident then: a round that freed that data and grew again is trimmed again."""
    mib = 1 << 20
    resident, trims = [100 * mib], []
    monkeypatch.setattr(allocator, "TRIM_FLOOR_BYTES", 2 * mib)
    monkeypatch.setattr(allocator, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(allocator, "release_free_memory", lambda: trims.append(resident[0]))
    trimming = Trimming(look_s=0.01)
    with trimming.round(0):  # its bound: 102 MiB
        resident[0] = 200 * mib  # live: the trim gives nothing back
        wait_until(lambda: len(trims) == 1, 10, "a trim past the bound")
        resident[0] = 120 * mib  # the live data went
        wait_until(lambda: 0 < trimming._raised <= 121 * mib, 10, "the raise following what is resident")
        resident[0] = 150 * mib
        wait_until(lambda: len(trims) == 2, 10, "a second trim")
        assert trims == [200 * mib, 150 * mib]


@pytest.mark.skipif(not GLIBC, reason="the trimming thread runs where the C library is glibc")
def test_free_pages_go_back_as_the_last_round_ends_and_as_a_round_starts_past_its_bound(monkeypatch):
    mib = 1 << 20
    resident, trims = [100 * mib], []
    monkeypatch.setattr(allocator, "TRIM_FLOOR_BYTES", 2 * mib)
    monkeypatch.setattr(allocator, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(allocator, "release_free_memory", lambda: trims.append(resident[0]))
    trimming = Trimming(look_s=3600)  # its thread does not look again while this test runs
    with trimming.round(0):  # its bound: 102 MiB
        assert trims == []
        resident[0] = 200 * mib  # what the round freed, still resident as it ends
    assert trims == [200 * mib]
    resident[0] = 300 * mib  # what the caller left before the next round
    with trimming.round(0):
        assert trims[:2] == [200 * mib, 300 * mib]


def test_a_donated_round_trims_a_payload_sooner(monkeypatch):
    monkeypatch.setattr(allocator, "resident_bytes", lambda: 1 << 30)
    monkeypatch.setattr(allocator, "_GLIBC", None)  # no trimming thread: the bounds only
    trimming, payload = Trimming(), 256 << 20
    with trimming.round(payload):
        allocating = max(trimming._ceilings.values())
    with trimming.round(payload, allocates=0):
        donated = max(trimming._ceilings.values())
    assert allocating - donated == payload
    assert donated == (1 << 30) + int(allocator.TRIM_ABOVE * payload)
