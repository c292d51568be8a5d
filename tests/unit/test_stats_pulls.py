"""A peer's stats pulled from its data plane (transport.stats_pulls, Decision 60), over real gRPC servers:
an honest peer's signed stats are taken; a peer's own stats that fail `clean_stats` (NaN), JSON nested
past the parser's depth, another peer's signed stats replayed by a third, a dead endpoint and one that
never answers are left out, the first three counted as refused, and the read returns; an endpoint named
by two records is asked once, a peer the run does not admit not at all; a peer in client mode, which
cannot be dialled, is read from the DHT's stats key, which is not read when no peer is in client mode.
A peer signs its stats at most once a second, answers only for its own run, and a pushed stats post is
refused. The pulls' channels are bounded, the least recently used closed first."""

from __future__ import annotations

import contextlib
import math
import socket

import pytest

from lowcomm.transport.control import PeerRecord
from lowcomm.transport.record_fields import clean_stats
from lowcomm.proto import wire_pb2
from lowcomm.transport import stats_pulls
from lowcomm.transport.round_posts import SIGNED_KIND, STATS, PostRefused, RoundPosts, post_request
from lowcomm.transport.signing import Signer, sign_message
from lowcomm.transport.stats_pulls import SIGN_EVERY_S, LiveStats, StatsPost
from lowcomm.transport.wire import Channels, Traffic
from rpc_fuzz import WatchedService, served

GOOD = {"tokens": 1200, "sent": 5000, "contributed": 3, "last_round": {"round": 4, "norm": 0.5, "phi": "ab"}}


class DhtStats:
    """The DHT's stats key as ControlPlane.live_stats answers it (checked records); counts the reads."""

    def __init__(self, run: str, stats: dict[str, dict]):
        self.run, self.stats, self.reads = run, stats, 0

    def live_stats(self) -> dict[str, dict]:
        self.reads += 1
        return dict(self.stats)


def serving(stack: contextlib.ExitStack, answer) -> str:
    """The endpoint of a real gRPC server whose GetPost answers stats pulls with ``answer(run)``."""
    service = WatchedService()
    service.stats_post = answer
    _, endpoint = stack.enter_context(served(service))
    return endpoint


def dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def silent_endpoint(stack: contextlib.ExitStack) -> str:
    """A port that takes connections and never says a word (no HTTP/2, no answer)."""
    listener = stack.enter_context(socket.socket())
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return f"127.0.0.1:{listener.getsockname()[1]}"


def too_deep(signer: Signer):
    """A stats answer signed by its own peer whose record is nested past the JSON parser's depth."""
    def answer(run: str) -> wire_pb2.WakeRequest:
        request = wire_pb2.WakeRequest(group="", round=0, kind=STATS, run=run, sender=signer.peer_id,
                                       value=b"[" * 20_000)
        sign_message(signer, SIGNED_KIND, request)
        return request
    return answer


def test_pulled_stats_are_the_askeds_own_and_clean_and_client_mode_peers_come_from_the_dht(monkeypatch):
    monkeypatch.setattr(stats_pulls, "PULL_TIMEOUT_S", 0.5)  # the silent endpoint's wait: any bound will do
    honest, liar, deep, replayer, remote = (Signer.generate() for _ in range(5))
    refused = []
    with contextlib.ExitStack() as stack:
        honest_post = StatsPost(honest, "run", lambda: GOOD)
        records = {
            honest.peer_id: PeerRecord(honest.peer_id, serving(stack, honest_post), state="training"),
            liar.peer_id: PeerRecord(liar.peer_id, serving(stack, StatsPost(liar, "run", lambda: {"tokens": math.nan})),
                                     state="training"),
            deep.peer_id: PeerRecord(deep.peer_id, serving(stack, too_deep(deep)), state="training"),
            replayer.peer_id: PeerRecord(replayer.peer_id, serving(stack, honest_post), state="training"),
            "gone": PeerRecord("gone", dead_endpoint(), state="training"),
            "silent": PeerRecord("silent", silent_endpoint(stack), state="training"),
            remote.peer_id: PeerRecord(remote.peer_id, "", state="training", client_mode=True),
        }
        dht = DhtStats("run", {remote.peer_id: clean_stats({"tokens": 7}), "stranger": clean_stats({"tokens": 9})})
        stats = LiveStats(dht, Traffic(), on_reject=lambda peer, reason: refused.append(peer))
        try:
            got = stats(records)
        finally:
            stats.close()
    assert got == {honest.peer_id: clean_stats(GOOD), remote.peer_id: {"tokens": 7}}
    assert sorted(refused) == sorted(records[p.peer_id].endpoint for p in (liar, deep, replayer))
    assert stats.refused == 3 and dht.reads == 1 and stats.pulls == 6


