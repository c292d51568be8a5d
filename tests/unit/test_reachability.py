"""Client mode at join (runtime.reachability): the flag wins; else the first helper that answers
decides, and a dial-back nobody answers means client mode. The dial-back itself runs over real
gRPC servers on localhost (transport.service's Ping)."""

from __future__ import annotations

import socket

import pytest

from lowcomm.runtime.reachability import HELPERS_ASKED, Reachability, decide, dial_back, helpers
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.service import PeerService
from lowcomm.transport.wire import Channels, Traffic, start_server


def record(peer_id: str, state: str = "training", client_mode: bool = False, heartbeat: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id, f"{peer_id}:1", state=state, client_mode=client_mode, heartbeat=heartbeat)


def test_helpers_the_coordinator_first_never_me_or_a_client_mode_peer():
    records = {r.peer_id: r for r in (record("me"), record("old", heartbeat=1.0), record("fresh", heartbeat=5.0),
                                      record("coord", "coordinator"), record("hidden", client_mode=True))}
    assert helpers(records, "me") == ["coord:1", "fresh:1", "old:1"]
    many = {f"p{i}": record(f"p{i}", heartbeat=i) for i in range(10)}
    assert len(helpers(many, "me")) == HELPERS_ASKED
    assert helpers({"me": record("me")}, "me") == []


def never_asked(helper: str):
    raise AssertionError(f"asked {helper} though the flag decides")


@pytest.mark.parametrize("forced", [True, False])
def test_the_flag_decides_without_a_check(forced):
    assert decide(forced, ["coord:1"], never_asked) == Reachability(forced, "flag")


def test_a_dial_back_that_went_through_means_reachable():
    verdict = decide(None, ["coord:1", "peer:1"], lambda helper: (True, ""))
    assert verdict == Reachability(False, "dial-back", "coord:1", "")


def test_a_failed_dial_back_means_client_mode():
    verdict = decide(None, ["coord:1"], lambda helper: (False, "dial back to me:2 failed: DEADLINE_EXCEEDED"))
    assert verdict.client_mode and verdict.how == "dial-back" and "DEADLINE_EXCEEDED" in verdict.detail


def test_silent_helpers_are_skipped():
    asked = []

    def ask(helper):
        asked.append(helper)
        if helper == "gone:1":
            raise ConnectionError("no route\nsecond line")
        return True, ""
    assert decide(None, ["gone:1", "peer:1"], ask) == Reachability(False, "dial-back", "peer:1", "")
    assert asked == ["gone:1", "peer:1"]


def test_nobody_answering_means_client_mode():
    def silent(helper):
        raise TimeoutError("no answer")
    verdict = decide(None, ["a:1", "b:1"], silent)
    assert verdict.client_mode and verdict.how == "no-helper" and verdict.detail == "a:1: no answer; b:1: no answer"
    nobody = decide(None, [], silent)
    assert nobody.client_mode and nobody.how == "no-helper" and "no coordinator" in nobody.detail


# ---- the dial-back over gRPC -------------------------------------------------------------

class Node:
    def __init__(self, peer_id: str):
        self.id, self.traffic, self.channels = peer_id, Traffic(None), Channels(1 << 16)
        self.server, port = start_server(PeerService(peer_id, self.traffic, self.channels), "127.0.0.1", 0, 1 << 16)
        self.endpoint = f"127.0.0.1:{port}"

    def close(self):
        self.server.stop(0)
        self.channels.close()


@pytest.fixture
def nodes():
    made = {name: Node(name) for name in ("helper", "me", "other")}
    yield made
    for node in made.values():
        node.close()


def closed_port() -> str:
    with socket.socket() as s:  # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_dial_back_over_grpc(nodes):
    me, helper = nodes["me"], nodes["helper"].endpoint
    assert dial_back(me.channels, me.traffic, "me", me.endpoint)(helper) == (True, "")
    assert me.traffic.sent > 0 and me.traffic.received > 0
    ok, error = dial_back(me.channels, me.traffic, "me", closed_port())(helper)  # nobody listens there
    assert not ok and "failed: UNAVAILABLE" in error
    ok, error = dial_back(me.channels, me.traffic, "me", nodes["other"].endpoint)(helper)  # someone else answers
    assert not ok and "answered as other, not me" in error


def test_a_helper_that_cannot_be_reached_is_silent(nodes):
    me = nodes["me"]
    verdict = decide(None, [closed_port(), nodes["helper"].endpoint], dial_back(me.channels, me.traffic, "me",
                                                                                me.endpoint))
    assert verdict == Reachability(False, "dial-back", nodes["helper"].endpoint, "")
