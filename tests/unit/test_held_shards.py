"""The replies a member holds for the others: rounds below the newest go to a spool file and come back
byte for byte, small rounds stay in memory, and a round is forgotten by the bounds of held_shards. A
lossless codec's shard is held as its values and encoded again when asked for."""

from __future__ import annotations

import os

import pytest
import torch

from lowcomm.collectives import held_shards
from lowcomm.collectives.held_shards import HeldShards, HeldValues, Pieces
from lowcomm.collectives.pieces import piece_bounds
from lowcomm.compress import get_codec

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


def held_values(values: torch.Tensor, alias: bool = True) -> HeldValues:
    return HeldValues(values, get_codec("fp32", zstd_level=1).encode, piece_bounds(values.numel(), 1000), alias)


def decoded(pieces: Pieces) -> torch.Tensor:
    return torch.cat([get_codec("fp32").decode(piece) for piece in pieces])


@pytest.mark.parametrize("spool", [True, False])
def test_values_held_from_an_aggregate_are_copied_before_it_goes_to_its_caller(spool_all, monkeypatch, spool):
    """A slice of the round's aggregate costs nothing while the round reduces; settle() copies it (to the
    round's spool file, or in memory when small) so that the caller's changes reach no later reply."""
    if not spool:
        monkeypatch.setattr(held_shards, "SPOOL_MIN_BYTES", 1 << 30)
    aggregate = torch.randn(4500)
    held = HeldShards()
    held.put(G, 0, 0, held_values(aggregate[:2500]), ["a"], MANIFEST)
    held.put(G, 0, 1, held_values(aggregate[2500:]), ["a", "b"], MANIFEST)
    assert held.resident_bytes() == 0  # the aggregate's own memory
    before = held.get((G, 0, 0))
    assert len(before[0]) == 3 and torch.equal(decoded(before[0]), aggregate[:2500]) and before[1] == ["a"]
    original = aggregate.clone()
    held.settle(G, 0)
    aggregate.zero_()  # the caller's to change now
    assert spooled_fds(spool_all) == (1 if spool else 0)
    assert held.resident_bytes() == (0 if spool else 4500 * 4)
    for shard, part in ((0, original[:2500]), (1, original[2500:])):
        assert torch.equal(decoded(held.get((G, 0, shard))[0]), part)
    held.put(G, 0, 2, held_values(aggregate[:10]), ["a"], MANIFEST)  # a late reply of a settled round: copied
    aggregate[:10] = 7.0
    assert torch.equal(decoded(held.get((G, 0, 2))[0]), torch.zeros(10))


def test_values_below_the_newest_round_are_spooled_and_read_back(spool_all):
    values = torch.randn(3000)
    held = HeldShards()
    held.put(G, 0, 0, held_values(values.clone(), alias=False), ["a"], MANIFEST)
    held.spool(held.forget(G, 1))
    assert spooled_fds(spool_all) == 1 and held.resident_bytes() == 0
    assert torch.equal(decoded(held.get((G, 0, 0))[0]), values)
