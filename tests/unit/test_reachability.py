"""Client mode at join (runtime.reachability): the flag wins; else the first helper that answers
decides, and when no helper answers the peer serves, with a warning. The dial-back itself runs over
real gRPC servers on localhost (transport.service's Ping), which dials back only the caller's own
address, on a channel it does not keep, a few at a time."""

from __future__ import annotations

import logging
import socket

import grpc
import pytest

from lowcomm.proto import wire_pb2, wire_pb2_grpc
from lowcomm.runtime import reachability
from lowcomm.runtime.reachability import HELPERS_ASKED, Reachability, decide, dial_back, explain, helpers
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.service import DIAL_BACKS, PeerService
from lowcomm.transport.wire import Channels, Traffic, start_server


def record(peer_id: str, state: str = "training", client_mode: bool = False, heartbeat: float = 0.0) -> PeerRecord:
    return PeerRecord(peer_id, f"{peer_id}:1", state=state, client_mode=client_mode, heartbeat=heartbeat)


def test_helpers_the_coordinator_first_never_me_or_a_client_mode_peer():
    records = {r.peer_id: r for r in (record("me"), record("old", heartbeat=1.0), record("fresh", heartbeat=5.0),
                                      record("coord", "coordinator"), record("hidden", client_mode=True))}
    assert helpers(records, "me", "coord") == ["coord:1", "fresh:1", "old:1"]
    many = {f"p{i}": record(f"p{i}", heartbeat=i) for i in range(10)}
    assert len(helpers(many, "me", "coord")) == HELPERS_ASKED
    assert helpers({"me": record("me")}, "me", "coord") == []


def test_the_coordinator_is_known_by_its_key_not_by_the_state_it_publishes():
    records = {r.peer_id: r for r in (record("impostor", "coordinator", heartbeat=9.0), record("peer", heartbeat=1.0),
                                      record("coord", "holder", heartbeat=0.0))}
    assert helpers(records, "me", "coord") == ["coord:1", "peer:1"]  # the impostor's state serves nothing


@pytest.mark.parametrize("state", ["leaving", "complete", "parked"])
def test_peers_on_their_way_out_or_not_yet_in_are_not_asked(state):
    records = {r.peer_id: r for r in (record("gone", state, heartbeat=9.0), record("joining", "joining"))}
    assert helpers(records, "me", "coord") == ["joining:1"]


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


def test_nobody_answering_decides_nothing_the_peer_serves():
    def silent(helper):
        raise TimeoutError("no answer")
    verdict = decide(None, ["a:1", "b:1"], silent)
    assert not verdict.client_mode and verdict.undecided and verdict.detail == "a:1: no answer; b:1: no answer"
    nobody = decide(None, [], silent)
    assert not nobody.client_mode and nobody.how == "no-helper" and "no coordinator" in nobody.detail


def test_nobody_answering_warns_in_one_line_what_to_check(caplog):
    with caplog.at_level(logging.WARNING, logger=reachability.__name__):
        warning = explain(Reachability(False, "no-helper", None, "coord:1: UNAVAILABLE"), "me:2")
    assert warning is not None and "\n" not in warning and "coordinator's gRPC --port is reachable" in warning
    assert caplog.messages == [warning]
    assert explain(Reachability(False, "dial-back", "coord:1"), "me:2") is None  # reachable: nothing to say
    assert "client mode" in explain(Reachability(True, "dial-back", "coord:1", "no answer"), "me:2")


# ---- the dial-back over gRPC -------------------------------------------------------------

class Node:
    def __init__(self, peer_id: str):
        self.id, self.traffic, self.channels = peer_id, Traffic(None), Channels(1 << 16)
        self.service = PeerService(peer_id, self.traffic, self.channels)
        self.server, port = start_server(self.service, "127.0.0.1", 0, 1 << 16)
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
    assert not ok and error.startswith("no answer from me at 127.0.0.1:")
    ok, error = dial_back(me.channels, me.traffic, "me", nodes["other"].endpoint)(helper)  # someone else answers
    assert not ok and error.startswith("no answer from me at")
    assert "UNAVAILABLE" not in error and "other" not in error  # a yes or a no, nothing a scan could read


