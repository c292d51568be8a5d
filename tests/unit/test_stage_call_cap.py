"""A stage serves one call at a time: at most MAX_STAGE_CALLS wait for it in a server, one more is
answered BUSY at once and counted (a `reject` event), and the waiting ones are served once the stage
is free. A run peer that floods a stage holds a handful of server threads, not all of them."""

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
