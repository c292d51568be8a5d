"""A quiet peer's heartbeat (runtime.membership): it stores its DHT record only when a field others act on
changed (its round only when it leaves round 0) or half the record's lifetime passed; a stage peer's
(not quiet) stores at every beat, and a state change is stored at once either way. Only a peer in client
mode stores its stats in the DHT (the others' are pulled), and a stats store that does not return never
holds up the record's refresh."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from lowcomm.runtime import membership
from lowcomm.runtime.membership import Membership
from lowcomm.transport.control import PeerRecord


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def peer(quiet: bool, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(membership.time, "monotonic", clock)
    stored = []
    ctx = SimpleNamespace(config=SimpleNamespace(sync=SimpleNamespace(heartbeat_s=2.0, record_ttl_s=10.0)),
                          control=SimpleNamespace(publish_peer=lambda record, ttl: stored.append((record.round, record.step))),
                          options=SimpleNamespace(token=None, link=None), log=SimpleNamespace(event=lambda *a, **k: None))
    record = PeerRecord("p", "10.0.0.1:5000", state="training")
    return Membership(ctx, record, quiet=quiet), record, clock, stored


def test_a_quiet_heartbeat_stores_only_what_others_act_on_or_at_half_the_lifetime(monkeypatch):
    member, record, clock, stored = peer(True, monkeypatch)
    member.publish()  # the first store
    for step in range(1, 3):  # the step and loss move; nothing others act on does
        clock.now += 2.0
        record.step, record.loss = step, 3.0 - step / 10
        member.publish(beat=True)
    assert stored == [(0, 0)]
    clock.now += 2.0
    record.round = 1  # past round 0: stored at the next beat (a joiner downloads the state then)
    member.publish(beat=True)
    assert stored == [(0, 0), (1, 2)]
    for round_ in (2, 3):  # later rounds are learnt from the posts: not stored for themselves
        clock.now += 2.0
        record.round = round_
        member.publish(beat=True)
    assert len(stored) == 2
    clock.now += 0.9
    member.publish(beat=True)
    assert len(stored) == 2
    clock.now += 0.1  # half of the 10 s lifetime since the last store: the round it holds goes with it
    member.publish(beat=True)
    assert stored[-1] == (3, 2) and len(stored) == 3
    member.set(state="joining")  # a state change: stored at once
    assert len(stored) == 4


def test_a_stage_peers_heartbeat_stores_every_beat(monkeypatch):
    member, record, clock, stored = peer(False, monkeypatch)
    for _ in range(3):
        clock.now += 2.0
        member.publish(beat=True)
    assert len(stored) == 3


def beating(monkeypatch, publish_stats, client_mode: bool) -> tuple[Membership, threading.Event, list[str]]:
    """A peer whose heartbeat beats every 10 ms and whose stats go out at every beat: the member, an event
    set at its third record store, and the names of the threads it started."""
    monkeypatch.setattr(membership, "STATS_EVERY", 1)
    beats, stored, started = threading.Event(), [], []

    def publish_peer(record, ttl):
        stored.append(record.round)
        if len(stored) >= 3:
            beats.set()

    class Thread(threading.Thread):
        def start(self):
            started.append(self.name)
            super().start()
    monkeypatch.setattr(membership.threading, "Thread", Thread)
    control = SimpleNamespace(publish_peer=publish_peer, publish_stats=publish_stats)
    sync = SimpleNamespace(heartbeat_s=0.01, record_ttl_s=10.0)
    ctx = SimpleNamespace(config=SimpleNamespace(sync=sync), control=control,
                          stats=SimpleNamespace(summary=dict), options=SimpleNamespace(token=None, link=None),
                          log=SimpleNamespace(event=lambda *a, **k: None))
    return Membership(ctx, PeerRecord("p", "10.0.0.1:5000", state="training", client_mode=client_mode)), beats, started


def test_a_stats_store_that_does_not_return_never_holds_up_the_record(monkeypatch):
    held = threading.Event()
    member, beats, _ = beating(monkeypatch, lambda stats, ttl: held.wait(), client_mode=True)
    threading.Thread(target=member.start_heartbeat, daemon=True).start()
    try:
        assert beats.wait(60.0)  # the record's stores go on while the stats store is held
    finally:
        member._stop.set()
        held.set()


@pytest.mark.parametrize("client_mode", [False, True])
def test_only_a_peer_in_client_mode_stores_its_stats(monkeypatch, client_mode):
    """The others' stats are pulled from their data plane (transport.stats_pulls, Decision 60)."""
    stats_stored = threading.Event()
    member, beats, started = beating(monkeypatch, lambda stats, ttl: stats_stored.set(), client_mode)
    member.start_heartbeat()
    try:
        assert beats.wait(60.0)
        assert ("stats" in started) == client_mode
        assert stats_stored.wait(60.0) if client_mode else not stats_stored.is_set()
    finally:
        member._stop.set()
