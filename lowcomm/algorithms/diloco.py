"""DiLoCo (ALGORITHMS.md §1): H inner steps, then an outer Nesterov-SGD step on the mean pseudo-gradient.

    θ ← φ;  H steps of the inner optimizer on local data
    Δ_r = φ − θ_r                       # sign matters: the outer step descends Δ
    Δ̄  = mean_r Δ_r                     # the collective (weighted by tokens; median-norm clipped by default)
    φ  ← OuterSGD(φ, grad=Δ̄, lr=η_out, momentum=μ, nesterov)

φ and the outer optimizer live on the CPU in float32 on every peer, so every replica computes the
same φ from the same aggregate whatever its accelerator. The inner loop belongs to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowcomm.algorithms.base import SyncHooks
from lowcomm.algorithms.outer import OuterReplica
from lowcomm.collectives.base import Collective, GroupKey, RoundResult
from lowcomm.collectives.robust import Aggregate

CODECS = ("fp32", "uint8")  # the pseudo-gradient on the wire


@dataclass
class DilocoConfig:
    """The [diloco] section; also Streaming DiLoCo's H and outer optimizer (algorithms.streaming)."""

    inner_steps: int = 30  # H
    outer_lr: float = 0.7  # η_out
    outer_momentum: float = 0.9  # μ, in [0, 1)
    nesterov: bool = True
    codec: str = "uint8"  # one of CODECS
    overlap: bool = False  # one-step-delay overlap (ALGORITHMS.md §1)
    overlap_update: str = "momentum"  # the overlap's next start: one of algorithms.overlap.UPDATES
    overlap_apply: str = "arrival"  # when the overlap applies an aggregate: one of algorithms.overlapped.APPLY
    overlap_lead: float = 0.1  # share of a round's inner steps run before the previous round must land (1: H)
    aggregate: str = "median-clip"  # how a shard owner combines the Δ parts: one of collectives.robust.AGGREGATES
    trim_fraction: float = 0.25  # trimmed-mean: share of values left out at each end of a coordinate, in [0, 0.5)
    clip_tau: float = 1.0  # centered-clip: τ as a multiple of the parts' median distance from the clipped mean

    def robust_aggregate(self) -> Aggregate:
        """The shard owners' rule for this config's Δ parts (DiLoCo and Streaming DiLoCo)."""
        return Aggregate(self.aggregate, self.trim_fraction, self.clip_tau)


class DiLoCo(OuterReplica):
    def __init__(self, model: nn.Module, config: DilocoConfig, collective: Collective, key: GroupKey,
                 tokens_per_step: int = 1, hooks: SyncHooks | None = None):
        super().__init__(model, collective, key, config.inner_steps, tokens_per_step, hooks)
        self.config = config
        self.phi = [nn.Parameter(p) for p in self.phi]
        self.outer = torch.optim.SGD(self.phi, lr=config.outer_lr, momentum=config.outer_momentum,
                                     nesterov=config.nesterov and config.outer_momentum > 0)

    def start_sync_delta(self, round_: int, delta: list[torch.Tensor], weight: float):
        # the concatenation is the round's own: its aggregate is built in it
        return self.collective.start(self.key, round_, torch.cat([d.reshape(-1) for d in delta]), weight, donate=True)

    def step_outer(self, result: RoundResult) -> None:
        """φ ← OuterSGD(φ, grad = the agreed aggregate)."""
        offset = 0
        for p in self.phi:
            p.grad = result.aggregate[offset:offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def preview_outer(self, phi: list[torch.Tensor], grad: list[torch.Tensor]) -> list[torch.Tensor]:
        """torch's SGD step (momentum μ, Nesterov, no dampening) on ``grad``, its buffers read, not written."""
        lr, mu = self.config.outer_lr, self.config.outer_momentum
        nesterov = self.config.nesterov and mu > 0
        out = []
        for p, g, param in zip(phi, grad, self.phi):
            g = g.reshape(p.shape).to(torch.float32)
            step = g
            if mu > 0:
                buf = self.outer.state.get(param, {}).get("momentum_buffer")
                buf = g if buf is None else buf * mu + g
                step = g + mu * buf if nesterov else buf
            out.append(p.detach().to(torch.float32) - lr * step)
        return out

    # ---- state for joiners, resyncs and checkpoints ------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in zip(self.names, self.phi):
            out[f"phi.{name}"] = p.detach()
            buf = self.outer.state.get(p, {}).get("momentum_buffer")
            out[f"momentum.{name}"] = buf if buf is not None else torch.zeros_like(p)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self.names, self.phi):
                p.copy_(tensors[f"phi.{name}"])
                if self.config.outer_momentum > 0:
                    momentum = tensors[f"momentum.{name}"]
                    self.outer.state[p]["momentum_buffer"] = momentum.to(p.device, p.dtype, copy=True)
        self.load_phi_into_model()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for name, p in zip(self.names, self.phi):
            shapes[f"phi.{name}"] = tuple(p.shape)
            shapes[f"momentum.{name}"] = tuple(p.shape)
        return shapes
