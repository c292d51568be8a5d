"""Parts from hostile senders, at the owner of a shard: each is refused with a `reject` event and none
reaches the owner's own round, its aggregate or its server threads.

The attacks of issue 16 ("Why"): a part claiming the owner's own id, non-finite parts (the owner's
own included), an inflated weight, a decompression bomb, streams naming a far-future round, a
cancelled stream, and floods beyond the per-sender and per-server caps. Real gRPC servers on
loopback (test_sharded_reduce's nodes); assertions are on refusals and values, never on durations.
"""

from __future__ import annotations

import struct
import threading
import time

import grpc
import pytest
import torch
import zstandard

from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.reduce_messages import KIND
from lowcomm.collectives.reduce_owner import ContributionRejected, Slot, decode_contribution, validate_weight
from lowcomm.collectives.sharded_reduce import PER_SENDER_CALLS, STRANGER_CALLS
from lowcomm.compress import base as codec_base
from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import Signer, digest
from children import wait_until
from unit.test_sharded_reduce import KEY, NUMEL, SYNC, WAIT_S, Board, nodes, payload  # noqa: F401 (nodes: the fixture)

OWNER_WAIT_S = 30.0


def rejects(node) -> list[dict]:
    return [e for e in node.events if e["kind"] == "reject"]


def part(signer: Signer, round_: int, shard: int = 0, weight: float = 1.0, blob: bytes = b"", codec: str = "fp32",
         first_bytes: int | None = None, sender: str | None = None):
    """The first chunk of a part of ``blob`` signed by ``signer`` (a member lying about its own part, or,
    with ``sender``, claiming another id), carrying ``first_bytes`` of the blob (all by default)."""
    header = dict(run_id=KEY.run, group=KEY.group, round=round_, epoch=round_, sender=sender or signer.peer_id,
                  shard=shard, weight=weight, codec=codec, total_bytes=len(blob), digest=digest(blob), pieces=0,
                  piece_elems=0, norm=0.0, manifest=b"")  # open_slot's slots follow no manifest
    key, signature = signer.sign(KIND, header)
    return wire_pb2.ReduceChunk(**header, data=blob[:first_bytes], sender_key=key, signature=signature)


def open_slot(reduce, round_: int, members, owner: str, deadline_s: float = OWNER_WAIT_S) -> Slot:
    slot = Slot(KEY.group, round_, 0, frozenset(members), (0, NUMEL), reduce.combiner,
                time.monotonic() + deadline_s, owner=owner, run=KEY.run)
    return reduce.slots.open(slot)


# ---- a part claiming the owner's own id --------------------------------------------------------


def test_a_remote_part_under_the_owners_id_is_refused_and_the_owners_own_part_still_counts():
    slot = Slot(KEY.group, 0, 0, frozenset({"a", "b"}), (0, 4), DenseMean("fp32", 0), time.monotonic() + 5, owner="a")
    with pytest.raises(ContributionRejected, match="owner's own id"):
        slot.add("a", torch.ones(4), 1.0)
    slot.add("a", torch.zeros(4), 1.0, own=True)  # never a replay: the forged part did not get in
    slot.add("b", torch.ones(4), 1.0)
    blob, contributors = slot.result()
    assert contributors == ["a", "b"]


