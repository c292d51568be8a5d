"""What the round-based algorithms (DiLoCo, SparseLoCo) share: φ on the CPU, a round, a catch-up.

A subclass keeps ``model``, ``phi`` (CPU float32 tensors), ``collective`` and ``key`` and
implements ``start_sync_delta(round, delta, weight) -> handle`` (the exchange of a given
pseudo-gradient Δ, one CPU float32 tensor per parameter, DiLoCo's sign: the outer step descends
it) and ``step_outer(result)`` (the outer step on φ alone). A plain round sends Δ = φ − θ and
then sets θ ← φ; the one-step-delay overlap (algorithms.overlapped) sends its own Δ and keeps θ.
"""

from __future__ import annotations

import torch

from lowcomm.algorithms.state import tensors_hash
from lowcomm.collectives.base import RoundResult


class OuterReplica:
    shared_phi = True  # every replica holds the same φ after a round: the peer checks its hash for drift

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ = φ − θ per parameter, on the CPU in float32."""
        return [phi.detach() - p.detach().to("cpu", torch.float32) for phi, p in zip(self.phi, self.model.parameters())]

    def start_sync(self, round_: int, weight: float):
        return self.start_sync_delta(round_, self.pseudo_gradients(), weight)

    def apply(self, result: RoundResult) -> None:
        """The outer step on the agreed aggregate, then θ ← φ."""
        self.step_outer(result)
        self.load_phi_into_model()

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
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
