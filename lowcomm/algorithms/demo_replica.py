"""A DeMo replica on a real collective: the peer-facing side of algorithms.demo.

DeMo syncs every optimizer step, like the ddp baseline, so it runs in membership epochs (no DHT
per step), and its own sign update replaces the inner optimizer's step. Each step the replica
folds η·g into its residuals δ, sends the top-k DCT coefficients of every parameter (one
``dct-topk`` payload each) and hands the list to a collective built with ``combiner(config,
shapes)``: owners forward the contributors' payloads and every member computes ``demo.combine``
(U = IDCT of the scatter-mean, with the zero band) and ``demo.apply_update``, p ← p·(1 − ηλ) −
η·sign(U): the functions the golden tests pin. Every replica applies the same signs, so the
parameters themselves are the shared state (a joiner downloads them; δ stays local).

With ``overlap`` (`demo.overlap`, Psyche's production DeMo) a step's update lands one step late:
step t sends its payload, then applies step t − 1's U, which had step t's forward and backward to
travel, so p_{t+1} = p_t·(1 − ηλ) − η·sign(U_{t−1}). Every U is applied once, by every replica, in
the same order, so the replicas stay identical; only the point each gradient is taken at moves one
update back. That costs loss (`late`); the default, `eager` (`demo.overlap_update`), keeps the shared
parameters p apart and lets the model run ahead of them by the replica's own update while U_t travels,
θ = p − η·sign(T_t), T_t what step t's payload took out of δ (the own share of U_t). When U_t lands,
p takes it and θ is p again, so every replica's p is the same and a gradient misses only the others'
part of one update. φ, its hash and the state are p. The last step of each membership epoch
(`ddp.epoch_steps`) and of the run waits for its own U, so at an epoch's end, where φ is voted on
and joiners come in, nothing is in flight and θ = p. A round that excludes a member ends the epoch
one round later (the collective's ``lag``): the next round may have started on the old manifest on
some peers and not others, so all run it there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lowcomm.algorithms import demo
from lowcomm.algorithms.base import PerStepReplica, SyncHooks
from lowcomm.algorithms.demo import OVERLAP_UPDATES, DemoConfig, DemoState, apply_update, compress_all
from lowcomm.algorithms.state import tensors_hash
from lowcomm.collectives.base import Collective, GroupKey, RoundResult
from lowcomm.collectives.combiners import SparseBundle
from lowcomm.compress import Codec


def combiner(config: DemoConfig, shapes: Sequence[tuple[int, ...]]) -> SparseBundle:
    """The collective's combiner for DeMo payloads: U per parameter (the sign is taken on apply)."""
    codec = config.codec()

    def combine(contributions: list, shape: tuple[int, ...], _: Codec) -> torch.Tensor:
        return demo.combine(contributions, codec, shape, config.zero_band)

    return SparseBundle(shapes, lambda shape: codec, combine)


