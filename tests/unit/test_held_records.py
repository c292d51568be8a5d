"""A read of the peer records that misses a node's records (transport.held_records, Decision 42): a
record one read returned lives until its own expiration, a later record or tombstone of its writer
replaces it, and a stale node's older record never does."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from lowcomm.transport import control as control_module
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.held_records import HeldRecords
from lowcomm.transport.identity import Identity


def test_a_record_a_read_missed_is_held_until_its_expiration():
    held = HeldRecords()
    assert held.merge({"a": ({"x": 1}, 20.0), "b": ({"x": 2}, 30.0)}, now=10.0) == {"a": {"x": 1}, "b": {"x": 2}}
    assert held.merge({"a": ({"x": 3}, 25.0)}, now=15.0) == {"a": {"x": 3}, "b": {"x": 2}}  # b's node silent
    assert held.merge({}, now=26.0) == {"b": {"x": 2}}  # a expired at 25
    assert held.merge({}, now=30.0) == {}


def test_a_tombstone_replaces_a_record_and_an_older_record_does_not():
    held = HeldRecords()
    held.merge({"a": ({"x": 1}, 20.0)}, now=10.0)
    assert held.merge({"a": ({"x": 0}, 15.0)}, now=11.0) == {"a": {"x": 1}}  # a stale node's older record
    assert held.merge({"a": ({"gone": True}, 60.0)}, now=12.0) == {}
    assert held.merge({"a": ({"x": 1}, 20.0)}, now=13.0) == {}  # the tombstone outlives the record
    assert held.merge({"a": ({"x": 5}, 70.0)}, now=14.0) == {"a": {"x": 5}}  # a record stored after it


def test_the_records_held_are_bounded_and_the_latest_to_expire_stay():
    held = HeldRecords(max_held=2)
    assert held.merge({p: ({"p": p}, 10.0 + i) for i, p in enumerate("abc")}, now=0.0) == {"b": {"p": "b"},
                                                                                             "c": {"p": "c"}}


class ThinDHT:
    """hivemind.DHT's get as a reader sees it: answers ``reads`` in turn (a node missing from one)."""

    def __init__(self, reads):
        self.reads = list(reads)

    def is_alive(self):
        return True

    def get(self, key, latest, return_future):
        found = Future()
        entries = {ident.owner_marker: SimpleNamespace(value=value, expiration_time=expiration)
                   for ident, value, expiration in self.reads.pop(0)}
        found.set_result(SimpleNamespace(value=entries))
        return found


def test_live_peers_keeps_a_live_peer_a_thin_read_missed_and_drops_a_left_one(monkeypatch):
    a, b = Identity.generate(), Identity.generate()
    rec = {n: PeerRecord(i.peer_id, f"{n}:1", state="training").__dict__ for n, i in (("a", a), ("b", b))}
    now = {"t": 100.0}
    monkeypatch.setattr(control_module, "get_dht_time", lambda: now["t"])
    dht = ThinDHT([[(a, rec["a"], 110.0), (b, rec["b"], 110.0)],
                   [(a, rec["a"], 112.0)],  # b's records were on a node that did not answer
                   [(a, rec["a"], 114.0), (b, {"peer_id": b.peer_id, "gone": True}, 150.0)],  # b left
                   [(a, rec["a"], 114.0), (b, rec["b"], 110.0)]])  # a node that missed the tombstone
    control = ControlPlane(dht, Identity.generate(), "run")
    assert set(control.live_peers()) == {a.peer_id, b.peer_id}
    now["t"] = 102.0
    assert set(control.live_peers()) == {a.peer_id, b.peer_id}
    assert set(control.live_peers()) == {a.peer_id}
    assert set(control.live_peers()) == {a.peer_id}


def test_a_peer_record_that_claims_to_outlive_the_runs_lifetime_is_refused_once_reported(monkeypatch):
    """A stranger's record stored to expire in a year would stay live (and due) long after its writer left:
    a record claiming more than the run's lifetime, a tombstone's margin and the clock allowance is dropped
    at every read, counted each time and reported once; a record and a tombstone within it are kept."""
    a, b, s = Identity.generate(), Identity.generate(), Identity.generate()
    rec = {n: PeerRecord(i.peer_id, f"{n}:1", state="training").__dict__ for n, i in (("a", a), ("b", b), ("s", s))}
    monkeypatch.setattr(control_module, "get_dht_time", lambda: 100.0)
    ttl = 10.0
    longest = 100.0 + ttl + control_module.TOMBSTONE_MARGIN_S + control_module.CLOCK_AHEAD_S
    dht = ThinDHT([[(a, rec["a"], 100.0 + ttl), (b, rec["b"], longest), (s, rec["s"], 100.0 + 365 * 86400)]] * 2
                  + [[(a, {"peer_id": a.peer_id, "gone": True}, 100.0 + ttl + control_module.TOMBSTONE_MARGIN_S)]])
    control = ControlPlane(dht, Identity.generate(), "run")
    reports = []
    control.on_reject = lambda writer, reason: reports.append((writer, reason))
    control.max_record_ttl_s = ttl
    assert set(control.live_peers()) == {a.peer_id, b.peer_id}
    assert set(control.live_peers()) == {a.peer_id, b.peer_id}
    assert control.rejected_records == 2
    assert reports == [(s.peer_id, "a peer record that claims to live longer than the run's record lifetime")]
    assert set(control.live_peers()) == {b.peer_id}  # a's tombstone counts


def test_a_peer_record_with_an_endless_count_or_time_is_refused_and_the_read_goes_on(monkeypatch):
    """A signed record with round = inf (msgpack carries it; int() overflows) or 2^64 - 1 (msgpack's largest,
    past any run's: the round after it fits no state request), a NaN heartbeat, or a NaN expiration is dropped and counted; the other records of
    the read are answered."""
    a, r, h, e, big = (Identity.generate() for _ in range(5))
    good = PeerRecord(a.peer_id, "a:1", state="training").__dict__
    monkeypatch.setattr(control_module, "get_dht_time", lambda: 100.0)
    dht = ThinDHT([[(a, good, 110.0), (r, {**PeerRecord(r.peer_id, "r:1").__dict__, "round": float("inf")}, 110.0),
                    (h, {**PeerRecord(h.peer_id, "h:1").__dict__, "heartbeat": float("nan")}, 110.0),
                    (e, PeerRecord(e.peer_id, "e:1").__dict__, float("nan")),
                    (big, {**PeerRecord(big.peer_id, "big:1").__dict__, "round": 2 ** 64 - 1}, 110.0)]])
    control = ControlPlane(dht, Identity.generate(), "run")
    reports = []
    control.on_reject = lambda writer, reason: reports.append(writer)
    control.max_record_ttl_s = 10.0
    assert set(control.live_peers()) == {a.peer_id}
    assert sorted(reports) == sorted([r.peer_id, h.peer_id, e.peer_id, big.peer_id])