def test_an_endpoint_named_twice_is_asked_once_and_an_unadmitted_peer_not_at_all():
    honest, outsider = Signer.generate(), Signer.generate()
    with contextlib.ExitStack() as stack:
        endpoint = serving(stack, StatsPost(honest, "run", lambda: GOOD))
        records = {peer_id: PeerRecord(peer_id, endpoint, state="training")
                   for peer_id in (honest.peer_id, "0" * 40, "f" * 40)}  # copycats on both sides of its id
        records[outsider.peer_id] = PeerRecord(outsider.peer_id, serving(stack, StatsPost(outsider, "run", lambda: GOOD)))
        stats = LiveStats(DhtStats("run", {}), Traffic(), admits=lambda peer_id: peer_id != outsider.peer_id)
        try:
            got = stats(records)
        finally:
            stats.close()
    assert stats.pulls == 1  # the shared endpoint once; the outsider not at all
    assert got == {honest.peer_id: clean_stats(GOOD)} and stats.refused == 0  # its answer is the signer's


def test_no_peer_in_client_mode_reads_no_dht_stats():
    signer = Signer.generate()
    with contextlib.ExitStack() as stack:
        records = {signer.peer_id: PeerRecord(signer.peer_id, serving(stack, StatsPost(signer, "run", lambda: GOOD)))}
        dht = DhtStats("run", {})
        stats = LiveStats(dht, Traffic())
        try:
            assert stats(records) == {signer.peer_id: clean_stats(GOOD)}
        finally:
            stats.close()
    assert dht.reads == 0


def test_a_peer_answers_for_its_own_run_only_and_signs_at_most_once_per_second():
    signer, now, calls = Signer.generate(), [100.0], []

    def summary():
        calls.append(now[0])
        return {"tokens": len(calls)}
    post = StatsPost(signer, "run", summary, clock=lambda: now[0])
    assert post("other run") is None and calls == []
    first = post("run")
    now[0] += SIGN_EVERY_S / 2
    assert post("run") is first and calls == [100.0]  # a flood of pulls costs one signature a second
    now[0] += SIGN_EVERY_S / 2
    fresh = post("run")
    assert fresh is not first and (fresh.kind, fresh.group, fresh.round, fresh.sender) == (STATS, "", 0, signer.peer_id)
    assert b'"tokens":2' in fresh.value


def test_a_pushed_stats_post_is_refused():
    signer = Signer.generate()
    posts = RoundPosts("run")
    with pytest.raises(PostRefused, match="pulled"):
        posts.accept(post_request(signer, "run", STATS, "", 0, {"peer_id": signer.peer_id, "stats": GOOD}))
    assert posts.records(STATS, "", 0) == {}


def test_bounded_channels_close_the_least_recently_used():
    channels = Channels(1 << 20, max_channels=2)
    try:
        a, b = channels.stub("127.0.0.1:1"), channels.stub("127.0.0.1:2")
        assert channels.stub("127.0.0.1:1") is a  # used again: now the most recent
        channels.stub("127.0.0.1:3")
        assert list(channels._stubs) == ["127.0.0.1:1", "127.0.0.1:3"] and len(channels._channels) == 2
        assert channels.stub("127.0.0.1:2") is not b  # closed and forgotten: a new channel
    finally:
        channels.close()
