"""Per-method caps on a server's calls.

A stage serves one call at a time: at most MAX_STAGE_CALLS wait for it in a server, one more is
answered BUSY at once and counted (a `reject` event), and the waiting ones are served once the stage
is free. A run peer that floods a stage holds a handful of server threads, not all of them. State
requests (unsigned) hold at most their own cap of the waiting places."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from rpc_fuzz import SETTLE_S, WatchedService, served

from lowcomm.proto import wire_pb2
from lowcomm.transport.service import MAX_STAGE_CALLS

Reply = wire_pb2.StageReply


class HeldStage:
    """A stage whose calls wait, one at a time, until the test opens it."""

    def __init__(self):
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.entered = threading.Semaphore(0)

    def forward(self, call):
        self.entered.release()
        assert self.open.wait(SETTLE_S), "the test never opened the stage"
        with self.lock:
            return Reply(status=Reply.OK, serving_stage=0)

    backward = forward


def test_a_stage_flood_beyond_the_cap_is_answered_busy_and_counted():
    service = WatchedService()
    stage = HeldStage()
    service.stage_handler = stage
    with served(service, max_workers=MAX_STAGE_CALLS + 8) as (stub, _), \
            ThreadPoolExecutor(MAX_STAGE_CALLS) as pool:
        held = [pool.submit(stub.StageForward, wire_pb2.StageCall(microbatch=i), timeout=SETTLE_S)
                for i in range(MAX_STAGE_CALLS)]
        for _ in range(MAX_STAGE_CALLS):  # every one of them is inside the stage's handler
            assert stage.entered.acquire(timeout=SETTLE_S)
        extra = stub.StageBackward(wire_pb2.StageCall(microbatch=99), timeout=SETTLE_S)
        assert extra.status == Reply.BUSY and "Overloaded" in extra.error
        assert [e["method"] for e in service.events] == ["StageBackward"]
        stage.open.set()
        assert [f.result(SETTLE_S).status for f in held] == [Reply.OK] * MAX_STAGE_CALLS
        assert stub.StageForward(wire_pb2.StageCall(microbatch=100), timeout=SETTLE_S).status == Reply.OK  # places freed
        service.settle()
    assert len(service.events) == 1


def test_state_requests_hold_at_most_their_own_cap_of_the_waiting_places():
    """GetState is unsigned: a flood of state requests waiting for a far round takes at most
    METHOD_CAPS["GetState"] places (one more ends RESOURCE_EXHAUSTED, counted), and the members'
    calls still find theirs."""
    import grpc

    from lowcomm.transport.service import METHOD_CAPS

    cap = METHOD_CAPS["GetState"]
    service = WatchedService()
    release = threading.Event()
    entered = threading.Semaphore(0)

    def waiting_state(request, context):
        entered.release()
        assert release.wait(SETTLE_S), "the test never released the state requests"
        yield wire_pb2.StateChunk(error="state at round 0, below the requested one")

    service.state_handler = waiting_state
    with served(service, max_workers=cap + 8) as (stub, _), ThreadPoolExecutor(cap) as pool:
        held = [pool.submit(lambda: list(stub.GetState(wire_pb2.StateRequest(min_round=10**9), timeout=SETTLE_S)))
                for _ in range(cap)]
        for _ in range(cap):
            assert entered.acquire(timeout=SETTLE_S)
        try:
            list(stub.GetState(wire_pb2.StateRequest(min_round=10**9), timeout=SETTLE_S))
            raise AssertionError("a state request beyond the cap was served")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "GetState" in e.details()
        assert service.waiting_calls == cap < service.max_waiting_calls  # every other place is free
        assert [e["method"] for e in service.events] == ["GetState"]
        release.set()
        for f in held:
            f.result(SETTLE_S)
        service.settle()
