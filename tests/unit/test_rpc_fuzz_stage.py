"""Hostile StageForward and StageBackward calls through a real gRPC server behind the runtime's guard:
random activations, shapes, token ids and flags, NaN and Inf scales, forged, unsigned, relabelled
and stranger's signatures, other runs and stages. Only a run peer's signed call reaches the stage;
a refused call is one `reject` event (not one from the guard and another from the server), leaves
the weights, the optimizer and the step alone, and holds no thread; a served call's loss and output
are finite; the stage still trains on a well-formed call afterwards.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from lowcomm.pipeline.activations import pack, pack_tokens, unpack
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import initial_stage
from lowcomm.proto import wire_pb2
from lowcomm.runtime.stage_guard import StageCallGuard
from lowcomm.transport.signing import Signer, sign_message
from rpc_fuzz import WatchedService, fuzz_settings, served
from unit.test_pipeline_driver import CONFIG

Reply = wire_pb2.StageReply
RUN = "stage-fuzz-run"
MEMBER, STRANGER = Signer.generate(), Signer.generate()
METHODS = ("StageForward", "StageBackward")
VOCAB, CONTEXT, D_MODEL = CONFIG.model.vocab_size, CONFIG.model.context, CONFIG.model.d_model
TIMEOUT_S = 60.0


def stage_replica() -> tuple[WatchedService, StageServer]:
    server = StageServer(CONFIG, initial_stage(CONFIG.model, 0, 0, 1, False), 0)
    server.ready = True
    server.phi = {name: p.detach().clone() for name, p in server.module.named_parameters()}
    service = WatchedService("replica")
    service.stage_handler = server
    service.stage_guard = StageCallGuard(RUN, lambda: {MEMBER.peer_id}, refresh_s=3600.0,
                                         on_event=lambda kind, **f: service.events.append({"kind": kind, **f}))
    return service, server


def weights(server: StageServer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in server.module.parameters()])


def tokens(shape: tuple[int, int], seed: int, high: int = VOCAB) -> wire_pb2.Activation:
    return pack_tokens(torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed)))


@st.composite
def hostile_activations(draw) -> wire_pb2.Activation:
    """Anything an Activation can hold: random shapes (zero and huge dimensions too), codes, scales."""
    dims = st.sampled_from([0, 1, 2, 4, CONTEXT, D_MODEL, VOCAB, CONTEXT + 1]) | st.integers(0, 2**32 - 1)
    shape = draw(st.lists(dims, max_size=5))
    numel = math.prod(shape) if len(shape) and math.prod(shape) <= 4096 else draw(st.integers(0, 64))
    kind = draw(st.sampled_from(["tokens", "floats", "random"]))
    if kind == "tokens":
        ids = draw(st.lists(st.sampled_from([0, VOCAB - 1, VOCAB, -1, 2**63 - 1]), min_size=numel, max_size=numel))
        return wire_pb2.Activation(shape=shape, codes=np.array(ids, dtype="<i8").tobytes(), tokens=True)
    if kind == "floats":
        blocks = -(-numel // 64)
        scale = draw(st.sampled_from([math.nan, math.inf, -1.0, 0.0, 1e38, 1.0]))
        return wire_pb2.Activation(shape=shape, codes=bytes(draw(st.binary(min_size=numel, max_size=numel))),
                                   scales=np.full(blocks, scale, dtype="<f4").tobytes())
    return wire_pb2.Activation(shape=shape, codes=draw(st.binary(max_size=300)), scales=draw(st.binary(max_size=40)),
                               tokens=draw(st.booleans()))


FIELDS = ("signing", "run_id", "stage", "flags", "input", "grad_output", "targets", "use_phi", "empty")


@st.composite
def calls(draw):
    """(method, call, how it is signed): a run peer's honest one-stage hop with up to three FIELDS made hostile."""
    bad = draw(st.sets(st.sampled_from(FIELDS), max_size=3))
    method = draw(st.sampled_from(METHODS))
    batch, seq = draw(st.integers(1, 2)), draw(st.integers(1, CONTEXT))
    seed = draw(st.integers(0, 3))
    call = wire_pb2.StageCall(run_id=RUN, stage=0, microbatch=draw(st.integers(0, 2**64 - 1)), embed=True, head=True,
                              input=tokens((batch, seq), seed), targets=tokens((batch, seq), seed + 1),
                              sender=MEMBER.peer_id)
    if "run_id" in bad:
        call.run_id = draw(st.text(max_size=40).filter(lambda run: run != RUN))
    if "stage" in bad:
        call.stage = draw(st.integers(1, 2**32 - 1))
    if "flags" in bad:
        call.embed, call.head = draw(st.sampled_from([(False, True), (True, False), (False, False)]))
        if not call.embed:  # activations of the right shape, so the flags themselves are what is tested
            call.input.CopyFrom(pack(torch.randn(batch, seq, D_MODEL, generator=torch.Generator().manual_seed(seed))))
        if not call.head:
            call.ClearField("targets")
            call.grad_output.CopyFrom(pack(torch.randn(batch, seq, D_MODEL)))
    for field in ("input", "grad_output", "targets"):
        if field in bad:
            getattr(call, field).CopyFrom(draw(hostile_activations()))
    if "empty" in bad:  # a batch of nothing: token ids and targets of one empty shape
        empty = draw(st.sampled_from([(0, seq), (batch, 0), (0, 0)]))
        call.input.CopyFrom(tokens(empty, seed))
        call.targets.CopyFrom(tokens(empty, seed))
    if "use_phi" in bad:
        call.use_phi = True
    signing = draw(st.sampled_from(["stranger", "forged", "unsigned", "relabelled", "garbage"])) \
        if "signing" in bad else "signed"
    signer = STRANGER if signing in ("stranger", "forged") else MEMBER
    if signing == "stranger":
        call.sender = STRANGER.peer_id
    if signing != "unsigned":
        sign_message(signer, METHODS[1 - METHODS.index(method)] if signing == "relabelled" else method, call)
    if signing == "garbage":
        call.sender_key, call.signature = draw(st.binary(max_size=1100)), draw(st.binary(max_size=600))
    return method, call, signing


