"""A DeMo replica on a real collective: the peer-facing side of algorithms.demo.

DeMo syncs every optimizer step, like the ddp baseline, so it runs in membership epochs (no DHT
per step), and its own sign update replaces the inner optimizer's step. Each step the replica
folds η·g into its residuals δ, sends the top-k DCT coefficients of every parameter (one
``dct-topk`` payload each) and hands the list to a collective built with ``combiner(config,
shapes)``: owners forward the contributors' payloads and every member computes ``demo.combine``
(U = IDCT of the scatter-mean, with the zero band) and ``demo.apply_update``, p ← p·(1 − ηλ) −
η·sign(U): the functions the golden tests pin. Every replica applies the same signs, so the
parameters themselves are the shared state (a joiner downloads them; δ stays local).
"""

from __future__ import annotations

import dataclasses
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
                 hooks: SyncHooks | None = None):
        super().__init__(model, collective, key, tokens_per_step, hooks)
        self.lr_at = lr_at  # step -> η (the run's warm-up schedule); None: config.lr throughout
        self.config = config
        self.codec = config.codec()
        self.state = DemoState.zeros_like([p.detach().cpu() for p in model.parameters()])

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
        """One DeMo step (round = step) on the gradients in the model: send, gather, apply the sign update."""
        config = self.config if self.lr_at is None else dataclasses.replace(self.config, lr=self.lr_at(round_))
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().to("cpu", torch.float32)
                 for p in self.model.parameters()]
        payloads = compress_all(self.state, grads, config, self.codec)
        result = self.collective.start(self.key, round_, payloads, weight).result(timeout)
        offset = 0
        with torch.no_grad():
            for p in self.model.parameters():
                apply_update(p, result.aggregate[offset:offset + p.numel()].reshape(p.shape), config)
                offset += p.numel()
        return result

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