def test_a_hostname_endpoint_is_resolved_by_the_asker(nodes):
    me, helper = nodes["me"], nodes["helper"].endpoint
    port = me.endpoint.rsplit(":", 1)[1]
    assert dial_back(me.channels, me.traffic, "me", f"localhost:{port}")(helper) == (True, "")
    ok, error = dial_back(me.channels, me.traffic, "me", f"no-such-host.invalid:{port}")(helper)
    assert not ok and "does not resolve" in error


def test_a_helper_that_cannot_be_reached_is_silent(nodes):
    me = nodes["me"]
    verdict = decide(None, [closed_port(), nodes["helper"].endpoint], dial_back(me.channels, me.traffic, "me",
                                                                                me.endpoint))
    assert verdict == Reachability(False, "dial-back", nodes["helper"].endpoint, "")


def ping(helper: Node, dial_back_to: str) -> wire_pb2.PingReply:
    with grpc.insecure_channel(helper.endpoint) as channel:  # the caller, at 127.0.0.1
        return wire_pb2_grpc.PeerStub(channel).Ping(wire_pb2.PingRequest(sender="me", dial_back=dial_back_to),
                                                    timeout=10)


@pytest.mark.parametrize("target", ["127.0.0.2:{port}", "10.9.8.7:{port}", "localhost:{port}", "[::1]:{port}"])
def test_a_dial_back_to_another_host_than_the_callers_is_answered_no_undialled(nodes, target):
    helper, me = nodes["helper"], nodes["me"]
    reply = ping(helper, target.format(port=me.endpoint.rsplit(":", 1)[1]))
    assert not reply.dial_back_ok and "this Ping came from 127.0.0.1" in reply.error
    assert helper.traffic.sent == reply.ByteSize() + 5  # the reply alone: no probe went out


@pytest.mark.parametrize("target", ["unix:/tmp/x.sock", "unix:///tmp/x.sock", "dns:///127.0.0.1:{port}",
                                    "ipv4:127.0.0.1:{port}", "127.0.0.1", "127.0.0.1:0", " 127.0.0.1:{port}",
                                    "::1:{port}", "http://127.0.0.1:{port}"])
def test_a_dial_back_target_that_is_not_host_and_port_is_refused(nodes, target):
    helper, me = nodes["helper"], nodes["me"]
    with pytest.raises(grpc.RpcError) as refused:
        ping(helper, target.format(port=me.endpoint.rsplit(":", 1)[1]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "HOST:PORT" in refused.value.details()
    assert helper.service.errors == 1  # counted as a reject


def test_dial_back_channels_are_never_cached(nodes):
    helper, me = nodes["helper"], nodes["me"]
    assert ping(helper, me.endpoint).dial_back_ok
    assert not ping(helper, closed_port()).dial_back_ok
    assert helper.channels._channels == {} and helper.channels._stubs == {}


def test_dial_backs_beyond_the_bound_are_refused(nodes, monkeypatch):
    helper, me = nodes["helper"], nodes["me"]
    for _ in range(DIAL_BACKS):  # as many probes as the bound, all still running
        assert helper.service._dial_backs.acquire(blocking=False)
    with pytest.raises(grpc.RpcError) as refused:
        ping(helper, me.endpoint)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ask another helper" in refused.value.details()
    assert helper.service.errors == 1
    monkeypatch.setattr(reachability, "BUSY_WAIT_S", 0.01)
    verdict = decide(None, [helper.endpoint], dial_back(me.channels, me.traffic, "me", me.endpoint))
    assert verdict.undecided and "RESOURCE_EXHAUSTED" in verdict.detail  # asked again, then skipped
    assert helper.service.errors == 2 + reachability.BUSY_RETRIES
    for _ in range(DIAL_BACKS):
        helper.service._dial_backs.release()
    assert ping(helper, me.endpoint).dial_back_ok