def test_streams_claiming_the_owners_id_kill_no_peer(nodes, monkeypatch):
    """The issue's attack: parts under the owner's own id, landing before the owner adds its own part."""
    members = nodes[:3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    victim = members[2]
    own = reduces[2].combiner.own

    def slow_own(payload_, bounds):  # the owner adds its own part only once both forged parts were refused
        wait_until(lambda: len(rejects(victim)) >= 2, WAIT_S, "the forged parts refused", poll_s=0.05)
        return own(payload_, bounds)

    monkeypatch.setattr(reduces[2].combiner, "own", slow_own)
    stub = members[0].channels.stub(victim.endpoint)
    combiner = DenseMean("fp32", 0)
    data = combiner.encode(torch.ones(NUMEL), combiner.shard_bounds(3, NUMEL)[2])
    attacker = members[0].signer  # signs with its own key, names the owner as sender
    forged = [stub.Reduce(iter([part(attacker, 0, shard=2, blob=data, sender=victim.id)]), timeout=WAIT_S)
              for _ in range(2)]
    payloads = [payload(i) for i in range(3)]
    handles = [r.start(KEY, 0, p, 1.0) for r, p in zip(reduces, payloads)]
    results = [h.result(WAIT_S) for h in handles]  # the victim's own round raises nothing
    for result in results:
        assert result.contributors == [n.id for n in members]
        torch.testing.assert_close(result.aggregate, sum(payloads) / 3, rtol=1e-5, atol=1e-5)
    for call in forged:
        replies = list(call)
        assert replies[0].status == wire_pb2.ReduceReply.REJECTED and "not the key of" in replies[0].error
    assert len(rejects(victim)) == 2


# ---- non-finite parts and inflated weights -----------------------------------------------------


def test_a_member_whose_delta_is_nan_is_left_out_and_poisons_no_shard(nodes):
    members = nodes[:3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    payloads = [payload(i) for i in range(3)]
    payloads[0][::7] = float("nan")
    handles = [r.start(KEY, 0, p, 1.0) for r, p in zip(reduces, payloads)]
    results = [h.result(WAIT_S) for h in handles]
    for result in results:
        assert bool(torch.isfinite(result.aggregate).all())
        assert result.contributors == sorted([members[1].id, members[2].id])
        torch.testing.assert_close(result.aggregate, (payloads[1] + payloads[2]) / 2, rtol=1e-5, atol=1e-5)
    poisoner = members[0].id  # the lowest id: it owns shard 0, and its own part must not go into it either
    assert any(e["sender"] == poisoner[:40] for e in rejects(members[0]))  # its own part, refused by itself
    assert all(any(e["sender"] == poisoner[:40] for e in rejects(n)) for n in members[1:])


def test_a_weight_above_what_a_round_can_produce_is_refused(nodes):
    with pytest.raises(ContributionRejected, match="one round can produce"):
        validate_weight(1e11, cap=4096.0)
    with pytest.raises(ContributionRejected):
        validate_weight(1e13, cap=1e14)  # the hard bound holds whatever the round's
    members = nodes[:3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    for r in reduces:
        r.max_weight = 4096.0
    payloads = [payload(i) for i in range(3)]
    weights = [4096.0, 1e11, 2048.0]  # members[1] claims the weight of millions of inner steps
    handles = [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, payloads, weights)]
    results = [h.result(WAIT_S) for h in handles]
    expected = (payloads[0] * 4096.0 + payloads[2] * 2048.0) / 6144.0
    for result in results:
        assert result.contributors == sorted([members[0].id, members[2].id])
        torch.testing.assert_close(result.aggregate, expected, rtol=1e-5, atol=1e-5)
    assert all(any("one round can produce" in e["error"] for e in rejects(n)) for n in members)


# ---- decompression bombs -----------------------------------------------------------------------


def bomb(numel: int) -> bytes:
    """A uint8 frame declaring ``numel`` codes, all zero: a few KB of zstd, ``numel`` bytes decoded."""
    header = struct.pack("<BB", codec_base.WireDType.UINT8, 1) + struct.pack("<Q", numel)
    size = len(header) + 1024 + numel
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=True).compressobj(size=size)
    out = [compressor.compress(header + bytes(1024))]
    zeros = bytes(1 << 22)
    for _ in range(numel // len(zeros)):
        out.append(compressor.compress(zeros))
    out.append(compressor.compress(bytes(numel % len(zeros))))
    out.append(compressor.flush())
    return b"LCC" + bytes([codec_base.FORMAT_VERSION, 2, codec_base.FLAG_ZSTD]) + b"".join(out)


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch):
    blob = bomb(2**28)
    assert len(blob) < 64 << 10

    class NoDecompressor:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a bomb reached the decompressor")

    monkeypatch.setattr(codec_base.zstandard, "ZstdDecompressor", NoDecompressor)
    with pytest.raises(ContributionRejected, match="declares"):
        decode_contribution(blob, "uint8", NUMEL)
    with pytest.raises(ContributionRejected, match="declares"):
        DenseMean("uint8", 1).accept(blob, (0, NUMEL))


def test_a_bomb_sent_to_an_owner_is_refused_with_a_reject_event(nodes, monkeypatch):
    owner, sender = nodes[0], nodes[1]
    spied = []
    decompressor = codec_base.zstandard.ZstdDecompressor
    monkeypatch.setattr(codec_base.zstandard, "ZstdDecompressor", lambda *a, **k: spied.append(1) or decompressor())
    reduce = owner.reduce(Board(KEY.run, {owner.id, sender.id}), codec="uint8")
    open_slot(reduce, 0, {owner.id, sender.id}, owner.id)
    blob = bomb(2**28)
    chunks = [part(sender.signer, 0, blob=blob, codec="uint8", first_bytes=4096)]
    chunks += [wire_pb2.ReduceChunk(data=blob[i:i + 4096]) for i in range(4096, len(blob), 4096)]
    reply = list(sender.channels.stub(owner.endpoint).Reduce(iter(chunks), timeout=WAIT_S))[0]
    assert reply.status == wire_pb2.ReduceReply.REJECTED and "declares" in reply.error
    assert len(rejects(owner)) == 1 and not spied  # refused from the frame's header


# ---- server threads: far-future rounds, cancellation, caps -------------------------------------


def test_streams_naming_a_far_future_round_are_refused_at_once(nodes):
    owner, sender = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, sender.id}))
    open_slot(reduce, 5, {owner.id, sender.id}, owner.id)
    stub = sender.channels.stub(owner.endpoint)
    calls = [stub.Reduce(iter([part(sender.signer, 10**6)]), timeout=OWNER_WAIT_S) for _ in range(20)]
    for call in calls:
        reply = list(call)[0]  # before the caller's deadline: no thread waits for that round
        assert reply.status == wire_pb2.ReduceReply.REJECTED and "too far ahead" in reply.error
    assert len(rejects(owner)) == 20


