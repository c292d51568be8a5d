"""The streamed dense reduce on real gRPC servers: an owner replies each piece as soon as it is reduced.

One member is a ShardedReduce; the other is driven by hand over the wire (collectives.pieces), so
a test can hold its part between two pieces and see the owner's reply to the pieces already in,
or send hostile pieces. Assertions are on values, contributor lists and events, never durations.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from lowcomm.collectives import reduce_serving
from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.local import LocalGroup
from lowcomm.collectives.manifest import Manifest
from lowcomm.collectives.pieces import (AggregateSlices, Pieces, Superseded, header_digest, part_pieces,
                                        piece_bounds, read_pieces)
from lowcomm.collectives.pieces import Sink
from lowcomm.collectives.robust import Aggregate
from lowcomm.collectives.streamed_slot import StreamedSlot, check_norm
from lowcomm.compress import get_codec
from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import digest
from unit.test_sharded_reduce import KEY, SIGNERS, WAIT_S, Board, Node, weighted_mean

NUMEL = 3 * 16384 * 2 + 123  # several pieces per shard (chunk_bytes 4096: 16384 elements a piece)


@pytest.fixture
def pair():
    nodes = [Node(SIGNERS[i]) for i in range(3)]
    yield nodes
    for node in nodes:
        node.close()


def values(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def owned_by(owner: Node, members: list[Node], round_: int) -> Board:
    """A board holding round ``round_``'s manifest: every node a member, ``owner`` the only owner."""
    board = Board(KEY.run, {n.id for n in members})
    ids = sorted(n.id for n in members)
    board.manifests[(KEY.group, round_)] = Manifest(KEY.run, KEY.group, round_, 1, owner.id, ids,
                                                    {n.id: n.endpoint for n in members}, [owner.id], "fp32")
    return board


def the_manifest(owner: Node, member: Node, round_: int) -> bytes:
    """The digest of the manifest ``owned_by(owner, [owner, member], round_)`` holds."""
    return owned_by(owner, [owner, member], round_).manifests[(KEY.group, round_)].digest


def by_hand(member: Node, owner: Node, round_: int, payload: torch.Tensor, weight: float, elems: int,
            between=None, tamper=None, shard: int = 0, norm: float = 0.0):
    """``member``'s streamed part to ``owner``, sent by hand: ``between(c)`` runs before piece c is sent,
    ``tamper(c, message)`` may change a piece (or end the part: "end"). Returns the owner's reply stream."""
    header = dict(run_id=KEY.run, group=KEY.group, round=round_, epoch=round_, shard=shard, weight=weight,
                  codec="fp32", manifest=the_manifest(owner, member, round_))
    codec = get_codec("fp32", zstd_level=1)
    messages = part_pieces(member.signer, header, lambda a, b: codec.encode(payload[a:b]), payload.numel(), elems,
                           norm)

    def paced():
        for i, message in enumerate(messages):
            if i and between is not None:
                between(i - 1)
            if i and tamper is not None and tamper(i - 1, message) == "end":
                return
            yield message

    return member.channels.stub(owner.endpoint).Reduce(paced(), timeout=WAIT_S)


def test_an_owner_replies_a_piece_before_the_rest_of_a_part_has_arrived(pair):
    owner, member = pair[:2]
    reduce = owner.reduce(owned_by(owner, [owner, member], 0))
    assert reduce.streams and reduce.elems == 16384
    mine, theirs = values(0), values(1)
    handle = reduce.start(KEY, 0, mine, 1.0)
    held, released = threading.Event(), threading.Event()

    def between(c):  # the member's part stops after its first piece until the test lets it go on
        if c == 1:
            held.set()
            assert released.wait(WAIT_S)

    replies = by_hand(member, owner, 0, theirs, 3.0, reduce.elems, between=between)
    first = next(replies)  # piece 1 is not sent before `released`: this reply came from piece 0 alone
    assert held.wait(WAIT_S) and not released.is_set()
    assert first.status == wire_pb2.ReduceReply.OK and first.pieces == len(piece_bounds(NUMEL, reduce.elems))
    released.set()
    out = torch.empty(NUMEL)
    pieces, contributors = read_pieces(_chain(first, replies), "fp32", NUMEL, reduce.elems, Sink(out))
    result = handle.result(WAIT_S)
    assert contributors == result.contributors == sorted([owner.id, member.id])
    assert torch.equal(out, result.aggregate)  # both apply the same bytes
    torch.testing.assert_close(out, weighted_mean([mine, theirs], [1.0, 3.0]), rtol=1e-6, atol=1e-6)
    assert isinstance(pieces, Pieces) and len(pieces) == len(piece_bounds(NUMEL, reduce.elems))


