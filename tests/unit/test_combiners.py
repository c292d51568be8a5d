"""Unit tests for the owners' combiners: dense weighted mean and SparseLoCo's forwarded bundles."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from lowcomm.algorithms.sparseloco import SparseLoCoConfig, SparseLoCoState, compress_all, median_norm_clip
from lowcomm.algorithms.sparseloco_replica import combiner as sparseloco_combiner
from lowcomm.collectives.combiners import MAX_CLOSED_HELD, DenseMean
from lowcomm.collectives.reduce_owner import ContributionRejected
from lowcomm.compress import scatter_mean

SHAPES = [(96, 100), (70,), (64, 128), (3, 4, 5)]


def payloads(seed: int, config: SparseLoCoConfig) -> tuple[list[bytes], list[torch.Tensor]]:
    torch.manual_seed(seed)
    deltas = [torch.randn(s) * (seed + 1) for s in SHAPES]
    state = SparseLoCoState.zeros_like(deltas)
    return compress_all(state, deltas, config), deltas


@pytest.mark.parametrize("owners", [1, 2, 3, 4, 7])
def test_sparse_shards_follow_parameter_boundaries_and_cover_everything(owners):
    bundle = sparseloco_combiner(SparseLoCoConfig(), SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    bounds = bundle.shard_bounds(owners, numel)
    assert len(bounds) == owners and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    starts = set(bundle.offsets)
    assert all(start in starts and end in starts for start, end in bounds)


def test_bundle_round_trip_equals_the_clipped_scatter_mean_of_every_sender():
    config = SparseLoCoConfig(topk=8)
    bundle = sparseloco_combiner(config, SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    senders = {f"peer-{i}": payloads(i, config)[0] for i in range(3)}
    expected = []
    for i, shape in enumerate(SHAPES):
        codec = config.codec_for(shape)
        contributions = []
        for name in sorted(senders):
            blob = senders[name][i]
            if hasattr(codec, "decode_sparse"):
                indices, values, _ = codec.decode_sparse(blob)
            else:
                values = codec.decode(blob).reshape(-1)
                indices = torch.arange(values.numel())
            contributions.append((indices, values))
        expected.append(scatter_mean(median_norm_clip(contributions), shape).reshape(-1))
    got = []
    for bounds in bundle.shard_bounds(2, numel):
        items = {name: (bundle.accept(bundle.encode(p, bounds), bounds), 1.0) for name, p in senders.items()}
        reply = bundle.close(items, bounds)
        got.append(bundle.finish(reply, bounds))
    assert torch.equal(torch.cat(got), torch.cat(expected))


def test_an_owner_finishes_its_own_bundle_from_the_parts_it_decoded_and_any_other_bytes_anew():
    config = SparseLoCoConfig(topk=8)
    bundle, fresh = sparseloco_combiner(config, SHAPES), sparseloco_combiner(config, SHAPES)
    bounds = bundle.shard_bounds(1, sum(math.prod(s) for s in SHAPES))[0]
    parts = {f"peer-{i}": bundle.encode(payloads(i, config)[0], bounds) for i in range(3)}
    whole = bundle.close({name: (bundle.accept(part, bounds), 1.0) for name, part in parts.items()}, bounds)
    decoded = fresh.finish(whole, bounds)  # nothing closed there: every part decoded from the bytes
    read, accept = [], bundle.accept
    bundle.accept = lambda blob, b: read.append(blob) or accept(blob, b)
    assert torch.equal(bundle.finish(whole, bounds), decoded) and read == []
    assert torch.equal(bundle.finish(whole, bounds), decoded)  # the kept parts went with the first finish
    assert sorted(read) == sorted(parts.values())
    # other bytes for the same shard (a held copy from another owner) are read as they are, and the
    # owner's own bundle is still finished from its parts after them
    bundle.close({name: (accept(part, bounds), 1.0) for name, part in parts.items()}, bounds)
    two = fresh.close({name: (fresh.accept(parts[name], bounds), 1.0) for name in ("peer-0", "peer-1")}, bounds)
    read.clear()
    assert torch.equal(bundle.finish(two, bounds), fresh.finish(two, bounds)) and len(read) == 2
    with pytest.raises(ContributionRejected, match="left out"):
        bundle.finish(bundle.reply_for(whole, "peer-0"), bounds)
    assert torch.equal(bundle.finish(whole, bounds), decoded) and len(read) == 2
    # parts closed undecoded (bytes only) are not kept: the bundle is decoded when finished
    bundle.close({name: ((part, None), 1.0) for name, part in parts.items()}, bounds)
    assert torch.equal(bundle.finish(whole, bounds), decoded) and len(read) == 5


def test_the_bundles_kept_decoded_are_bounded():
    config = SparseLoCoConfig(topk=8)
    bundle = sparseloco_combiner(config, SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    part = bundle.encode(payloads(0, config)[0], (0, numel))
    for owners in range(1, 3 * MAX_CLOSED_HELD):  # a new shard's bounds each time, none finished
        bounds = (0, numel - owners)  # bounds are only a key here
        bundle.close({"a": (bundle.accept(part, (0, numel)), 1.0)}, bounds)
    assert len(bundle._closed) == MAX_CLOSED_HELD


def test_bundle_rejects_malformed_parts_and_replies():
    config = SparseLoCoConfig(topk=8)
    bundle = sparseloco_combiner(config, SHAPES)
    numel = sum(math.prod(s) for s in SHAPES)
    bounds = bundle.shard_bounds(1, numel)[0]
    part = bundle.encode(payloads(0, config)[0], bounds)
    transposed = config.codec_for((100, 96)).encode(torch.randn(100, 96))
    wrong_shape = bundle.encode([transposed, *payloads(0, config)[0][1:]], bounds)
    nan_dense = config.codec_for((70,)).encode(torch.full((70,), float("nan")))
    nan_values = bundle.encode([payloads(0, config)[0][0], nan_dense, *payloads(0, config)[0][2:]], bounds)
    nan_part = bundle.encode([b"" for _ in SHAPES], bounds)
    bad = [part[:-1], part + b"\0", struct.pack("<I", 99) + part[4:], wrong_shape, nan_values, nan_part, b""]
    for blob in bad:
        with pytest.raises(ContributionRejected):
            bundle.accept(blob, bounds)
    reply = bundle.close({"a": (bundle.accept(part, bounds), 1.0)}, bounds)
    for blob in (reply[:-1], reply + b"x", struct.pack("<I", 2) + reply[4:], reply[:4] + bytes([200]) + reply[5:]):
        with pytest.raises(ContributionRejected):
            bundle.finish(blob, bounds)


def test_owner_leaves_out_each_contributors_own_part_and_the_member_puts_it_back():
    config = SparseLoCoConfig(topk=8)
    bundle = sparseloco_combiner(config, SHAPES)
    bounds = bundle.shard_bounds(1, sum(math.prod(s) for s in SHAPES))[0]
    parts = {f"peer-{i}": bundle.encode(payloads(i, config)[0], bounds) for i in range(3)}
    whole = bundle.close({name: (bundle.accept(part, bounds), 1.0) for name, part in parts.items()}, bounds)
    for name, part in parts.items():
        reply = bundle.reply_for(whole, name)
        assert len(whole) - len(reply) == len(part)  # exactly the member's own bytes stay home
        assert bundle.complete(reply, name, part) == whole  # and the member holds the same bundle as all
        with pytest.raises(ContributionRejected, match="left out"):
            bundle.finish(reply, bounds)  # an incomplete bundle is never combined
        with pytest.raises(ContributionRejected, match="left out"):
            bundle.complete(reply, name, None)  # a holder's copy (GetShard) must be whole
        other = next(n for n in parts if n != name)
        with pytest.raises(ContributionRejected, match="left out"):
            bundle.complete(reply, other, parts[other])  # only one's own part may be missing
    assert bundle.reply_for(whole, "not-a-contributor") == whole
    assert bundle.complete(whole, "peer-0", parts["peer-0"]) == whole  # an owner that echoes is still read
    twice = struct.pack("<I", 4) + whole[4:] + whole[4:whole.index(b"peer-1") - 1]  # peer-0 again
    with pytest.raises(ContributionRejected, match="twice"):
        bundle.finish(twice, bounds)


def test_dense_mean_weights_by_tokens():
    mean = DenseMean("fp32", 0)
    bounds = (0, 4)
    items = {"a": (torch.tensor([1.0, 2, 3, 4]), 1.0), "b": (torch.tensor([5.0, 6, 7, 8]), 3.0)}
    assert mean.finish(mean.close(items, bounds), bounds).tolist() == [4.0, 5.0, 6.0, 7.0]
    assert mean.finish(mean.close({}, bounds), bounds).tolist() == [0.0] * 4


def test_an_owner_a_round_ahead_still_takes_the_round_below_and_refuses_older_ones():
    """Overlap: round t+1's slot may open before round t's; t's parts wait for their slot."""
    import threading

    from lowcomm.collectives.reduce_owner import OwnerSlots, Slot

    def slot(round_: int) -> Slot:
        return Slot("g", round_, 0, frozenset({"a"}), (0, 4), DenseMean("fp32", 0), deadline=1e12)

    slots = OwnerSlots()
    slots.open(slot(4))
    with pytest.raises(ContributionRejected, match="stale round 2"):
        slots.wait_slot("g", 2, timeout=5.0)  # two rounds behind: refused at once
    got = []
    waiter = threading.Thread(target=lambda: got.append(slots.wait_slot("g", 3, timeout=30.0)))
    waiter.start()
    opened = slots.open(slot(3))
    waiter.join(timeout=30.0)
    assert got == [opened] and opened.round == 3
