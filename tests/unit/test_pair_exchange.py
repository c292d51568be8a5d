"""NoLoCo's pair exchange in one process over real gRPC servers: the payload format, the inbox's rules
(stale, future, replay, non-mate, bounded buffer), hostile messages, a partner that never comes and a
fast partner whose push arrives before the receiver read the manifest. A stand-in agreement hands out
the manifest, so no DHT is needed; assertions are on values and events, never on durations."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from lowcomm.algorithms.noloco import group_of
from lowcomm.collectives.base import GroupKey, NotInRound
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import Manifest
from lowcomm.collectives.pair_exchange import PairExchange
from lowcomm.collectives.pair_inbox import Inbox, InboxFull
from lowcomm.collectives.pair_payload import TensorListFormat
from lowcomm.collectives.reduce_owner import ContributionRejected
from lowcomm.compress import get_codec
from lowcomm.proto import wire_pb2, wire_pb2_grpc
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer, digest
from lowcomm.transport.wire import Channels, Traffic, start_server

SHAPES = [(3, 4), (5,)]
KEY = GroupKey("pairs-test")
CHANNEL = (KEY.run, KEY.group)
Reply = wire_pb2.ExchangeReply


def tensors_for(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


# ---------------------------------------------------------------------- payload
@pytest.mark.parametrize("codec, atol", [("fp32", 0.0), ("bf16", 2e-2), ("uint8", 0.1)])
def test_payload_round_trips_within_the_codec_precision(codec, atol):
    fmt = TensorListFormat(codec, SHAPES, zstd_level=1)
    sent = tensors_for(0)
    got = fmt.decode(fmt.encode(sent))
    assert [tuple(t.shape) for t in got] == SHAPES and all(t.dtype == torch.float32 for t in got)
    for a, b in zip(sent, got):
        torch.testing.assert_close(b, a, atol=atol, rtol=0)


def _blob(frames: list[bytes]) -> bytes:
    out = len(frames).to_bytes(4, "little")
    for frame in frames:
        out += len(frame).to_bytes(4, "little") + frame
    return out


def test_payload_refuses_anything_that_does_not_fit_the_model():
    fmt = TensorListFormat("fp32", SHAPES)
    fp32, good = get_codec("fp32", zstd_level=0), tensors_for(1)
    frames = [fp32.encode(t) for t in good]
    bad = {
        "too few tensors": _blob(frames[:1]),
        "too many tensors": _blob(frames + frames[:1]),
        "wrong shape": _blob([fp32.encode(torch.zeros(4, 3)), frames[1]]),
        "wrong numel": _blob([fp32.encode(torch.zeros(13)), frames[1]]),
        "NaN": _blob([fp32.encode(torch.full((3, 4), float("nan"))), frames[1]]),
        "Inf": _blob([frames[0], fp32.encode(torch.full((5,), float("inf")))]),
        "another codec": _blob([get_codec("uint8", zstd_level=0).encode(good[0]), frames[1]]),
        "truncated": _blob(frames)[:-3],
        "trailing bytes": _blob(frames) + b"\x00",
        "garbage": bytes(range(256)) * 3,
        "empty": b"",
    }
    for what, blob in bad.items():
        with pytest.raises(ContributionRejected):
            fmt.decode(blob)
            pytest.fail(f"accepted: {what}")
    bf16 = TensorListFormat("bf16", SHAPES)
    with pytest.raises(ContributionRejected, match="frame of|exceeds"):  # fp32 frames: larger than bf16 ones
        bf16.decode(_blob([frames[0], bf16.codecs[1].encode(good[1])]))
    with pytest.raises(ContributionRejected, match="exceeds"):
        fmt.decode(b"\x00" * (fmt.max_bytes + 1))
    assert len(fmt.decode(_blob(frames))) == 2


# ---------------------------------------------------------------------- inbox
def test_inbox_refuses_stale_future_replayed_and_foreign_contributions():
    inbox = Inbox("me", max_ahead=1, max_pending=2)
    with pytest.raises(ContributionRejected, match="unknown"):
        inbox.admit(CHANNEL, 0, "a")
    inbox.enter(CHANNEL, 5)
    with pytest.raises(ContributionRejected, match="stale"):
        inbox.admit(CHANNEL, 4, "a")
    with pytest.raises(ContributionRejected, match="future"):
        inbox.admit(CHANNEL, 7, "a")
    with pytest.raises(ContributionRejected, match="itself"):
        inbox.admit(CHANNEL, 5, "me")
    assert inbox.deliver(CHANNEL, 5, "a", "from a") is False  # buffered: the group is not known yet
    with pytest.raises(ContributionRejected, match="replay"):
        inbox.deliver(CHANNEL, 5, "a", "again")
    assert inbox.deliver(CHANNEL, 5, "intruder", "x") is False
    with pytest.raises(InboxFull):  # bounded: max_pending contributions before the group is known
        inbox.admit(CHANNEL, 5, "c")
    assert inbox.set_mates(CHANNEL, 5, frozenset({"a", "b"})) == ["intruder"]
    with pytest.raises(ContributionRejected, match="not in this peer's group"):
        inbox.admit(CHANNEL, 5, "c")
    assert inbox.deliver(CHANNEL, 5, "b", "from b") is True
    assert inbox.take(CHANNEL, 5, deadline=time.monotonic() + 60) == {"a": "from a", "b": "from b"}
    with pytest.raises(ContributionRejected, match="stale"):  # closed once taken
        inbox.admit(CHANNEL, 5, "b")
    assert inbox.buffered(CHANNEL, 5) == 0


def test_inbox_take_ends_at_the_deadline_with_what_arrived():
    inbox = Inbox("me")
    inbox.enter(CHANNEL, 0)
    inbox.set_mates(CHANNEL, 0, frozenset({"a", "b"}))
    inbox.deliver(CHANNEL, 0, "a", 1)
    assert inbox.take(CHANNEL, 0, deadline=time.monotonic() + 0.2) == {"a": 1}
    inbox.enter(CHANNEL, 1)
    inbox.set_mates(CHANNEL, 1, frozenset())  # a group of one has nothing to wait for
    assert inbox.take(CHANNEL, 1, deadline=time.monotonic() + 3600) == {}


# ---------------------------------------------------------------------- the exchange over gRPC
class StandInAgreement:
    """Hands out a fixed manifest per round; ``gate`` (an Event) can hold a member before it reads it.

    With ``announced`` (a set shared by the members' copies), a member reads the manifest only once
    every member has announced, as the DHT's manifest lists announcers only: a member announces
    after it entered the round, so no push can reach a member that has not entered it.
    """

    def __init__(self, run: str, members: dict[str, str], gate: threading.Event | None = None,
                 excluded: frozenset[str] = frozenset(), announced: set | None = None):
        self.run, self.members, self.gate, self.excluded = run, members, gate, excluded
        self.announced, self.cond = announced, threading.Condition()
        self.me = None

    def agree(self, group, round_, epoch_rounds, codec, suspects=frozenset()):
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        if self.announced is not None:
            with self.cond:
                self.announced.add(self.me)
                self.cond.notify_all()
                assert self.cond.wait_for(lambda: set(self.members) <= self.announced, 60), "a member never announced"
        ids = sorted(p for p in self.members if p not in self.excluded)
        manifest = Manifest(self.run, group, round_, epoch_rounds, ids[0], ids, {p: self.members[p] for p in ids},
                            ids, codec)
        if self.me not in ids:
            raise NotInRound(f"round {round_}: not in the manifest", manifest)
        return manifest


class Member:
    def __init__(self, signer: Signer, sync: SyncConfig):
        self.signer = signer
        self.id = signer.peer_id
        self.events = []
        self.traffic = Traffic(None)
        self.channels = Channels(sync.chunk_bytes)
        self.service = PeerService(self.id, self.traffic, self.channels)
        self.server, port = start_server(self.service, "127.0.0.1", 0, sync.chunk_bytes)
        self.endpoint = f"127.0.0.1:{port}"
        self.sync = sync

    def join(self, agreement: StandInAgreement, codec: str = "fp32") -> PairExchange:
        shared = agreement
        agreement = StandInAgreement(shared.run, shared.members, shared.gate, shared.excluded, shared.announced)
        agreement.cond, agreement.me = shared.cond, self.id
        self.exchange = PairExchange(self.signer, self.service, self.channels, self.traffic, agreement, self.sync, codec,
                                     SHAPES, lambda run, r, members: group_of(run, r, members, 2),
                                     on_event=lambda kind, **fields: self.events.append({"kind": kind, **fields}))
        return self.exchange

    def close(self):
        self.server.stop(0)
        self.channels.close()


SIGNERS = sorted((Signer.generate() for _ in range(4)), key=lambda signer: signer.peer_id)


@pytest.fixture
def swarm():
    sync = SyncConfig(reduce_timeout_s=5.0, chunk_bytes=64)  # small chunks: every push is a real stream
    members = {signer.peer_id: Member(signer, sync) for signer in SIGNERS}  # in id order
    yield members
    for m in members.values():
        m.close()


def endpoints(swarm) -> dict[str, str]:
    return {p: m.endpoint for p, m in swarm.items()}


def test_every_member_receives_exactly_its_mates_tensors_and_bytes_are_counted(swarm):
    agreement = StandInAgreement(KEY.run, endpoints(swarm), announced=set())
    exchanges = {p: m.join(agreement) for p, m in swarm.items()}
    inputs = {p: tensors_for(i) for i, p in enumerate(swarm)}
    handles = {p: ex.start(KEY, 3, inputs[p]) for p, ex in exchanges.items()}
    results = {p: h.result(60) for p, h in handles.items()}
    expected = group_of(KEY.run, 3, sorted(swarm), 2)
    digests = {r.info["record"]["pairing"] for r in results.values()}
    assert len(digests) == 1
    for p, result in results.items():
        assert result.group == expected[p] and result.contributors == list(expected[p])
        assert result.participants == sorted(swarm)
        mate = next(q for q in result.group if q != p)
        assert list(result.received) == [mate]
        for got, sent in zip(result.received[mate], inputs[mate]):
            assert torch.equal(got, sent)  # fp32: lossless
        assert result.info["record"]["pushed"] == {mate: "accepted"} or \
            result.info["record"]["pushed"] == {mate: "buffered"}
    fmt = TensorListFormat("fp32", SHAPES)
    blob_bytes = len(fmt.encode(inputs[SIGNERS[0].peer_id]))
    for m in swarm.values():
        assert m.traffic.sent >= blob_bytes and m.traffic.received >= blob_bytes
        assert not [e for e in m.events if e["kind"] in ("reject", "timeout")]


def test_a_partner_that_never_comes_costs_one_deadline_and_leaves_a_group_of_one(swarm):
    agreement = StandInAgreement(KEY.run, endpoints(swarm))
    groups = group_of(KEY.run, 0, sorted(swarm), 2)
    absent = SIGNERS[0].peer_id
    partner = next(q for q in groups[absent] if q != absent)
    exchanges = {p: m.join(agreement) for p, m in swarm.items() if p != absent}
    swarm[absent].close()  # its server is gone: pushes to it fail until the deadline
    handles = {p: ex.start(KEY, 0, tensors_for(i)) for i, (p, ex) in enumerate(exchanges.items())}
    results = {p: h.result(60) for p, h in handles.items()}
    lonely = results[partner]
    assert lonely.contributors == [partner] and lonely.received == {}
    assert lonely.info["record"]["pushed"][absent].startswith("failed")
    assert [e["missing"] for e in swarm[partner].events if e["kind"] == "timeout"] == [[absent]]
    assert lonely.info["exchange_s"] >= swarm[partner].sync.reduce_timeout_s * 0.9  # waited for the deadline
    for p, result in results.items():  # the other pair is untouched
        if p != partner:
            assert len(result.contributors) == 2


def test_a_fast_partners_push_is_buffered_until_the_receiver_reads_the_manifest(swarm):
    pair = next(g for g in group_of(KEY.run, 0, sorted(swarm), 2).values())
    fast, slow = pair
    members = {p: swarm[p].endpoint for p in pair}
    gate = threading.Event()
    fast_ex = swarm[fast].join(StandInAgreement(KEY.run, members))
    slow_ex = swarm[slow].join(StandInAgreement(KEY.run, members, gate=gate))
    slow_handle = slow_ex.start(KEY, 0, tensors_for(1))  # entered round 0, held before the manifest
    fast_result = fast_ex.start(KEY, 0, tensors_for(0)).result(60)  # ends at its deadline: slow never pushed
    assert fast_result.info["record"]["pushed"] == {slow: "buffered"}
    assert slow_ex.inbox.buffered(CHANNEL, 0) == 1
    gate.set()
    slow_result = slow_handle.result(60)
    assert slow_result.contributors == list(pair)
    for got, sent in zip(slow_result.received[fast], tensors_for(0)):
        assert torch.equal(got, sent)


def test_a_member_left_out_of_the_manifest_closes_its_round(swarm):
    left_out = SIGNERS[3].peer_id
    agreement = StandInAgreement(KEY.run, endpoints(swarm), excluded=frozenset({left_out}))
    exchange = swarm[left_out].join(agreement)
    with pytest.raises(NotInRound):
        exchange.start(KEY, 0, tensors_for(0)).result(60)
    with pytest.raises(ContributionRejected, match="stale"):
        exchange.inbox.admit(CHANNEL, 0, SIGNERS[1].peer_id)


def _push(endpoint: str, chunks: list, timeout: float = 20.0) -> str:
    channel = grpc.insecure_channel(endpoint)
    try:
        reply = wire_pb2_grpc.PeerStub(channel).Exchange(iter(chunks), timeout=timeout)
        return Reply.Status.Name(reply.status) + ":" + reply.error
    except grpc.RpcError as e:
        return f"rpc:{e.code().name}"
    finally:
        channel.close()


def test_hostile_pushes_are_refused_counted_and_the_exchange_still_works(swarm):
    pair = next(g for g in group_of(KEY.run, 4, sorted(swarm), 2).values())
    target, mate = pair
    outsider = next(p for p in swarm if p not in pair)
    members = {p: swarm[p].endpoint for p in pair}
    gate = threading.Event()
    target_ex = swarm[target].join(StandInAgreement(KEY.run, members, gate=gate))
    handle = target_ex.start(KEY, 4, tensors_for(0))  # the target is in round 4, before the manifest
    fmt = TensorListFormat("fp32", SHAPES)
    good = fmt.encode(tensors_for(1))
    nan = fmt.encode([torch.full((3, 4), float("nan")), torch.zeros(5)])
    wrong_shape = _blob([get_codec("fp32", zstd_level=0).encode(torch.zeros(2, 6)),
                         get_codec("fp32", zstd_level=0).encode(torch.zeros(5))])
    header = dict(run_id=KEY.run, group=KEY.group, round=4, sender=mate, codec="fp32")

    def signed(blob=good, total=None, data=None, signer=None, **overrides):
        """The first chunk of a push of ``blob``, signed by its sender's key (or by ``signer``'s)."""
        fields = {**header, **overrides, "total_bytes": len(blob) if total is None else total, "digest": digest(blob)}
        key, signature = (signer or swarm[fields["sender"]].signer).sign("exchange", fields)
        return wire_pb2.ExchangeChunk(**fields, data=blob if data is None else data, sender_key=key,
                                      signature=signature)

    def push(blob=good, **overrides):
        return _push(swarm[target].endpoint, [signed(blob, **overrides)])

    unsigned = signed()
    unsigned.ClearField("signature")

    answers = {
        "stale round": push(round=3),
        "future round": push(round=9),
        "other run": push(run_id="another-run"),
        "other codec": push(codec="uint8"),
        "malformed": push(blob=b"\x02\x00\x00\x00garbage"),
        "wrong shape": push(blob=wrong_shape),
        "NaN": push(blob=nan),
        "oversized declaration": _push(swarm[target].endpoint, [signed(total=1 << 40, data=b"x")]),
        "truncated stream": _push(swarm[target].endpoint, [signed(data=good[:-5])]),
        "forged sender": _push(swarm[target].endpoint, [signed(signer=swarm[outsider].signer)]),
        "tampered payload": _push(swarm[target].endpoint, [signed(data=fmt.encode(tensors_for(2)))]),
        "unsigned": _push(swarm[target].endpoint, [unsigned]),
        "empty stream": _push(swarm[target].endpoint, []),
    }
    for what, answer in answers.items():
        assert answer.startswith("REJECTED"), (what, answer)
    # A push from a non-member is buffered while the target does not know its group (no way to tell
    # yet), then dropped and counted once the manifest shows it is not a mate.
    assert push(sender=outsider).startswith("BUFFERED")
    rejects_before = target_ex.rejected
    assert rejects_before == len(answers)
    gate.set()
    mate_ex = swarm[mate].join(StandInAgreement(KEY.run, members))
    mate_result = mate_ex.start(KEY, 4, tensors_for(1)).result(60)
    result = handle.result(60)
    assert result.contributors == list(pair) and mate_result.contributors == list(pair)
    assert target_ex.rejected == rejects_before + 1  # the outsider, dropped when the group became known
    assert push(sender=mate).startswith("REJECTED")  # the round is closed now: stale
    rejects = [e for e in swarm[target].events if e["kind"] == "reject"]
    assert len(rejects) == target_ex.rejected
    assert swarm[target].service.errors == 0  # every refusal was handled, none escaped to the server
