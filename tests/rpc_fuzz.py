"""Shared by the RPC fuzz tests (tests/unit/test_rpc_fuzz_*.py): a real `Peer` gRPC server on
127.0.0.1 whose handlers are counted while they run, so a test can wait, bounded and without
sleeping, until every call it made is over, and then check that no call is left holding a thread
or a place among the waiting calls.

Hypothesis settings for these tests: few examples (each one is a real gRPC call on a shared,
two-core machine), no per-example deadline, derandomized so a failure replays.
"""

from __future__ import annotations

import contextlib
import os
import threading

import grpc
from hypothesis import HealthCheck, settings

from lowcomm.proto import wire_pb2_grpc
from lowcomm.transport.service import PeerService
from lowcomm.transport.wire import Channels, Traffic, start_server

SETTLE_S = 30.0  # a bound only a broken server reaches; never asserted as a duration
CHUNK_BYTES = 1 << 16


def fuzz_settings(max_examples: int):
    """`max_examples` times LOWCOMM_FUZZ_SCALE (default 1; a longer search by hand: LOWCOMM_FUZZ_SCALE=20)."""
    scaled = max(1, round(max_examples * float(os.environ.get("LOWCOMM_FUZZ_SCALE", "1"))))
    return settings(max_examples=scaled, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class WatchedService(PeerService):
    """A PeerService that counts its handlers while they run; every refusal it counts is an event."""

    def __init__(self, peer_id: str = "server", chunk_bytes: int = CHUNK_BYTES):
        super().__init__(peer_id, Traffic(), Channels(chunk_bytes))
        self.events: list[dict] = []
        self.on_error = lambda method, error: self.events.append({"kind": "reject", "method": method, "error": error})
        self.running = 0
        self._running_cond = threading.Condition()

    @contextlib.contextmanager
    def _held(self):
        with self._running_cond:
            self.running += 1
        try:
            yield
        finally:
            with self._running_cond:
                self.running -= 1
                self._running_cond.notify_all()

    def settle(self) -> None:
        """Returns once no handler runs; fails if one is still running after SETTLE_S."""
        with self._running_cond:
            assert self._running_cond.wait_for(lambda: self.running == 0, SETTLE_S), "a call still holds a thread"
        assert self.waiting_calls == 0, f"{self.waiting_calls} calls still hold a waiting place"

    def GetState(self, request, context):
        with self._held():
            yield from super().GetState(request, context)

    def GetShard(self, request, context):
        with self._held():
            yield from super().GetShard(request, context)

    def Reduce(self, request_iterator, context):
        with self._held():
            yield from super().Reduce(request_iterator, context)

    def Exchange(self, request_iterator, context):
        with self._held():
            return super().Exchange(request_iterator, context)

    def Ping(self, request, context):
        with self._held():
            return super().Ping(request, context)

    def Wake(self, request, context):
        with self._held():
            return super().Wake(request, context)

    def StageForward(self, request, context):
        with self._held():
            return super().StageForward(request, context)

    def StageBackward(self, request, context):
        with self._held():
            return super().StageBackward(request, context)


@contextlib.contextmanager
def served(service: PeerService, max_workers: int = 16):
    """(stub, endpoint) of `service` on a real gRPC server at 127.0.0.1, stopped on exit."""
    server, port = start_server(service, "127.0.0.1", 0, CHUNK_BYTES, max_workers=max_workers)
    endpoint = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(endpoint)
    try:
        yield wire_pb2_grpc.PeerStub(channel), endpoint
    finally:
        channel.close()
        server.stop(0)
        service.channels.close()


def recorded(owner, name: str) -> list:
    """Wraps ``owner.name`` so that every argument it is called with is appended to the returned list."""
    calls, original = [], getattr(owner, name)

    def wrapper(arg):
        calls.append(arg)
        return original(arg)

    setattr(owner, name, wrapper)
    return calls
