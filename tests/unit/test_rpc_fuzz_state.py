"""Hostile GetState requests through a real gRPC server: every one is answered at once with the
holder's state or a refusal chunk, or waits no longer than its own call and the holder's cap; the
holder's snapshot is untouched, no call is left holding a thread, and a well-formed request is
still served afterwards.

A request may ask the holder to wait for a round it has not reached (joiners start at a round
boundary); such requests get a short deadline here, so their wait ends with the call.
"""

from __future__ import annotations

import math

import grpc
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowcomm.proto import wire_pb2
from lowcomm.runtime.state_transfer import StateHolder, decode_state, encode_state
from lowcomm.transport.wire import assemble
from rpc_fuzz import CHUNK_BYTES, WatchedService, fuzz_settings, served

RUN, ROUND = "fuzz-run", 5
SHAPES = {"phi.w": (40, 40), "phi.b": (7,)}
SHORT_S, LONG_S = 0.2, 5.0  # a call that may wait legitimately / one that must be answered at once


def holder_with_state() -> StateHolder:
    holder = StateHolder(RUN, chunk_bytes=1024)  # several chunks: a real stream
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    holder.publish(encode_state(tensors, ROUND, 1000, "config-hash", "phi-hash"))
    return holder


def may_wait(request: wire_pb2.StateRequest) -> bool:
    """Whether the holder may legitimately wait before answering `request`."""
    return request.run_id == RUN and request.min_round > ROUND and math.isfinite(request.wait_s) and request.wait_s > 0


def get_state(stub, request: wire_pb2.StateRequest, timeout: float) -> list[wire_pb2.StateChunk] | str:
    try:
        return list(stub.GetState(request, timeout=timeout))
    except grpc.RpcError as e:
        return e.code().name


def test_hostile_state_requests_are_answered_or_refused_without_a_wait_past_their_call():
    service, holder = WatchedService("holder"), holder_with_state()
    service.state_handler = holder.serve
    snapshot, blob = holder.snapshot, holder.snapshot.blob
    with served(service) as (stub, _):

        @fuzz_settings(100)
        @given(run_id=st.sampled_from([RUN, ""]) | st.text(max_size=200),
               requester=st.text(max_size=300),
               min_round=st.sampled_from([0, ROUND, ROUND + 1]) | st.integers(0, 2**64 - 1),
               wait_s=st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e300, -1e300])
               | st.floats(allow_nan=True, allow_infinity=True))
        def check(run_id, requester, min_round, wait_s):
            request = wire_pb2.StateRequest(run_id=run_id, requester=requester, min_round=min_round, wait_s=wait_s)
            answer = get_state(stub, request, SHORT_S if may_wait(request) else LONG_S)
            if may_wait(request):
                assert answer == "DEADLINE_EXCEEDED" or (len(answer) == 1 and answer[0].error), answer
            elif run_id != RUN or min_round > ROUND:
                assert isinstance(answer, list) and len(answer) == 1, answer  # refused at once, not waited
                assert answer[0].error and not answer[0].data and "\n" not in answer[0].error
            else:
                assert isinstance(answer, list) and not answer[0].error, answer
                assert assemble(answer[0].total_bytes, (c.data for c in answer), len(blob)) == blob
            service.settle()
            assert holder.snapshot is snapshot and snapshot.blob == blob and snapshot.round == ROUND
            assert service.errors == 0, service.events  # every refusal was an answer, none a handler's crash

        check()
        well_formed = get_state(stub, wire_pb2.StateRequest(run_id=RUN, requester="joiner", min_round=ROUND), LONG_S)
        assert well_formed[0].round == ROUND and well_formed[0].phi_hash == "phi-hash"
        data = assemble(well_formed[0].total_bytes, (c.data for c in well_formed), 1 << 20)
        assert set(decode_state(data, SHAPES)) == set(SHAPES)


def test_a_state_request_before_any_state_or_handler_is_refused_clearly():
    service = WatchedService("holder")
    with served(service) as (stub, _):
        request = wire_pb2.StateRequest(run_id=RUN, requester="joiner", min_round=0, wait_s=math.nan)
        assert get_state(stub, request, LONG_S) == "UNAVAILABLE"  # no state handler registered yet
        service.state_handler = StateHolder(RUN, CHUNK_BYTES).serve  # a holder with no snapshot yet
        for wait_s in (math.nan, math.inf, -math.inf, -1.0, 0.0):  # not a finite positive wait: no wait at all
            answer = get_state(stub, wire_pb2.StateRequest(run_id=RUN, min_round=0, wait_s=wait_s), LONG_S)
            assert "below the requested" in answer[0].error, (wait_s, answer)
            service.settle()
        assert service.errors == 0