class Demo(PerStepReplica):
    steps_inner_optimizer = False  # the sign step is the update

    def __init__(self, model: nn.Module, config: DemoConfig, collective: Collective, key: GroupKey,
                 lr_at: Callable[[int], float] | None = None, tokens_per_step: int = 1,
                 hooks: SyncHooks | None = None, overlap: str = "", epoch_steps: int = 0):
        super().__init__(model, collective, key, tokens_per_step, hooks)
        self.lr_at = lr_at  # step -> η (the run's warm-up schedule); None: config.lr throughout
        self.config = config
        self.codec = config.codec()
        self.state = DemoState.zeros_like([p.detach().cpu() for p in model.parameters()])
        if overlap not in ("", *OVERLAP_UPDATES):
            raise ValueError(f"overlap {overlap!r}: one of {OVERLAP_UPDATES} or '' (off)")
        self.overlap, self.epoch_steps = overlap, epoch_steps
        self._pending = None  # overlap: (step, handle, config, t0, bytes before) of the step in flight
        # eager: the shared parameters, apart from the model's, which run ahead of them by the own update
        self.shared = [p.detach().clone() for p in model.parameters()] if overlap == "eager" else None

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
        """One DeMo step (round = step) on the gradients in the model: send, gather, apply the sign update."""
        config = self._config_at(round_)
        result = self.collective.start(self.key, round_, self._payloads(config), weight).result(timeout)
        self._apply(result, config)
        return result

    # ---- one step late (overlap) -------------------------------------------------------------

    def on_gradients(self, step: int) -> bool:
        if not self.overlap:
            return super().on_gradients(step)
        if not self.hooks.gate(step):
            self._pending = None  # the state was replaced: what was in flight belongs to the old one
            return False
        t0, bytes_before = time.time(), self.hooks.meter()
        config = self._config_at(step)
        own = [] if self.shared is not None else None
        handle = self.collective.start(self.key, step, self._payloads(config, own), self.tokens_per_step)
        self._land(sent_until=bytes_before)
        self._pending = (step, handle, config, t0, bytes_before)
        if (self.epoch_steps > 0 and (step + 1) % self.epoch_steps == 0) or step + 1 >= self.hooks.total_steps:
            self._land()
        elif own is not None:  # the model runs ahead by this step's own update until its U lands
            with torch.no_grad():
                for p, shared, mine in zip(self.model.parameters(), self.shared, own):
                    p.copy_(shared).add_(mine.to(p.device, p.dtype).sign(), alpha=-config.lr)
        return True

    def _land(self, sent_until: int | None = None) -> None:
        """Waits for the step in flight and applies its U (a failure drops it: the runtime resyncs).
        Its bytes are those sent from its start until ``sent_until`` (the next step's start; default:
        now), so the steps' windows do not overlap and add up to the run's bytes."""
        if self._pending is None:
            return
        step, handle, config, t0, bytes_before = self._pending
        self._pending = None
        waited = time.time()
        result = self._await(step, lambda: handle.result(self.hooks.timeout_s))
        if self.shared is None:
            self._apply(result, config)
        else:
            self._apply(result, config, self.shared)
            with torch.no_grad():
                for p, shared in zip(self.model.parameters(), self.shared):
                    p.copy_(shared)
        # sync_s: what the step waited for, not the next step's compute that the round overlapped
        sent = (self.hooks.meter() if sent_until is None else sent_until) - bytes_before
        self._landed(step, result, self.tokens_per_step, t0, sent, sync_s=time.time() - waited)

    def in_flight(self) -> bool:
        return self._pending is not None

    def finish(self) -> bool:
        landed = self._pending is not None
        self._land()
        return landed

    def enter(self, round_: int, wait_s: float = 0.0) -> bool:
        self._pending = None
        return super().enter(round_, wait_s)

    # ---- the two halves ------------------------------------------------------------------------

    def _config_at(self, step: int) -> DemoConfig:
        return self.config if self.lr_at is None else dataclasses.replace(self.config, lr=self.lr_at(step))

    def _payloads(self, config: DemoConfig, transmitted: list | None = None) -> list[bytes]:
        """The sender's half on the gradients in the model: δ updated, its top-k payload per parameter."""
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", torch.float32)
                 for p in self.model.parameters()]
        return compress_all(self.state, grads, config, self.codec, transmitted)

    def _apply(self, result: RoundResult, config: DemoConfig, params=None) -> None:
        offset = 0
        with torch.no_grad():
            for p in (self.model.parameters() if params is None else params):
                apply_update(p, result.aggregate[offset:offset + p.numel()].reshape(p.shape), config)
                offset += p.numel()

    def _params(self):
        return list(self.model.parameters()) if self.shared is None else self.shared

    @contextmanager
    def global_model(self):
        if self.shared is None or self._pending is None:
            yield self.model
            return
        ahead = [p.detach().clone() for p in self.model.parameters()]
        with torch.no_grad():
            for p, shared in zip(self.model.parameters(), self.shared):
                p.copy_(shared)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, mine in zip(self.model.parameters(), ahead):
                    p.copy_(mine)

    def phi_hash(self) -> str:
        return tensors_hash(self._params())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"param.{name}": p.detach().to("cpu", torch.float32)
                for name, p in zip(self.names, self._params())}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self.names, self.model.parameters()):
                p.copy_(tensors[f"param.{name}"].to(p.device, p.dtype))
            if self.shared is not None:
                self.shared = [p.detach().clone() for p in self.model.parameters()]
        self.state = DemoState.zeros_like([p.detach().cpu() for p in self.model.parameters()])

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"param.{name}": tuple(p.shape) for name, p in zip(self.names, self.model.parameters())}