def test_a_reply_keeps_the_pieces_its_own_part_completed_though_the_owner_took_its_shard(pair, monkeypatch):
    """The member's last piece completes the shard, and the owner takes it, before the member's call has
    started its reply: the reduced pieces stay for that reply (the owner dropped them, the member lost
    the shard and applied no update to it, and the two held different φ from then on)."""
    owner, member = pair[:2]
    reduce = owner.reduce(owned_by(owner, [owner, member], 0))
    mine, theirs = values(0), values(1)
    handle = reduce.start(KEY, 0, mine, 1.0)
    taken = []

    class TakerFirst(threading.Thread):  # the call's pieces all land and the owner takes its shard, then it replies
        def start(self):
            self.run()
            taken.append(handle.result(WAIT_S))

    monkeypatch.setattr(reduce_serving, "threading", SimpleNamespace(Thread=TakerFirst))
    replies = by_hand(member, owner, 0, theirs, 3.0, reduce.elems)
    first = next(replies)
    assert taken and first.status == wire_pb2.ReduceReply.OK, first.error
    out = torch.empty(NUMEL)
    _, contributors = read_pieces(_chain(first, replies), "fp32", NUMEL, reduce.elems, Sink(out))
    assert contributors == taken[0].contributors == sorted([owner.id, member.id])
    assert torch.equal(out, taken[0].aggregate)  # both apply the same bytes


def _chain(first, rest):
    yield first
    yield from rest


def test_every_member_of_a_streamed_round_applies_the_same_bytes(pair):
    board = Board(KEY.run, {n.id for n in pair})
    reduces = [n.reduce(board) for n in pair]
    payloads, weights = [values(i) for i in range(3)], [1.0, 2.0, 5.0]
    results = [h.result(WAIT_S) for h in [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, payloads, weights)]]
    for result in results:
        assert result.contributors == sorted(n.id for n in pair) and result.info["lost_shards"] == []
        assert torch.equal(result.aggregate, results[0].aggregate)
    torch.testing.assert_close(results[0].aggregate, weighted_mean(payloads, weights), rtol=1e-6, atol=1e-6)
    held = reduces[0].slots.held(KEY.group, 0, 1, timeout=0, manifest=reduces[0]._manifests[KEY.group].digest)
    assert isinstance(held[0], Pieces) and len(held[0]) > 1  # what it serves to a member that lost it


@pytest.mark.parametrize("attack, kept", [("forged", 1), ("out-of-order", 1), ("nan", 1), ("bomb", 1), ("cut", 2)])
def test_a_hostile_piece_is_refused_and_the_round_goes_on_without_its_part(pair, attack, kept):
    owner, member = pair[:2]
    reduce = owner.reduce(owned_by(owner, [owner, member], 0))
    mine = values(0)
    handle = reduce.start(KEY, 0, mine, 1.0)
    signed = {"nan": get_codec("fp32", zstd_level=0).encode(torch.full((reduce.elems,), float("nan"))),
              "bomb": get_codec("fp32", zstd_level=3).encode(torch.zeros(1 << 24))}  # 64 MiB in a few KB

    def tamper(c, message):
        if c == 2 and attack == "cut":
            return "end"
        if c != 1:
            return None
        if attack == "forged":
            message.data = bytes(reversed(message.data))
            message.digest = digest(message.data)  # the digest fits; the signature does not
        elif attack == "out-of-order":
            message.piece = 2
        elif attack in signed:  # a piece the sender signed itself
            message.data, message.digest = signed[attack], digest(signed[attack])
            _, message.signature = member.signer.sign("reduce-piece", {"head": head[0], "piece": 1,
                                                                       "digest": message.digest})
        return None

    head = []
    header = dict(run_id=KEY.run, group=KEY.group, round=0, epoch=0, shard=0, weight=1.0, codec="fp32",
                  manifest=the_manifest(owner, member, 0))
    head.append(header_digest({**header, "sender": member.id, "total_bytes": 0, "digest": b"",
                               "pieces": len(piece_bounds(NUMEL, reduce.elems)), "piece_elems": reduce.elems, "norm": 0.0}))
    replies = list(by_hand(member, owner, 0, values(1), 1.0, reduce.elems, tamper=tamper))
    assert replies[-1].status == wire_pb2.ReduceReply.REJECTED
    result = handle.result(WAIT_S)
    assert result.contributors == [owner.id]  # the member's part is out: only the owner's is in
    rejects = [e for e in owner.events if e["kind"] == "reject"]
    assert len(rejects) == 1 and rejects[0]["sender"] == member.id[:40]
    assert attack != "bomb" or "declares" in rejects[0]["error"]  # refused from the frame's header
    # the pieces before the bad one were reduced with the member's (signed, checked) values; the rest without
    first = slice(0, kept * reduce.elems)
    rest = slice(kept * reduce.elems, NUMEL)
    torch.testing.assert_close(result.aggregate[first], (mine[first] + values(1)[first]) / 2, rtol=1e-6, atol=1e-6)
    assert torch.equal(result.aggregate[rest], mine[rest])
    assert torch.isfinite(result.aggregate).all()