def test_a_cancelled_stream_frees_its_server_thread(nodes):
    owner, sender = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, sender.id}))
    reduce.sync = type(SYNC)(**{**SYNC.__dict__, "reduce_timeout_s": OWNER_WAIT_S})
    stub = sender.channels.stub(owner.endpoint)
    chunks = threading.Event()

    def stream():  # the first part, then the stream stays open
        yield part(sender.signer, 3)
        chunks.wait(OWNER_WAIT_S)

    call = stub.Reduce(stream(), timeout=OWNER_WAIT_S)
    wait_until(lambda: reduce.slots.waiting, WAIT_S, "a server thread waiting for the slot", poll_s=0.05)
    assert reduce.slots.waiting == 1
    call.cancel()
    chunks.set()
    # well before OWNER_WAIT_S, the call's end frees its thread and its place
    wait_until(lambda: reduce.slots.waiting == 0, WAIT_S, "the cancelled call's thread freed", poll_s=0.05)
    wait_until(lambda: owner.service.waiting_calls == 0, WAIT_S, "the cancelled call's place freed", poll_s=0.05)


def waiting_streams(stub, senders, round_: int, release: threading.Event):
    def stream(signer):
        yield part(signer, round_)
        release.wait(OWNER_WAIT_S)

    return [stub.Reduce(stream(s), timeout=OWNER_WAIT_S) for s in senders]


