"""Joining the DHT through initial peers is tried JOIN_ATTEMPTS times (a daemon slow to start on a
loaded host is the common failure: 1 of 33 at 32 peers on 2 cores), then refused in one line; a node
that starts the DHT alone is not retried. hivemind.DHT is replaced by a stand-in that fails on cue."""

from __future__ import annotations

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
