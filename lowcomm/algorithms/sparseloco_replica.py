"""A SparseLoCo replica on a real collective: the peer-facing side of algorithms.sparseloco.

Same schedule as ``DiLoCo`` (algorithms.outer). Each round the replica folds Δ = φ − θ into its
error-feedback residuals, encodes one payload per parameter (top-k + 2-bit values; 1-D tensors
dense), and hands the list to a collective built with ``combiner(config, shapes)``: owners forward
the contributors' payloads and every member computes ``sparseloco.combine`` (the clipped
scatter-mean) and takes ``sparseloco.outer_step``, φ ← φ − η_out · aggregate: the functions the
golden tests pin.

The residuals are this replica's own memory: they are not part of the shared state (a joiner or
a resynced peer starts with zero residuals), and a round this replica misses keeps what it
subtracted for that round's unsent payload (small: the next rounds' payloads carry the rest).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lowcomm.algorithms import sparseloco
from lowcomm.algorithms.base import SyncHooks
from lowcomm.algorithms.outer import OuterReplica
from lowcomm.algorithms.sparseloco import SparseLoCoConfig, SparseLoCoState, compress_all
from lowcomm.collectives.base import Collective, GroupKey, RoundResult
from lowcomm.collectives.combiners import SparseBundle
from lowcomm.compress import Codec


def combiner(config: SparseLoCoConfig, shapes: Sequence[tuple[int, ...]]) -> SparseBundle:
    """The collective's combiner for SparseLoCo payloads of parameters with ``shapes``."""

    def combine(contributions: list, shape: tuple[int, ...], codec: Codec) -> torch.Tensor:
        return sparseloco.combine(contributions, shape, config.clip)

    return SparseBundle(shapes, config.codec_for, combine)


class SparseLoCo(OuterReplica):
    def __init__(self, model: nn.Module, config: SparseLoCoConfig, collective: Collective, key: GroupKey,
                 tokens_per_step: int = 1, hooks: SyncHooks | None = None):
        super().__init__(model, collective, key, config.inner_steps, tokens_per_step, hooks)
        self.config = config
        self.state = SparseLoCoState.zeros_like(self.phi)

    def start_sync_delta(self, round_: int, delta: list[torch.Tensor], weight: float):
        """Folds Δ into the error-feedback residuals and sends one top-k payload per parameter."""
        payloads = compress_all(self.state, delta, self.config)
        return self.collective.start(self.key, round_, payloads, weight)

    def step_outer(self, result: RoundResult) -> None:
        """φ ← φ − η_out · aggregate, per parameter."""
        offset = 0
        for p in self.phi:
            sparseloco.outer_step(p, result.aggregate[offset:offset + p.numel()].reshape(p.shape), self.config.outer_lr)
            offset += p.numel()

    def preview_outer(self, phi: list[torch.Tensor], grad: list[torch.Tensor]) -> list[torch.Tensor]:
        """φ − η_out · grad (the outer step has no state)."""
        return [p.detach().to(torch.float32) - self.config.outer_lr * g.reshape(p.shape) for p, g in zip(phi, grad)]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"phi.{name}": p for name, p in zip(self.names, self.phi)}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self.names, self.phi):
                p.copy_(tensors[f"phi.{name}"])
        self.state = SparseLoCoState.zeros_like(self.phi)
        self.load_phi_into_model()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {f"phi.{name}": tuple(p.shape) for name, p in zip(self.names, self.phi)}
