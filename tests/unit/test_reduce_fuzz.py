"""Random bytes and fields into an owner's Reduce handler: every part ends in a clean refusal (a REJECTED
reply and a `reject` event) or a valid contribution, never an exception, a wait or a changed slot.

The handler is driven in-process (no gRPC) with a stand-in call context whose deadline is short, so
a part that would wait for a slot is refused by `wait_slot` instead of holding the test.
"""

from __future__ import annotations

import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.reduce_owner import Slot
from lowcomm.compress import get_codec
from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import Signer, digest
from unit.test_sharded_reduce import KEY, Board, Node

NUMEL = 64
CODECS = ["fp32", "uint8"]


class Context:
    """What the handler asks of a gRPC call's context."""

    def time_remaining(self) -> float:
        return 0.05

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        return True


def frames() -> st.SearchStrategy[bytes]:
    valid = st.sampled_from(CODECS).map(lambda name: get_codec(name).encode(torch.randn(NUMEL)))
    mutated = st.tuples(valid, st.integers(0, 200), st.binary(min_size=1, max_size=8)).map(
        lambda t: t[0][:t[1]] + t[2] + t[0][t[1] + len(t[2]):])
    return st.one_of(st.binary(max_size=600), valid, mutated)


SIGNERS = {name: Signer.generate() for name in ("owner", "member", "stranger")}
OWNER, MEMBER = SIGNERS["owner"].peer_id, SIGNERS["member"].peer_id


@st.composite
def parts(draw) -> wire_pb2.ReduceChunk:
    """A first chunk: signed by the key it names, unsigned, or signed by a stranger's key (forged)."""
    who = draw(st.sampled_from(sorted(SIGNERS)) | st.text(max_size=80))
    signing = draw(st.sampled_from(["signed", "unsigned", "forged"]))
    round_ = draw(st.sampled_from([7, 8, 9]) | st.integers(0, 2**40))
    data = draw(frames())
    total = draw(st.none() | st.integers(0, 2**62))
    header = dict(run_id=KEY.run, group=KEY.group, round=round_, epoch=round_,
                  sender=SIGNERS[who].peer_id if who in SIGNERS else who, shard=draw(st.integers(0, 3)),
                  weight=draw(st.floats(allow_nan=True, allow_infinity=True)),
                  codec=draw(st.sampled_from(CODECS) | st.text(max_size=12)),
                  total_bytes=len(data) if total is None else total,
                  digest=draw(st.just(digest(data)) | st.binary(max_size=40)))
    chunk = wire_pb2.ReduceChunk(**header, data=data)
    signer = SIGNERS.get(who) if signing == "signed" else SIGNERS["stranger"] if signing == "forged" else None
    if signer is not None:
        chunk.sender_key, chunk.signature = signer.sign("reduce", header)
    return chunk


def test_random_parts_are_refused_cleanly_or_accepted():
    node = Node(SIGNERS["owner"])
    try:
        reduce = node.reduce(Board(KEY.run, {OWNER, MEMBER}))
        reduce.max_weight = 1e6

        @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(first=parts(), more=st.lists(st.binary(max_size=64), max_size=3))
        def check(first, more):
            slot = Slot(KEY.group, 7, 0, frozenset({OWNER, MEMBER}), (0, NUMEL), DenseMean("fp32", 0),
                        time.monotonic() + 0.05, owner=OWNER, run=KEY.run)
            reduce.slots = type(reduce.slots)()
            reduce.slots.open(slot)
            node.events.clear()
            requests = iter([first, *(wire_pb2.ReduceChunk(data=d) for d in more)])
            replies = list(reduce._serve_reduce(requests, Context()))
            assert replies
            if replies[0].status == wire_pb2.ReduceReply.REJECTED:
                assert replies[0].error and "\n" not in replies[0].error.strip()
                assert [e["kind"] for e in node.events] == ["reject"]
                assert set(slot.items) <= {MEMBER}
            else:  # accepted: only a member's signed, well-formed, finite part of the right size and weight
                assert first.sender == MEMBER and first.round == 7 and 0 < first.weight <= 1e6
                assert first.sender_key == SIGNERS["member"].key and first.digest == digest(first.data)
                values = slot.items.get(MEMBER)
                assert values is None or values[0] is None or bool(torch.isfinite(values[0]).all())

        check()
    finally:
        node.close()


class EndedContext(Context):
    """A call the client already cancelled."""

    def is_active(self) -> bool:
        return False


def test_random_shard_requests_get_a_held_shard_or_not_ready_without_waiting_past_their_call():
    node = Node(SIGNERS["owner"])
    try:
        reduce = node.reduce(Board(KEY.run, {OWNER, MEMBER}))
        reduce.slots.hold(KEY.group, 7, 0, b"held-bytes", [OWNER, MEMBER], b"manifest")

        def no_wait(*args):
            raise AssertionError("a request waited after its call ended")

        reduce.slots._cond.wait = no_wait

        @settings(max_examples=200, deadline=None)
        @given(group=st.sampled_from([KEY.group]) | st.text(max_size=20), round_=st.integers(0, 2**64 - 1),
               shard=st.integers(0, 2**32 - 1), wait_s=st.floats(allow_nan=True, allow_infinity=True),
               manifest=st.just(b"manifest") | st.binary(max_size=40))
        def check(group, round_, shard, wait_s, manifest):
            request = wire_pb2.ShardRequest(run_id=KEY.run, group=group, round=round_, shard=shard, wait_s=wait_s,
                                            manifest=manifest)
            replies = list(reduce._serve_shard(request, EndedContext()))  # a cancelled call waits for nothing
            if (group, round_, shard, manifest) == (KEY.group, 7, 0, b"manifest"):
                assert replies[0].status == wire_pb2.ReduceReply.OK and replies[0].data == b"held-bytes"
            else:
                assert [r.status for r in replies] == [wire_pb2.ReduceReply.NOT_READY]

        check()
    finally:
        node.close()