def test_a_replayed_header_does_not_cost_its_sender_its_place():
    slot = StreamedSlot(KEY.group, 0, 0, frozenset({"a", "b"}), (0, 10), "fp32", 1, 16384, float("inf"), "a", KEY.run)
    slot.begin("b", 1.0)
    with pytest.raises(ValueError, match="replay"):
        slot.begin("b", 1.0)
    slot.begin("a", 1.0, own=True)
    slot.add("a", 0, torch.ones(10))
    slot.add("b", 0, torch.full((10,), 3.0))
    pieces, contributors = slot.result()
    assert contributors == ["a", "b"]
    assert torch.equal(get_codec("fp32").decode(pieces[0]), torch.full((10,), 2.0))


def test_a_released_slot_answers_a_late_caller_with_an_error_and_holds_no_pieces():
    """Two rounds on (OwnerSlots), a slot drops its reduced pieces: a caller this late is told to ask a
    member, and a slot still reducing keeps them."""
    slot = StreamedSlot(KEY.group, 0, 0, frozenset({"a"}), (0, 40000), "fp32", 1, 16384, float("inf"), "a", KEY.run)
    slot.begin("a", 1.0, own=True)
    slot.add("a", 0, torch.ones(16384))
    slot.release()  # not done: nothing is dropped
    assert not slot.released and slot.piece(0) is not None
    for c, (start, end) in enumerate(slot.pieces[1:], start=1):
        slot.add("a", c, torch.ones(end - start))
    slot.release()
    assert slot.released and slot._reduced == [None] * len(slot.pieces)
    assert slot.contributors() == ["a"]
    with pytest.raises(CollectiveError, match="ask a member"):
        slot.piece(1)


def test_a_member_that_stops_mid_part_is_left_out_of_the_pieces_after_it():
    slot = StreamedSlot(KEY.group, 0, 0, frozenset({"a", "b"}), (0, 40000), "fp32", 1, 16384, float("inf"), "a",
                        KEY.run)
    combiner = DenseMean("fp32", 1)
    assert combiner.streams and not DenseMean("fp32", 1, Aggregate("trimmed-mean")).streams
    slot.begin("a", 1.0, own=True)
    slot.begin("b", 1.0)
    for c, (start, end) in enumerate(slot.pieces):
        slot.add("a", c, torch.ones(end - start))
    slot.add("b", 0, torch.full((16384,), 3.0))
    slot.leave_out("b")  # its stream broke after piece 0
    pieces, contributors = slot.result()
    assert contributors == ["a"] and slot.most_waiting == 1  # b's piece 0 waited for nothing but itself
    decoded = [get_codec("fp32").decode(p) for p in pieces]
    assert torch.equal(decoded[0], torch.full((16384,), 2.0))
    assert all(torch.equal(d, torch.ones_like(d)) for d in decoded[1:])


