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
update back. The last step of each membership epoch (`ddp.epoch_steps`) and of the run waits for
its own U, so at an epoch's end, where φ is voted on and joiners come in, nothing is in flight. A
round that excludes a member ends the epoch one round later (the collective's ``lag``): the next
round may have started on the old manifest on some peers and not others, so all run it there.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lowcomm.algorithms import demo
from lowcomm.algorithms.base import PerStepReplica, SyncHooks
from lowcomm.algorithms.demo import DemoConfig, DemoState, apply_update, compress_all
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
                 hooks: SyncHooks | None = None, overlap: bool = False, epoch_steps: int = 0):
        super().__init__(model, collective, key, tokens_per_step, hooks)
        self.lr_at = lr_at  # step -> η (the run's warm-up schedule); None: config.lr throughout
        self.config = config
        self.codec = config.codec()
        self.state = DemoState.zeros_like([p.detach().cpu() for p in model.parameters()])
        self.overlap, self.epoch_steps = overlap, epoch_steps
        self._pending = None  # overlap: (step, handle, config, t0, bytes before) of the step in flight

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
        handle = self.collective.start(self.key, step, self._payloads(config), self.tokens_per_step)
        self._land()
        self._pending = (step, handle, config, t0, bytes_before)
        if (self.epoch_steps > 0 and (step + 1) % self.epoch_steps == 0) or step + 1 >= self.hooks.total_steps:
            self._land()
        return True

    def _land(self) -> None:
        """Waits for the step in flight and applies its U (a failure drops it: the runtime resyncs)."""
        if self._pending is None:
            return
        step, handle, config, t0, bytes_before = self._pending
        self._pending = None
        waited = time.time()
        result = self._await(step, lambda: handle.result(self.hooks.timeout_s))
        self._apply(result, config)
        # sync_s: what the step waited for, not the next step's compute that the round overlapped
        self._landed(step, result, self.tokens_per_step, t0, self.hooks.meter() - bytes_before,
                     sync_s=time.time() - waited)

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

    def _payloads(self, config: DemoConfig) -> list[bytes]:
        """The sender's half on the gradients in the model: δ updated, its top-k payload per parameter."""
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", torch.float32)
                 for p in self.model.parameters()]
        return compress_all(self.state, grads, config, self.codec)

    def _apply(self, result: RoundResult, config: DemoConfig) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.model.parameters():
                apply_update(p, result.aggregate[offset:offset + p.numel()].reshape(p.shape), config)
                offset += p.numel()

    def phi_hash(self) -> str:
        return tensors_hash(self.model.parameters())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"param.{name}": p.detach().to("cpu", torch.float32)
                for name, p in zip(self.names, self.model.parameters())}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self.names, self.model.parameters()):
                p.copy_(tensors[f"param.{name}"].to(p.device, p.dtype))
        self.state = DemoState.zeros_like([p.detach().cpu() for p in self.model.parameters()])

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"param.{name}": tuple(p.shape) for name, p in zip(self.names, self.model.parameters())}
