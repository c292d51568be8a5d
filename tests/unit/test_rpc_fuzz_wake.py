"""Hostile Wakes through a real gRPC server: whatever group and round they name, a wake is answered at
once; a group that is not a printable name of bounded size is refused with INVALID_ARGUMENT (a
`reject`); a wake for a round nobody waits on is dropped and holds no memory; a wake for the round a
waiter watches ends its wait. No call is left holding a thread.
"""

from __future__ import annotations

import threading

import grpc
from hypothesis import given
from hypothesis import strategies as st

from lowcomm.proto import wire_pb2
from lowcomm.transport.wakeups import MAX_GROUP_CHARS
from rpc_fuzz import WatchedService, fuzz_settings, served

TIMEOUT_S = 20.0  # a bound only a hung server reaches; never asserted as a duration
WAIT_S = 60.0


def test_hostile_wakes_are_answered_refused_or_dropped():
    service = WatchedService("woken-peer")
    with served(service) as (stub, _):

        @fuzz_settings(150)
        @given(group=st.text(max_size=2 * MAX_GROUP_CHARS) | st.sampled_from(["0-0", "x" * 5000, "a\x00b"]),
               round_=st.integers(0, 2**64 - 1))
        def check(group, round_):
            errors = service.errors
            fine = len(group) <= MAX_GROUP_CHARS and group.isprintable()
            try:
                stub.Wake(wire_pb2.WakeRequest(group=group, round=round_), timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                assert not fine, (group, e.code(), e.details())
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "printable name" in e.details()
                assert service.errors == errors + 1 and service.events[-1]["method"] == "Wake"
            else:
                assert fine, group
                assert service.errors == errors
            service.settle()

        check()
        assert service.wakeups._waiting == {} and service.wakeups._woken == set()  # nothing kept
        assert service.wakeups.received == 0

        woken = []
        with service.wakeups.watching("0-0", 7):
            waiter = threading.Thread(target=lambda: woken.append(service.wakeups.wait("0-0", 7, WAIT_S)))
            waiter.start()
            stub.Wake(wire_pb2.WakeRequest(group="0-0", round=6), timeout=TIMEOUT_S)  # another round: dropped
            stub.Wake(wire_pb2.WakeRequest(group="0-0", round=7), timeout=TIMEOUT_S)
            waiter.join(WAIT_S + 5)
        assert woken == [True] and service.wakeups.received == 1
        assert service.wakeups._waiting == {}
