"""What a peer serving a pipeline stage computes: forward, stateless backward, and its inner optimizer.

Backward is stateless (SWARM): the call carries the hop's input and the gradient of its output
(or the targets, on the last hop); the server recomputes the forward and backpropagates, so any
replica of the stage can serve a backward whichever replica served the forward. Each backward is
one inner step of the stage's AdamW (the run's [inner] settings and warm-up, times the stage's
lr scale, which CheckFree raises). Calls are served one at a time under a lock, which the runtime
also holds while the stage's replicas sync, so no call sees half-updated weights.

Throughput is work units per second of this peer's own compute: on a CPU, the thread's CPU time
(other processes sharing the cores do not make it look slower, so peers sharing one machine in a
simulation measure their own speed); on CUDA, wall time. `slowdown` F > 1 emulates a slower
device: after each computation the server stays busy (F − 1) times that compute time, and its
throughput is measured on F times it (simulate's unequal peers).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.func import functional_call

from lowcomm.algorithms.inner import InnerConfig, InnerOptimizer, NonFiniteGradient
from lowcomm.models.gpt import ModelConfig
from lowcomm.pipeline.activations import ActivationError, pack, unpack, unpack_tokens
from lowcomm.pipeline.stages import StageModule
from lowcomm.proto import wire_pb2

FORWARD_UNITS, BACKWARD_UNITS = 1.0, 2.5  # a backward (recompute included) weighs 2.5 forwards (SWARM)
EMA_ALPHA = 0.1

Reply = wire_pb2.StageReply


class StageServerConfig(Protocol):
    """What a stage server reads of the run config (the run config itself lives above pipeline)."""

    model: ModelConfig
    inner: InnerConfig


class StageServer:
    def __init__(self, config: StageServerConfig, module: StageModule, stage: int, slowdown: float = 1.0,
                 device: torch.device = torch.device("cpu")):
        self.config = config
        self.device = device
        self.lock = threading.RLock()
        self.slowdown = max(1.0, slowdown)
        self.max_elements = 4 * config.inner.batch_size * config.model.context * max(config.model.d_model,
                                                                                      config.model.vocab_size)
        self.ready = False
        self.compute_s = 0.0
        self._ema, self._ema_n = 0.0, 0
        self.load(module, stage)

    def load(self, module: StageModule, stage: int, lr_scale: float = 1.0, step: int = 0) -> None:
        """Serve `module` as stage `stage` with a fresh inner optimizer (the caller may load its state)."""
        inner = self.config.inner
        with self.lock:
            module.to(self.device)  # in place: an algorithm holding these parameters keeps them
            self.module, self.stage = module, stage
            self.inner = InnerOptimizer(module.parameters(), inner, lr_scale)
            self.optimizer = self.inner.optimizer
            self.step = step
            self.round_steps = 0  # inner steps since the last sync (the weight of this replica's Δ)
            self._phi: dict[str, torch.Tensor] | None = None  # the synced weights evaluations use

    @property
    def phi(self) -> dict[str, torch.Tensor] | None:
        return self._phi

    @phi.setter
    def phi(self, tensors: dict[str, torch.Tensor] | None) -> None:
        self._phi = None if tensors is None else {n: t.to(self.device) for n, t in tensors.items()}

    @property
    def throughput(self) -> float:
        """Work units per second of this peer's compute (bias-corrected EMA; 0 before the first call)."""
        return self._ema / (1 - (1 - EMA_ALPHA) ** self._ema_n) if self._ema_n else 0.0

    @property
    def lr_scale(self) -> float:
        return self.inner.lr_scale

    @property
    def grad_norm(self) -> float:
        return self.inner.grad_norm

    @grad_norm.setter
    def grad_norm(self, value: float) -> None:
        self.inner.grad_norm = value

    def lr_at(self, step: int) -> float:
        return self.inner.lr_at(step)

    # ---- the two calls ------------------------------------------------------------------------

    def forward(self, call: wire_pb2.StageCall) -> Reply:
        with self.lock:
            refused = self._refuse(call)
            if refused is not None:
                return refused
            t0, c0 = time.perf_counter(), time.thread_time()
            with torch.no_grad():
                x = self._input(call)
                if call.use_phi:
                    if self.phi is None:
                        return Reply(status=Reply.BUSY, error="no synced weights yet", serving_stage=self.stage)
                    out = functional_call(self.module, self.phi, (x,), {"embed": call.embed, "head": call.head})
                else:
                    out = self.module(x, embed=call.embed, head=call.head)
                if call.head:
                    targets = self._targets(call, out)
                    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
                    reply = Reply(status=Reply.OK, loss=float(loss), serving_stage=self.stage)
                else:
                    reply = Reply(status=Reply.OK, output=pack(out), serving_stage=self.stage)
            self._busy(t0, c0, FORWARD_UNITS)
            return reply

    def backward(self, call: wire_pb2.StageCall) -> Reply:
        with self.lock:
            refused = self._refuse(call)
            if refused is not None:
                return refused
            if call.use_phi:
                raise ActivationError("a backward cannot use the synced weights")
            t0, c0 = time.perf_counter(), time.thread_time()
            x = self._input(call)
            if not call.embed:
                x.requires_grad_(True)
            self.optimizer.zero_grad(set_to_none=True)
            out = self.module(x, embed=call.embed, head=call.head)
            if call.head:
                targets = self._targets(call, out)
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
                loss.backward()
            else:
                grad = unpack(call.grad_output, self.max_elements).to(self.device)
                if tuple(grad.shape) != tuple(out.shape):
                    raise ActivationError(f"grad_output {tuple(grad.shape)} for an output of {tuple(out.shape)}")
                loss = None
                out.backward(grad)
            self._inner_step()
            reply = Reply(status=Reply.OK, serving_stage=self.stage, loss=float(loss.detach()) if loss is not None else 0.0)
            if not call.embed:
                reply.output.CopyFrom(pack(x.grad))
            self._busy(t0, c0, BACKWARD_UNITS)
            return reply

    # ---- helpers ------------------------------------------------------------------------------

    def _refuse(self, call) -> Reply | None:
        if not self.ready:
            return Reply(status=Reply.BUSY, error="this peer is loading its stage", serving_stage=self.stage)
        if call.stage != self.stage:
            return Reply(status=Reply.WRONG_STAGE, error=f"this peer serves stage {self.stage}, not {call.stage}",
                         serving_stage=self.stage)
        return None

    def _input(self, call) -> torch.Tensor:
        model = self.config.model
        if call.embed:
            x = unpack_tokens(call.input, model.vocab_size, self.max_elements)
            if x.shape[1] > model.context:
                raise ActivationError(f"{x.shape[1]} tokens exceed model.context = {model.context}")
            return x.to(self.device)
        x = unpack(call.input, self.max_elements)
        if x.dim() != 3 or x.shape[2] != model.d_model or x.shape[1] > model.context:
            raise ActivationError(f"activation of shape {tuple(x.shape)}; expected [batch, <= {model.context}, "
                                  f"{model.d_model}]")
        return x.to(self.device)

    def _targets(self, call, out: torch.Tensor) -> torch.Tensor:
        targets = unpack_tokens(call.targets, self.config.model.vocab_size, self.max_elements)
        if tuple(targets.shape) != tuple(out.shape[:2]):
            raise ActivationError(f"targets {tuple(targets.shape)} for logits {tuple(out.shape)}")
        return targets.to(self.device)

    def _inner_step(self) -> None:
        try:
            self.inner.clip()
        except NonFiniteGradient as e:
            raise ActivationError(str(e)) from None
        self.inner.step(self.step)
        self.inner.zero_grad()
        self.step += 1
        self.round_steps += 1

    def _busy(self, t0: float, c0: float, units: float) -> None:
        on_cpu = self.device.type == "cpu"
        if not on_cpu:
            torch.cuda.synchronize(self.device)
        work = (time.thread_time() - c0) if on_cpu else (time.perf_counter() - t0)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * work)
        self.compute_s += time.perf_counter() - t0
        self._ema = EMA_ALPHA * (units / max(work * self.slowdown, 1e-6)) + (1 - EMA_ALPHA) * self._ema
        self._ema_n += 1