def test_hostile_stage_calls_are_refused_once_and_leave_the_stage_untouched():
    service, server = stage_replica()
    with served(service) as (stub, _):

        @fuzz_settings(250)
        @given(hop=calls())
        def check(hop):
            method, call, signing = hop
            before, step, events = weights(server), server.step, len(service.events)
            reply = getattr(stub, method)(call, timeout=TIMEOUT_S)
            event(Reply.Status.Name(reply.status))
            service.settle()
            new_events = service.events[events:]
            if reply.status == Reply.OK:
                assert signing == "signed" and call.run_id == RUN and call.stage == 0, (method, call.sender[:8])
                assert math.isfinite(reply.loss), reply.loss
                if reply.HasField("output"):
                    assert bool(torch.isfinite(unpack(reply.output, server.max_elements)).all())
                assert new_events == []
                assert server.step == step + (method == "StageBackward")
                return
            assert reply.error and "\n" not in reply.error.strip()
            if reply.status in (Reply.REJECTED, Reply.RETRY):  # refused by a check, not by a crash in the model
                assert reply.error.split(":")[0] in ("ActivationError", "StageCallRefused", "UnknownSender"), reply.error
            kinds = [e["kind"] for e in new_events]
            refused = reply.status in (Reply.REJECTED, Reply.RETRY)
            assert kinds == (["reject"] if refused else []), (reply, new_events)
            assert (reply.status == Reply.RETRY) == (signing == "stranger" and call.run_id == RUN)  # unknown sender
            assert server.step == step and torch.equal(weights(server), before)  # nothing trained

        check()
        method, call = "StageBackward", wire_pb2.StageCall(run_id=RUN, stage=0, embed=True, head=True,
                                                           input=tokens((2, 8), 0), targets=tokens((2, 8), 1),
                                                           sender=MEMBER.peer_id)
        sign_message(MEMBER, method, call)
        step = server.step
        reply = stub.StageBackward(call, timeout=TIMEOUT_S)
        assert reply.status == Reply.OK and math.isfinite(reply.loss) and server.step == step + 1
