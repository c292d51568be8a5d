"""A peer's stats pulled from its data plane (transport.stats_pulls, Decision 60), over real gRPC servers:
an honest peer's signed stats are taken; a peer's own stats that fail `clean_stats` (NaN), another
peer's signed stats replayed by a third, and a dead endpoint are left out, the first two counted as
refused; a peer in client mode, which cannot be dialled, is read from the DHT's stats key, which is not
read when no peer is in client mode. A peer signs its stats at most once a second, answers only for its
own run, and a pushed stats post is refused."""

from __future__ import annotations

import contextlib
import math
import socket
from types import SimpleNamespace

import pytest

from lowcomm.transport.control import PeerRecord
from lowcomm.transport.record_fields import clean_stats
from lowcomm.transport.round_posts import STATS, PostRefused, RoundPosts, post_request
from lowcomm.transport.signing import Signer
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


def test_pulled_stats_are_the_askeds_own_and_clean_and_client_mode_peers_come_from_the_dht():
    honest, liar, replayer, remote = (Signer.generate() for _ in range(4))
    refused = []
    with contextlib.ExitStack() as stack:
        honest_post = StatsPost(honest, "run", lambda: GOOD)
        records = {
            honest.peer_id: PeerRecord(honest.peer_id, serving(stack, honest_post), state="training"),
            liar.peer_id: PeerRecord(liar.peer_id, serving(stack, StatsPost(liar, "run", lambda: {"tokens": math.nan})),
                                     state="training"),
            replayer.peer_id: PeerRecord(replayer.peer_id, serving(stack, honest_post), state="training"),
            "gone": PeerRecord("gone", dead_endpoint(), state="training"),
            remote.peer_id: PeerRecord(remote.peer_id, "", state="training", client_mode=True),
        }
        dht = DhtStats("run", {remote.peer_id: clean_stats({"tokens": 7}), "stranger": clean_stats({"tokens": 9})})
        stats = LiveStats(dht, Channels(1 << 20), Traffic(), on_reject=lambda peer, reason: refused.append(peer))
        try:
            got = stats(records)
        finally:
            stats.channels.close()
    assert got == {honest.peer_id: clean_stats(GOOD), remote.peer_id: {"tokens": 7}}
    assert sorted(refused) == sorted([liar.peer_id, replayer.peer_id]) and stats.refused == 2
    assert dht.reads == 1 and stats.pulls == 4


def test_no_peer_in_client_mode_reads_no_dht_stats():
    signer = Signer.generate()
    with contextlib.ExitStack() as stack:
        records = {signer.peer_id: PeerRecord(signer.peer_id, serving(stack, StatsPost(signer, "run", lambda: GOOD)))}
        dht = DhtStats("run", {})
        stats = LiveStats(dht, Channels(1 << 20), Traffic())
        try:
            assert stats(records) == {signer.peer_id: clean_stats(GOOD)}
        finally:
            stats.channels.close()
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
