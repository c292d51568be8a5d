"""What the round-based algorithms (DiLoCo, SparseLoCo) share: φ on the CPU, a round, a catch-up.

A subclass keeps ``model``, ``phi`` (CPU float32 tensors), ``collective`` and ``key`` and
implements ``start_sync(round, weight) -> handle`` and ``apply(result)``.
"""

from __future__ import annotations

import torch

from lowcomm.algorithms.state import tensors_hash
from lowcomm.collectives.base import RoundResult


class OuterReplica:
    shared_phi = True  # every replica holds the same φ after a round: the peer checks its hash for drift

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
        result = self.start_sync(round_, weight).result(timeout)
        self.apply(result)
        return result

    def catch_up(self, round_: int, manifest) -> RoundResult:
        """Apply the result of a round this replica was left out of (its own contribution is dropped)."""
        result = self.collective.catch_up(self.key, round_, sum(p.numel() for p in self.phi), manifest)
        self.apply(result)
        return result

    def load_phi_into_model(self) -> None:
        with torch.no_grad():
            for p, phi in zip(self.model.parameters(), self.phi):
                p.copy_(phi.to(p.device, p.dtype))

    def phi_hash(self) -> str:
        return tensors_hash(self.phi)
