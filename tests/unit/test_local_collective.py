"""The in-process collective (collectives.local): the sharded reduce's combiner calls minus gRPC.

Checked against the combiners called directly (the owner's and members' sequence by hand), for
dense payloads with a codec and for SparseLoCo's per-parameter bundles; a member that never
starts is left out by the deadline; a member outside the round gets NotInRound and catches up on
the bytes the others applied. Assertions are on values and contributor lists, never durations.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.algorithms import sparseloco
from lowcomm.algorithms.sparseloco import SparseLoCoConfig, SparseLoCoState, compress_all
from lowcomm.collectives.base import Collective, CollectiveError, GroupKey, NotInRound
from lowcomm.collectives.combiners import DenseMean, SparseBundle
from lowcomm.collectives.local import LocalCollective, LocalGroup

KEY = GroupKey("local-test")
SHAPES = [(96, 100), (70,), (64, 128), (3, 4, 5)]
NUMEL = sum(math.prod(s) for s in SHAPES)


def payload(seed: int, numel: int = 1003) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * (seed + 1)


def dense_by_hand(codec: str, payloads: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """What ShardedReduce's members apply: per shard, each part encoded, accepted, averaged, encoded, decoded."""
    combiner = DenseMean(codec, zstd_level=1)
    members = sorted(payloads)
    numel = next(iter(payloads.values())).numel()
    values = []
    for owner, bounds in zip(members, combiner.shard_bounds(len(members), numel)):
        items = {m: (combiner.own(payloads[m], bounds) if m == owner
                     else combiner.accept(combiner.encode(payloads[m], bounds), bounds), weights[m]) for m in members}
        values.append(combiner.finish(combiner.close(items, bounds), bounds))
    return torch.cat(values)


def run_round(group: LocalGroup, payloads: dict[str, object], weights: dict[str, float], round_: int = 0):
    handles = {m: group.member(m).start(KEY, round_, p, weights[m]) for m, p in payloads.items()}
    return {m: h.result(30) for m, h in handles.items()}


@pytest.mark.parametrize("codec", ["fp32", "uint8"])
def test_dense_weighted_mean_equals_the_combiners_called_by_hand(codec):
    ids = ["peer-a", "peer-b", "peer-c"]
    payloads = {m: payload(i) for i, m in enumerate(ids)}
    weights = {"peer-a": 100.0, "peer-b": 300.0, "peer-c": 600.0}
    results = run_round(LocalGroup(ids, codec=codec, timeout_s=10), payloads, weights)
    expected = dense_by_hand(codec, payloads, weights)
    for result in results.values():
        assert result.contributors == ids and result.participants == ids
        torch.testing.assert_close(result.aggregate, expected, rtol=1e-6, atol=1e-6)
    first = results["peer-a"].aggregate
    assert all(torch.equal(r.aggregate, first) for r in results.values())  # bitwise, not just close
    if codec == "fp32":
        mean = sum(payloads[m] * weights[m] for m in ids) / sum(weights.values())
        torch.testing.assert_close(first, mean, rtol=1e-5, atol=1e-5)


def sparse_payloads(seed: int, config: SparseLoCoConfig) -> list[bytes]:
    torch.manual_seed(seed)
    deltas = [torch.randn(s) * (seed + 1) for s in SHAPES]
    return compress_all(SparseLoCoState.zeros_like(deltas), deltas, config)


def sparse_combiner(config: SparseLoCoConfig) -> SparseBundle:
    def combine(parts, shape, codec):
        return sparseloco.combine(parts, shape, config.clip)

    return SparseBundle(SHAPES, config.codec_for, combine)


