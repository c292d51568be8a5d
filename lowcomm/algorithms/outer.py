"""What the round-based algorithms (DiLoCo, SparseLoCo, NoLoCo) share: φ on the CPU, a round every H steps.

A subclass keeps ``phi`` (CPU float32 tensors) and implements ``start_sync_delta(round, delta,
weight) -> handle`` (the exchange of a given pseudo-gradient Δ, one CPU float32 tensor per
parameter, DiLoCo's sign: the outer step descends it) and ``step_outer(result)`` (the outer step on
φ alone). A plain round sends Δ = φ − θ and then sets θ ← φ; the one-step-delay overlap
(algorithms.overlapped) sends its own Δ and keeps θ.

The schedule: after every ``sync_every`` inner steps, round ``self.round`` runs start to end (its
reduce awaited at once) and is announced ahead once applied, so a peer a few seconds behind the
next round's leader is a member whose contribution is awaited.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn

from lowcomm.algorithms.base import Replica, SyncHooks
from lowcomm.algorithms.state import tensors_hash
from lowcomm.collectives.base import Collective, GroupKey, RoundResult


class OuterReplica(Replica):
    announces_ahead = True

    def __init__(self, model: nn.Module, collective: Collective, key: GroupKey, sync_every: int,
                 tokens_per_step: int = 1, hooks: SyncHooks | None = None):
        super().__init__(model, collective, key, tokens_per_step, hooks)
        self.sync_every = sync_every
        self.phi = [p.detach().to("cpu", torch.float32).clone() for p in model.parameters()]

    # ---- the schedule ------------------------------------------------------------------------

    def after_inner_step(self, step: int) -> bool:
        if step % self.sync_every != 0:
            return True
        round_ = self.round
        if not self.hooks.gate(round_):
            return False
        t0, bytes_before = time.time(), self.hooks.meter()
        weight = self.tokens_per_step * self.sync_every
        result = self._await(round_, lambda: self.sync(round_, weight, self.hooks.timeout_s))
        self._landed(round_, result, weight, t0, self.hooks.meter() - bytes_before)
        if self.announces_ahead:
            self._ahead = self.round
        return True

    # ---- one round ---------------------------------------------------------------------------

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ = φ − θ per parameter, on the CPU in float32."""
        return [phi.detach() - p.detach().to("cpu", torch.float32) for phi, p in zip(self.phi, self.model.parameters())]

    def start_sync(self, round_: int, weight: float):
        return self.start_sync_delta(round_, self.pseudo_gradients(), weight)

    def start_sync_delta(self, round_: int, delta: list[torch.Tensor], weight: float):
        raise NotImplementedError

    def step_outer(self, result: RoundResult) -> None:
        raise NotImplementedError

    def preview_outer(self, phi: list[torch.Tensor], grad: list[torch.Tensor]) -> list[torch.Tensor]:
        """``phi`` after an outer step on ``grad`` (one tensor per parameter), with the outer state as
        it is now and left so: where the overlap's rules start a round (algorithms.overlap)."""
        raise NotImplementedError

    def apply(self, result: RoundResult) -> None:
        """The outer step on the agreed aggregate, then θ ← φ."""
        self.step_outer(result)
        self.load_phi_into_model()

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
        """One whole round: send Δ, await the aggregate, apply it."""
        result = self.start_sync(round_, weight).result(timeout)
        self.apply(result)
        return result

    def catch_up(self, round_: int, manifest) -> RoundResult:
        """Apply the result of a round this replica was left out of (its own contribution is dropped)."""
        result = self.fetch_round(round_, manifest)
        self.apply(result)
        return result

    def fetch_round(self, round_: int, manifest) -> RoundResult:
        """The agreed aggregate of a round this replica was left out of, from the round's members."""
        return self.collective.catch_up(self.key, round_, sum(p.numel() for p in self.phi), manifest)

    def load_phi_into_model(self) -> None:
        with torch.no_grad():
            for p, phi in zip(self.model.parameters(), self.phi):
                p.copy_(phi.to(p.device, p.dtype))

    def phi_hash(self) -> str:
        return tensors_hash(self.phi)

    @contextmanager
    def global_model(self):
        """φ in the model for the duration (evaluation of the global model), then the live θ back.

        Between two rounds θ has moved on from φ (and Streaming DiLoCo keeps a live θ apart from φ
        all along): the final evaluation of a run whose steps are not a multiple of H scores φ."""
        params = list(self.model.parameters())
        saved = [p.detach().clone() for p in params]
        self.load_phi_into_model()
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
