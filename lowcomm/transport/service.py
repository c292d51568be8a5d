"""The gRPC `Peer` service: counts (and paces) traffic and hands each call to the layer that owns it.

Collectives register the reduce, hole-filling and pair-exchange handlers, the runtime registers the state
provider; a call that arrives before its handler is registered gets a clear error, not a crash.
Any exception a handler raises is turned into an error status and counted, never propagated.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from lowcomm.proto import wire_pb2, wire_pb2_grpc
from lowcomm.transport.wire import Channels, Traffic, context_deadline, deadline_after

logger = logging.getLogger(__name__)


class PeerService(wire_pb2_grpc.PeerServicer):
    def __init__(self, peer_id: str, traffic: Traffic, channels: Channels):
        self.peer_id = peer_id
        self.traffic = traffic
        self.channels = channels
        self.round = 0
        self.reduce_handler: Callable | None = None
        self.shard_handler: Callable | None = None
        self.exchange_handler: Callable | None = None  # (requests, context) -> ExchangeReply
        self.exchange_cap_s = 120.0  # the longest one Exchange call may hold a server thread
        self.state_handler: Callable | None = None
        self.stage_handler = None  # pipeline.server.StageServer: forward(call) and backward(call) -> StageReply
        self.checkpointer: str | None = None  # the coordinator's peer id: its GetState calls are checkpoints
        self._errors = 0
        self._lock = threading.Lock()
        self.on_error: Callable[[str, str], None] | None = None

    @property
    def errors(self) -> int:
        return self._errors

    def _failed(self, method: str, error: Exception, context) -> None:
        with self._lock:
            self._errors += 1
        logger.warning("%s from %s failed: %s", method, context.peer(), error)
        if self.on_error is not None:
            self.on_error(method, str(error))

    def Reduce(self, request_iterator, context):
        if self.reduce_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer serves no reduce yet")
        try:
            deadline = context_deadline(context)
            requests = self.traffic.receiving(request_iterator, deadline)
            yield from self.traffic.sending(self.reduce_handler(requests, context), deadline)
        except Exception as e:  # hostile input must never take the server down
            self._failed("Reduce", e, context)
            yield wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.REJECTED, error=f"{type(e).__name__}: {e}")

    def GetShard(self, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        if self.shard_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer holds no shards")
        try:
            yield from self.traffic.sending(self.shard_handler(request, context), deadline)
        except Exception as e:
            self._failed("GetShard", e, context)
            yield wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.REJECTED, error=f"{type(e).__name__}: {e}")

    def GetState(self, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        if self.state_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer has no state to give yet")
        try:
            checkpoint = self.checkpointer is not None and request.requester == self.checkpointer
            yield from self.traffic.sending(self.state_handler(request, context), deadline, checkpoint=checkpoint)
        except Exception as e:
            self._failed("GetState", e, context)
            yield wire_pb2.StateChunk(error=f"{type(e).__name__}: {e}")

    def Exchange(self, request_iterator, context):
        if self.exchange_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer runs no pair exchange")
        deadline = context_deadline(context)
        # A client that sets no deadline and trickles its stream must not hold a server thread for
        # good: the call is cancelled after exchange_cap_s whatever the client asked for.
        cap = threading.Timer(self.exchange_cap_s, context.cancel)
        cap.daemon = True
        cap.start()
        try:
            reply = self.exchange_handler(self.traffic.receiving(request_iterator, deadline), context)
        except Exception as e:  # hostile input must never take the server down
            self._failed("Exchange", e, context)
            reply = wire_pb2.ExchangeReply(status=wire_pb2.ExchangeReply.REJECTED, error=f"{type(e).__name__}: {e}")
        finally:
            cap.cancel()
        self.traffic.count_sent(reply, deadline)
        return reply

    def StageForward(self, request, context):
        return self._stage_call("StageForward", request, context)

    def StageBackward(self, request, context):
        return self._stage_call("StageBackward", request, context)

    def _stage_call(self, method: str, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        if self.stage_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer serves no pipeline stage")
        try:
            serve = self.stage_handler.forward if method == "StageForward" else self.stage_handler.backward
            reply = serve(request)
        except Exception as e:  # hostile input must never take the server down
            self._failed(method, e, context)
            reply = wire_pb2.StageReply(status=wire_pb2.StageReply.REJECTED, error=f"{type(e).__name__}: {e}")
        self.traffic.count_sent(reply, deadline)
        return reply

    def Ping(self, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        reply = wire_pb2.PingReply(peer_id=self.peer_id, round=self.round)
        if request.dial_back:
            probe, timeout = wire_pb2.PingRequest(sender=self.peer_id), 5.0
            probe_deadline = deadline_after(timeout)
            try:
                self.traffic.count_sent(probe, probe_deadline)
                answer = self.channels.stub(request.dial_back).Ping(probe, timeout=timeout)
                self.traffic.count_received(answer, probe_deadline)
                # the asker itself must answer, not whatever else listens at that address
                reply.dial_back_ok = answer.peer_id == request.sender if request.sender else bool(answer.peer_id)
                if not reply.dial_back_ok:
                    reply.error = f"{request.dial_back} answered as {answer.peer_id or 'nobody'}, not {request.sender}"
            except grpc.RpcError as e:
                reply.error = f"dial back to {request.dial_back} failed: {e.code().name}"
        self.traffic.count_sent(reply, deadline)
        return reply
