"""The DHT node's life: joining through initial peers is tried JOIN_ATTEMPTS times (a daemon slow to
start on a loaded host is the common failure: 1 of 33 at 32 peers on 2 cores), then refused in one
line, and a node that starts the DHT alone is not retried; a call whose DHT process dies while it
waits ends at once (a stop signal to the whole group ends that process first). hivemind.DHT is
replaced by stand-ins that fail or die on cue."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from lowcomm.transport import control
from lowcomm.transport.control import ControlPlane, DHTUnreachable
from lowcomm.transport.identity import Identity

PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def flaky_dht(monkeypatch, failures: int) -> list[dict]:
    calls: list[dict] = []

    def dht(**kwargs):
        calls.append(kwargs)
        if len(calls) <= failures:
            raise RuntimeError("Daemon failed to start: failed to connect to bootstrap peers\nmore detail")
        return object()
    monkeypatch.setattr(control.hivemind, "DHT", dht)
    monkeypatch.setattr(control, "JOIN_RETRY_S", 0.0)
    return calls


def test_a_join_that_fails_is_tried_again(monkeypatch):
    calls = flaky_dht(monkeypatch, failures=control.JOIN_ATTEMPTS - 1)
    plane = ControlPlane.start(Identity.generate(), "run", initial_peers=[PEER])
    assert len(calls) == control.JOIN_ATTEMPTS and all(c["initial_peers"] == [PEER] for c in calls)
    assert plane.run == "run"


def test_a_join_that_keeps_failing_is_one_line_saying_what_to_check(monkeypatch):
    calls = flaky_dht(monkeypatch, failures=control.JOIN_ATTEMPTS)
    with pytest.raises(DHTUnreachable) as refused:
        ControlPlane.start(Identity.generate(), "run", initial_peers=[PEER])
    assert len(calls) == control.JOIN_ATTEMPTS
    message = str(refused.value)
    assert "\n" not in message and PEER in message and "failed to connect to bootstrap peers" in message
    assert "check that the address" in message


def test_the_first_node_is_not_retried(monkeypatch):
    calls = flaky_dht(monkeypatch, failures=1)
    with pytest.raises(DHTUnreachable):
        ControlPlane.start(Identity.generate(), "run")
    assert len(calls) == 1


class DyingDHT:  # a DHT whose process dies while a call waits on it: the call's future never completes
    def __init__(self):
        self.dead = threading.Event()
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def is_alive(self) -> bool:
        return not self.dead.is_set()

    def get(self, key, latest=True, return_future=True):
        self.dead.set()  # it dies after taking the call
        return self.future


def test_a_call_whose_dht_process_dies_ends_without_waiting_out_its_deadline(monkeypatch):
    monkeypatch.setattr(control, "DHT_CALL_S", 3600.0)  # only the death can end this wait within the test's time
    dht = DyingDHT()
    plane = ControlPlane(dht, Identity.generate(), "run")
    with pytest.raises(DHTUnreachable, match="process is gone"):
        plane.live_peers()
    assert dht.future.cancelled()


class Answer:  # what hivemind's get returns: .value, a dict of subkey -> an item with .value
    def __init__(self, value):
        self.value = value


class StoredDHT:  # a DHT node that answers every get with the items given
    def __init__(self, items: dict):
        self.items = items

    def is_alive(self) -> bool:
        return True

    def get(self, key, latest=True, return_future=True):
        future = concurrent.futures.Future()
        future.set_result(Answer({subkey: Answer(value) for subkey, value in self.items.items()}))
        return future


def test_stats_are_read_signed_and_checked_and_a_bad_one_is_dropped_and_counted():
    honest, liar, impostor = Identity.generate(), Identity.generate(), Identity.generate()
    good = {"tokens": 10, "last_round": {"round": 2, "norm": 0.5, "phi": "ab"}}
    plane = ControlPlane(StoredDHT({
        honest.owner_marker: {"peer_id": honest.peer_id, "stats": good},
        liar.owner_marker: {"peer_id": liar.peer_id, "stats": {"tokens": float("nan")}},
        impostor.owner_marker: {"peer_id": honest.peer_id, "stats": good},  # signed by one, claims another
    }), Identity.generate(), "run")
    assert plane.live_stats() == {honest.peer_id: good}
    assert plane.rejected_records == 2
