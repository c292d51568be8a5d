"""Hostile Pings through a real gRPC server: whatever the sender and dial-back fields hold, the peer
answers with its own id, or refuses a dial-back target that is not HOST:PORT with INVALID_ARGUMENT
(a `reject`), and it dials only the caller's own address (127.0.0.1 here) at the port named, on a
channel it does not keep, never another host. No dial-back place is left taken.
"""

from __future__ import annotations

import socket

import grpc
from hypothesis import given
from hypothesis import strategies as st

from lowcomm.proto import wire_pb2
from lowcomm.transport.service import DIAL_BACKS
from rpc_fuzz import WatchedService, fuzz_settings, recorded, served

ME = "pinged-peer"
TIMEOUT_S = 20.0  # a dial-back probe gives up after 5 s; never asserted as a duration


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def targets(own_port: int, dead_port: int) -> st.SearchStrategy[tuple[str, str]]:
    """(dial_back, what it is): `own` and `dead` name the caller's address, `other` another host, `bad`
    anything that is not HOST:PORT, `any` random text."""
    port = st.sampled_from([own_port, dead_port])
    other_host = st.sampled_from(["127.0.0.2", "10.9.8.7", "[::1]", "localhost", "example.com", "[2001:db8::1]"])
    unicode_digits = st.text(st.characters(categories=["Nd"]).filter(lambda c: not c.isascii()), min_size=1,
                             max_size=5)
    bad = st.one_of(
        st.builds(lambda p: f"127.0.0.1:{p}", st.sampled_from([0, 65536, -1, 10**30])),
        st.builds(lambda d: f"127.0.0.1:{d}", unicode_digits),  # a port in digits of another script
        st.builds(lambda p, pre: f"{pre}127.0.0.1:{p}", port, st.sampled_from([" ", "http://", "ipv4:", "dns:///"])),
        st.builds(lambda p, post: f"127.0.0.1:{p}{post}", port, st.sampled_from([" ", "/x", "\n", ":1"])),
        st.sampled_from(["127.0.0.1", "unix:/tmp/x.sock", ":", "[", "[]:1", "::1:80", "x" * 5000]))
    return st.one_of(
        st.builds(lambda: ("", "none")),
        st.builds(lambda p: (f"127.0.0.1:{p}", "own" if p == own_port else "dead"), port),
        st.builds(lambda p: (f"[::ffff:127.0.0.1]:{p}", "own" if p == own_port else "dead"), port),
        st.builds(lambda h, p: (f"{h}:{p}", "other"), other_host, port | st.integers(1, 65535)),
        bad.map(lambda text: (text, "bad")),
        st.text(max_size=60).map(lambda text: (text, "any")))


def test_hostile_pings_dial_only_the_callers_own_address():
    service = WatchedService(ME)
    dialled = recorded(service.channels, "once")
    with served(service) as (stub, endpoint):
        own_port, dead_port = int(endpoint.rsplit(":", 1)[1]), closed_port()

        @fuzz_settings(150)
        @given(sender=st.sampled_from([ME, "", "someone"]) | st.text(max_size=300), target=targets(own_port, dead_port))
        def check(sender, target):
            dial_back, kind = target
            dialled.clear()
            errors = service.errors
            try:
                reply = stub.Ping(wire_pb2.PingRequest(sender=sender, dial_back=dial_back), timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                assert kind in ("bad", "any"), (dial_back, e.code(), e.details())
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "HOST:PORT" in e.details()
                assert service.errors == errors + 1 and service.events[-1]["method"] == "Ping"
                assert dialled == []
            else:
                assert kind != "bad", (dial_back, reply)
                assert reply.peer_id == ME and service.errors == errors
                for target in dialled:  # only ever the caller's own address
                    assert target.rsplit(":", 1)[0] == "127.0.0.1", target
                if kind in ("none", "other"):
                    assert dialled == [] and not reply.dial_back_ok
                if kind == "other":
                    assert "this Ping came from 127.0.0.1" in reply.error
                if kind in ("own", "dead"):
                    port = int(dial_back.rsplit(":", 1)[1])
                    assert dialled == [f"127.0.0.1:{port}"]
                    assert reply.dial_back_ok == (port == own_port and sender in (ME, ""))
                    assert reply.dial_back_ok or reply.error.startswith("no answer from")
            service.settle()

        check()
        assert all(service._dial_backs.acquire(blocking=False) for _ in range(DIAL_BACKS))  # every place free
        for _ in range(DIAL_BACKS):
            service._dial_backs.release()
        assert service.channels._channels == {}  # no dial-back channel was kept
        assert stub.Ping(wire_pb2.PingRequest(sender=ME, dial_back=endpoint), timeout=TIMEOUT_S).dial_back_ok
