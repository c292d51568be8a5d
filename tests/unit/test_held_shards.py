"""The replies a member holds for the others: rounds below the newest go to a spool file and come back
byte for byte, small rounds stay in memory, and a round is forgotten by the bounds of held_shards."""

from __future__ import annotations

import os

import pytest

from lowcomm.collectives import held_shards
from lowcomm.collectives.held_shards import HeldShards, Pieces

G, MANIFEST = "g", b"m" * 32


def blob(round_: int, shard: int, n: int) -> bytes:
    return bytes((round_ * 31 + shard * 7 + i) % 251 for i in range(n))


def pieces(round_: int, shard: int) -> Pieces:
    return Pieces([blob(round_, shard, 5000), blob(round_ + 1, shard, 3), blob(round_ + 2, shard, 70000)])


@pytest.fixture
def spool_all(monkeypatch, tmp_path):
    monkeypatch.setattr(held_shards, "SPOOL_MIN_BYTES", 1)
    monkeypatch.setattr(held_shards, "SPOOL_DIR", str(tmp_path))
    return tmp_path


def spooled_fds(directory) -> int:
    """This process's open files in ``directory`` (a spool file is unlinked at once: only /proc shows it)."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(directory)))


def test_a_round_below_the_newest_is_spooled_and_read_back_byte_for_byte(spool_all):
    held = HeldShards()
    held.put(G, 0, 0, blob(0, 0, 100000), ["a", "b"], MANIFEST)
    held.put(G, 0, 1, pieces(0, 1), ["a"], MANIFEST)
    held.spool(held.forget(G, 0))  # round 0 is the newest: kept in memory
    assert spooled_fds(spool_all) == 0
    held.put(G, 1, 0, blob(1, 0, 100), ["a"], MANIFEST)
    held.spool(held.forget(G, 1))
    assert spooled_fds(spool_all) == 1  # round 0's one file; round 1 stays in memory
    one, two = held.get((G, 0, 0)), held.get((G, 0, 1))
    assert one == (blob(0, 0, 100000), ["a", "b"], MANIFEST)
    assert isinstance(two[0], Pieces) and two[0] == pieces(0, 1) and two[1:] == (["a"], MANIFEST)
    assert held.get((G, 1, 0))[0] == blob(1, 0, 100)


def test_a_forgotten_round_closes_its_spool_file(spool_all, monkeypatch):
    monkeypatch.setattr(held_shards, "HOLD_S", 0.0)
    held = HeldShards()
    for round_ in range(3):
        held.put(G, round_, 0, blob(round_, 0, 1000), ["a"], MANIFEST)
        held.spool(held.forget(G, round_))
    assert spooled_fds(spool_all) == 2  # rounds 0 and 1, each in its own file
    held.spool(held.forget(G, 3))  # round 0 is now more than KEEP_ROUNDS below
    assert (G, 0, 0) not in held and held.get((G, 0, 0)) is None
    assert spooled_fds(spool_all) == 2  # round 0's closed; round 2's spooled
    held.close()
    assert spooled_fds(spool_all) == 0


def test_small_rounds_stay_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(held_shards, "SPOOL_DIR", str(tmp_path))
    held = HeldShards()
    held.put(G, 0, 0, blob(0, 0, 1000), ["a"], MANIFEST)
    assert held.forget(G, 1) == []
    assert spooled_fds(tmp_path) == 0 and held.get((G, 0, 0))[0] == blob(0, 0, 1000)


def test_rounds_past_keep_rounds_live_within_hold_s_max_rounds_and_hold_bytes(monkeypatch):
    monkeypatch.setattr(held_shards, "MAX_HELD_ROUNDS", 5)
    monkeypatch.setattr(held_shards, "HOLD_BYTES", 2500)
    held = HeldShards()
    for round_ in range(8):
        held.put(G, round_, 0, blob(round_, 0, 1000), ["a"], MANIFEST)
    held.forget(G, 7)
    # KEEP_ROUNDS keeps 5..7; past it, 4 and 3 fit 2500 bytes, 2 does not; 1 and 0 are past MAX_HELD_ROUNDS
    assert sorted(k[1] for k in held._held) == [3, 4, 5, 6, 7]
    monkeypatch.setattr(held_shards, "HOLD_S", 0.0)
    held.forget(G, 7)
    assert sorted(k[1] for k in held._held) == [5, 6, 7]


def test_a_spool_that_cannot_be_written_keeps_the_round_in_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(held_shards, "SPOOL_MIN_BYTES", 1)
    monkeypatch.setattr(held_shards, "SPOOL_DIR", str(tmp_path / "missing"))
    held = HeldShards()
    held.put(G, 0, 0, blob(0, 0, 100), ["a"], MANIFEST)
    held.spool(held.forget(G, 1))
    assert held.get((G, 0, 0))[0] == blob(0, 0, 100)
