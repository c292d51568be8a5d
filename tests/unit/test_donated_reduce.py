"""A donated payload (Collective.start's ``donate``): a streamed round builds its aggregate in the payload.

Over real gRPC servers, a donated round gives every member the same bytes as a round that allocates
its aggregate, in the payload's own memory. In AggregateSlices, a write that reaches past what a
member's part has read of its slice (a reply ahead of the part, a hole filled or zeroed while the
part streams) ends the part first, so no aggregate value is sent as a part.
"""

from __future__ import annotations

import pytest
import torch

from children import wait_until
from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.pieces import AggregateSlices, Superseded
from lowcomm.collectives.robust import Aggregate
from lowcomm.collectives.sharded_reduce import _until_superseded
from unit.test_sharded_reduce import KEY, WAIT_S, Board
from unit.test_streamed_reduce import pair  # noqa: F401  (a fixture: three nodes)
from unit.test_streamed_reduce import values

COMBINERS = {"fp32-mean": ("fp32", "mean"), "uint8-mean": ("uint8", "mean"),
             "fp32-median-clip": ("fp32", "median-clip"), "uint8-median-clip": ("uint8", "median-clip")}


@pytest.mark.parametrize("name", sorted(COMBINERS))
def test_a_donated_round_gives_the_same_bytes_in_the_payloads_memory(pair, name):
    codec, rule = COMBINERS[name]
    board = Board(KEY.run, {n.id for n in pair})
    reduces = [n.reduce(board, codec=codec, combiner=DenseMean(codec, 1, Aggregate(rule)))
               for n in pair]
    assert all(r.streams for r in reduces)
    inputs, weights = [values(i) * (1 + 4 * i) for i in range(3)], [1.0, 2.0, 5.0]
    # round 0 allocates its aggregate; round 1 (the same members, owners and bounds) builds it in the payloads
    kept = [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, inputs, weights)]
    kept = [h.result(WAIT_S) for h in kept]
    donated = [p.clone() for p in inputs]
    handles = [r.start(KEY, 1, p, w, donate=True) for r, p, w in zip(reduces, donated, weights)]
    results = [h.result(WAIT_S) for h in handles]
    for payload, result, before, given in zip(donated, results, kept, inputs):
        assert result.contributors == sorted(n.id for n in pair) and result.info["lost_shards"] == []
        assert result.aggregate.data_ptr() == payload.data_ptr()  # no buffer of its own
        assert before.aggregate.data_ptr() != given.data_ptr()
        assert torch.equal(result.aggregate, kept[0].aggregate)  # bit for bit, on every member
    for node in pair:
        assert not [e for e in node.events if e["kind"] in ("reject", "timeout", "hole_filled")]


def test_a_donated_round_of_a_tensor_not_in_float32_leaves_it_as_it_was(pair):
    """Only the payload's flat float32 values are donated: one in another dtype is copied first."""
    board = Board(KEY.run, {pair[0].id})
    reduce = pair[0].reduce(board)
    payload = values(0).double()
    result = reduce.start(KEY, 0, payload, 1.0, donate=True).result(WAIT_S)
    assert torch.equal(payload, values(0).double())
    torch.testing.assert_close(result.aggregate, values(0))


def test_a_write_past_what_a_donated_part_read_ends_the_part():
    payload = torch.arange(12, dtype=torch.float32)
    slices = AggregateSlices(12, [(0, 8), (8, 12)], into=payload)
    read = lambda shard, a, b: slices.read_part(shard, lambda: payload[a:b].clone(), b)  # noqa: E731
    sink = slices.sink(0)
    assert torch.equal(read(0, 0, 4), torch.arange(4.0))
    sink.write(0, 4, torch.full((4,), -1.0))  # the reply to a piece the part sent: the part goes on
    assert torch.equal(read(0, 4, 8), torch.arange(4.0, 8.0))
    assert torch.equal(payload[:8], torch.tensor([-1.0] * 4 + list(range(4, 8)), dtype=torch.float32))

    slices = AggregateSlices(12, [(0, 8), (8, 12)], into=torch.arange(12, dtype=torch.float32))
    slices.read_part(0, lambda: None, 4)
    slices.sink(0).write(4, 8, torch.zeros(4))  # a reply ahead of the part (an owner that left it out)
    with pytest.raises(Superseded):
        slices.read_part(0, lambda: None, 8)
    slices.zero(1)  # a lost shard, zeroed while its part had read nothing
    with pytest.raises(Superseded):
        slices.read_part(1, lambda: None, 4)

    kept = AggregateSlices(12, [(0, 8), (8, 12)])  # a buffer of its own: the part reads the payload, not it
    kept.sink(0).write(0, 8, torch.zeros(8))
    assert kept.read_part(0, lambda: "read", 8) == "read"


def test_a_superseded_part_ends_short_instead_of_breaking_its_call():
    def part():
        yield "header"
        yield "piece 0"
        raise Superseded("overwritten")

    assert list(_until_superseded(part())) == ["header", "piece 0"]


@pytest.mark.parametrize("codec", ["fp32", "uint8"])
def test_an_owner_drops_its_reduced_pieces_once_every_member_was_replied_to(pair, codec):
    """Nobody reads a slot's reduced pieces once its owner took its shard and every member's call ended:
    they go then, not two rounds later; a member that lost its reply gets the shard from the held ones."""
    board = Board(KEY.run, {n.id for n in pair})
    reduces = [n.reduce(board, codec=codec) for n in pair]
    handles = [r.start(KEY, 0, values(i), 1.0) for i, r in enumerate(reduces)]
    results = [h.result(WAIT_S) for h in handles]
    slots = [slot for r in reduces for (group, round_), slot in r.slots._slots.items() if round_ == 0]
    assert len(slots) == 3
    wait_until(lambda: all(slot.released for slot in slots), WAIT_S, "every slot's pieces dropped")
    digest = reduces[0]._manifests[KEY.group].digest
    for j in range(3):  # what a member that lost shard j is served instead
        held = reduces[(j + 1) % 3].slots.held(KEY.group, 0, j, timeout=0, manifest=digest)
        assert not isinstance(held, str)
    assert all(torch.equal(r.aggregate, results[0].aggregate) for r in results)