def test_calls_beyond_the_per_sender_cap_are_refused_with_resource_exhausted(nodes):
    owner, sender = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, sender.id}))
    open_slot(reduce, 0, {owner.id, sender.id}, owner.id)
    stub, release = sender.channels.stub(owner.endpoint), threading.Event()
    held = waiting_streams(stub, [sender.signer] * PER_SENDER_CALLS, 1, release)  # round 1: not open, within reach
    wait_until(lambda: reduce.slots.waiting >= PER_SENDER_CALLS, WAIT_S, "the sender's calls waiting", poll_s=0.05)
    extra = waiting_streams(stub, [sender.signer], 1, release)[0]
    with pytest.raises(grpc.RpcError) as refused:
        list(extra)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert any("too many Reduce calls" in e["error"] for e in rejects(owner))
    release.set()
    for call in held:
        call.cancel()


def test_calls_beyond_the_servers_cap_are_refused_with_resource_exhausted(nodes):
    owner, sender = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, sender.id}))
    open_slot(reduce, 0, {owner.id, sender.id}, owner.id)
    errors = []
    owner.service.on_error = lambda method, error: errors.append((method, error))
    owner.service.max_waiting_calls = 3
    stub, release = sender.channels.stub(owner.endpoint), threading.Event()
    strangers = [Signer.generate() for _ in range(4)]
    held = waiting_streams(stub, strangers[:3], 1, release)
    wait_until(lambda: owner.service.waiting_calls >= 3, WAIT_S, "three calls waiting", poll_s=0.05)
    with pytest.raises(grpc.RpcError) as refused:
        list(waiting_streams(stub, strangers[3:], 1, release)[0])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert errors and errors[0][0] == "Reduce"
    ping = sender.channels.stub(owner.endpoint).Ping(wire_pb2.PingRequest(sender=sender.id), timeout=WAIT_S)
    assert ping.peer_id == owner.id  # Ping still finds a thread
    release.set()
    for call in held:
        call.cancel()


def test_fresh_keys_hold_no_more_than_the_strangers_places_and_a_member_still_finds_one(nodes):
    """The live flood (tests/integration/test_outsider_e2e.py): fresh keys, 4 streams each, waiting for the
    next round's slot filled every waiting place, and the members' parts ended RESOURCE_EXHAUSTED."""
    owner, member = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, member.id}))
    reduce.sync = type(SYNC)(**{**SYNC.__dict__, "reduce_timeout_s": OWNER_WAIT_S})
    reduce._strangers.learn(KEY.group, {owner.id, member.id})  # as after following round 0's manifest
    open_slot(reduce, 0, {owner.id, member.id}, owner.id)
    stub, release = member.channels.stub(owner.endpoint), threading.Event()
    strangers = [Signer.generate() for _ in range(STRANGER_CALLS // PER_SENDER_CALLS + 1)]
    flood = waiting_streams(stub, [s for s in strangers for _ in range(PER_SENDER_CALLS)], 1, release)
    wait_until(lambda: reduce.slots.waiting >= STRANGER_CALLS, WAIT_S, "the strangers' calls waiting", poll_s=0.05)
    wait_until(lambda: len([e for e in rejects(owner) if "no recent manifest" in e["error"]]) >= PER_SENDER_CALLS,
               WAIT_S, "the strangers beyond their places refused", poll_s=0.05)
    assert reduce.slots.waiting == STRANGER_CALLS
    held = waiting_streams(stub, [member.signer], 1, release)  # a member's part for round 1 still waits
    wait_until(lambda: reduce.slots.waiting > STRANGER_CALLS, WAIT_S, "the member's call waiting", poll_s=0.05)
    refused = [e for e in rejects(owner) if "no recent manifest" in e["error"]]
    assert len(refused) == PER_SENDER_CALLS and member.id[:40] not in {e["sender"] for e in refused}
    release.set()
    for call in flood + held:
        call.cancel()