def test_a_clipping_owner_streams_the_same_median_clipped_mean_as_whole_parts(pair):
    board = Board(KEY.run, {n.id for n in pair})
    combiner = lambda: DenseMean("fp32", 1, Aggregate("median-clip"))  # noqa: E731
    reduces = [n.reduce(board, combiner=combiner()) for n in pair]
    assert all(r.streams for r in reduces)
    payloads, weights = [values(i) * (1 + 9 * i) for i in range(3)], [1.0, 2.0, 5.0]  # norms far apart
    results = [h.result(WAIT_S) for h in [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, payloads, weights)]]
    ids = sorted(n.id for n in pair)
    local = LocalGroup(ids, combiner=combiner())  # whole parts: robust.median_clip on each shard
    order = {n.id: i for i, n in enumerate(pair)}
    expected = [local.member(ids.index(n.id)).start(KEY, 0, payloads[order[n.id]], weights[order[n.id]])
                for n in pair]
    expected = expected[0].result(WAIT_S).aggregate
    for result in results:
        assert result.contributors == ids and torch.equal(result.aggregate, results[0].aggregate)
    torch.testing.assert_close(results[0].aggregate, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lie", ["smaller", "larger"])
def test_a_part_that_breaks_its_declared_norm_is_refused_at_that_piece(lie):
    slot = StreamedSlot(KEY.group, 0, 0, frozenset({"a", "b", "c"}), (0, 40000), "fp32", 1, 16384, float("inf"),
                        "a", KEY.run, clip=True)
    honest = values(5, 40000)
    for sender in ("a", "c"):
        slot.begin(sender, 1.0, own=sender == "a", norm=float(honest.norm()))
    big = values(6, 40000) * 100
    declared = float(big[:16384].norm()) if lie == "smaller" else float(big.norm()) * 2
    slot.begin("b", 1.0, norm=declared)
    refused_at = 1 if lie == "smaller" else len(slot.pieces) - 1
    for c, (start, end) in enumerate(slot.pieces):
        for sender in ("a", "c"):
            slot.add(sender, c, honest[start:end])
        if c < refused_at:
            slot.add("b", c, big[start:end])
        elif c == refused_at:
            with pytest.raises(ValueError, match="declared"):
                slot.add("b", c, big[start:end])
            slot.leave_out("b")
    pieces, contributors = slot.result()
    assert contributors == ["a", "c"]
    aggregate = torch.cat([get_codec("fp32").decode(p) for p in pieces])
    # b's share of each mean is within its weight share (1/3) of the median norm, whatever it sent
    median = float(honest.norm())
    assert float((aggregate - honest * 2 / 3)[:refused_at * 16384].norm()) <= median / 3 * (1 + 1e-3)


def test_a_header_forwarded_to_another_shards_owner_does_not_cost_its_sender_its_place(pair):
    """An owner may forward the header a member signed for its shard to another owner: refused there,
    and the member's own part for that owner still counts."""
    owner, member = pair[:2]
    reduce = owner.reduce(owned_by(owner, [owner, member], 0))
    handle = reduce.start(KEY, 0, values(0), 1.0)
    forwarded = list(by_hand(member, owner, 0, values(1), 1.0, reduce.elems, shard=1))
    assert forwarded[-1].status == wire_pb2.ReduceReply.REJECTED and "do not match" in forwarded[-1].error
    genuine = list(by_hand(member, owner, 0, values(1), 1.0, reduce.elems))
    assert all(reply.status == wire_pb2.ReduceReply.OK for reply in genuine)
    assert handle.result(WAIT_S).contributors == sorted([owner.id, member.id])


def test_a_non_finite_declared_norm_leaves_its_sender_out_at_once(pair):
    owner, member = pair[:2]
    reduce = owner.reduce(owned_by(owner, [owner, member], 0), combiner=DenseMean("fp32", 1, Aggregate("median-clip")))
    handle = reduce.start(KEY, 0, values(0), 1.0)
    replies = list(by_hand(member, owner, 0, values(1), 1.0, reduce.elems, norm=float("nan")))
    assert replies[-1].status == wire_pb2.ReduceReply.REJECTED and "declared norm" in replies[-1].error
    slot = reduce.slots.wait_slot(KEY.group, 0, timeout=0)
    assert slot.contributors() in ([], [owner.id])  # done without it, or still closing: it is not awaited
    assert member.id not in slot._active()
    assert handle.result(WAIT_S).contributors == [owner.id]
    with pytest.raises(ValueError, match="float32"):
        check_norm(1e39)  # finite, but past what the median is taken in


def test_a_replaced_reader_writes_nothing_more_into_the_aggregate():
    slices = AggregateSlices(10, [(0, 4), (4, 10)])
    late = slices.sink(1)
    late.write(0, 6, torch.ones(6))
    filler = slices.sink(1)  # the late reader timed out: a hole filler takes the shard over
    with pytest.raises(Superseded):
        late.write(0, 6, torch.full((6,), 9.0))
    filler.write(0, 6, torch.full((6,), 2.0))
    mine = slices.sink(0)
    mine.write(0, 4, torch.full((4,), 3.0))
    aggregate = slices.close()
    with pytest.raises(Superseded):  # nothing reaches the values once the round gave them out
        filler.write(0, 6, torch.zeros(6))
    assert torch.equal(aggregate, torch.tensor([3.0] * 4 + [2.0] * 6))
    assert torch.equal(slices.zero(1), torch.zeros(6))


def test_a_collective_streams_as_the_combiner_it_holds_does(pair):
    """A stage sets its algorithm's combiner after its collective is made (runtime.stage_state)."""
    reduce = pair[0].reduce(Board(KEY.run, {pair[0].id}))
    assert reduce.streams
    reduce.combiner = DenseMean("fp32", 1, Aggregate("trimmed-mean"))
    assert not reduce.streams