def test_sparse_bundle_equals_the_clipped_scatter_mean_of_every_member():
    config = SparseLoCoConfig(topk=8)
    ids = [f"peer-{i}" for i in range(3)]
    payloads = {m: sparse_payloads(i, config) for i, m in enumerate(ids)}
    results = run_round(LocalGroup(ids, combiner=sparse_combiner(config), timeout_s=10), payloads,
                        {m: 1.0 for m in ids})
    expected = torch.cat([sparseloco.aggregate([payloads[m][i] for m in ids], config.codec_for(shape), shape,
                                               config.clip).reshape(-1) for i, shape in enumerate(SHAPES)])
    for result in results.values():
        assert result.contributors == ids
        assert result.aggregate.numel() == NUMEL
        torch.testing.assert_close(result.aggregate, expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(result.aggregate, results["peer-0"].aggregate)


def test_a_member_that_never_starts_is_left_out_by_the_deadline():
    group = LocalGroup(3, timeout_s=1.0)
    payloads = {"peer-0": payload(0), "peer-1": payload(1)}
    results = run_round(group, payloads, {"peer-0": 1.0, "peer-1": 3.0})
    mean = (payloads["peer-0"] + 3 * payloads["peer-1"]) / 4
    for result in results.values():
        assert result.contributors == ["peer-0", "peer-1"]
        assert result.participants == ["peer-0", "peer-1", "peer-2"]
        torch.testing.assert_close(result.aggregate, mean, rtol=1e-6, atol=1e-6)
    late = group.member(2).start(KEY, 0, payload(2), 1.0).result(30)  # the round closed without it
    assert late.contributors == ["peer-0", "peer-1"] and torch.equal(late.aggregate, results["peer-0"].aggregate)


def test_a_member_outside_the_round_gets_not_in_round_and_catches_up_on_the_same_result():
    group = LocalGroup(3, timeout_s=10, membership={0: ["peer-0", "peer-1"]})
    results = run_round(group, {"peer-0": payload(0), "peer-1": payload(1)}, {"peer-0": 1.0, "peer-1": 1.0})
    outsider = group.member(2)
    with pytest.raises(NotInRound) as late:
        outsider.start(KEY, 0, payload(2), 1.0).result(30)
    assert late.value.manifest.members == ["peer-0", "peer-1"]
    caught = outsider.catch_up(KEY, 0, 1003, late.value.manifest)
    assert caught.contributors == results["peer-0"].contributors
    assert torch.equal(caught.aggregate, results["peer-0"].aggregate)
    with pytest.raises(CollectiveError):
        outsider.catch_up(KEY, 7, 1003, None)  # a round nobody ran
    # round 1 is not in the mapping: every member takes part
    everyone = run_round(group, {f"peer-{i}": payload(i) for i in range(3)}, {f"peer-{i}": 1.0 for i in range(3)}, 1)
    assert everyone["peer-2"].contributors == ["peer-0", "peer-1", "peer-2"]


@pytest.mark.timeout(60)  # a guard only: without the abort the waiting member sits out its 600 s deadline
def test_abort_fails_the_open_round_and_every_later_one():
    group = LocalGroup(2, timeout_s=600)
    waiting = group.member(0).start(KEY, 0, payload(0), 1.0)
    group.abort("peer 1 failed: StepFailed")
    with pytest.raises(CollectiveError, match="peer 1 failed: StepFailed"):
        waiting.result(30)
    with pytest.raises(CollectiveError, match="aborted"):
        group.member(1).start(KEY, 1, payload(1), 1.0).result(30)


def test_before_send_hook_sees_the_round_and_a_failing_member_is_left_out():
    group = LocalGroup(3, timeout_s=1.0)
    seen = []
    group_members = [group.member(i) for i in range(3)]
    group_members[0].before_send = seen.append

    def crash(round_):
        raise RuntimeError("injected crash")

    group_members[2].before_send = crash
    handles = [m.start(KEY, 5, payload(i), 1.0) for i, m in enumerate(group_members)]
    assert [h.result(30).contributors for h in handles[:2]] == [["peer-0", "peer-1"]] * 2
    with pytest.raises(RuntimeError, match="injected crash"):
        handles[2].result(30)
    assert seen == [5]


def test_the_interface_and_its_no_ops():
    member = LocalGroup(1).member(0)
    assert isinstance(member, Collective) and isinstance(member, LocalCollective) and member.me == "peer-0"
    member.announce_ahead(KEY, 3)
    member.withdraw_ahead(KEY, 3)
    member.end_epoch(KEY)
    result = member.start(KEY, 0, torch.arange(5.0), 2.0).result(30)
    assert result.contributors == ["peer-0"] and torch.equal(result.aggregate, torch.arange(5.0))
    with pytest.raises(TypeError):
        Collective()  # abstract


def test_the_older_in_process_group_is_still_importable_from_base():
    from lowcomm.collectives.base import InProcessGroup

    group = InProcessGroup(2)
    a, b = group.replica(0).start(KEY, 0, torch.ones(4), 1.0), group.replica(1).start(KEY, 0, torch.zeros(4), 3.0)
    assert torch.equal(a.result(5).aggregate, torch.full((4,), 0.25)) and isinstance(group.replica(0), Collective)
