"""A NoLoCo replica on a real pair exchange: the peer-facing side of algorithms.noloco.

Same schedule as ``DiLoCo`` (algorithms.outer): a round every H inner steps. Each round the
replica pushes ``Contribution(θ − φ, φ)`` to its group-mates (collectives.pair_exchange: the list
progress ‖ φ, one tensor per parameter each), averages over
the contributions that arrived by the deadline with its own always included (``delivered``), and
takes the outer step ``noloco.outer_step``: m ← βm + αḡ + γ(φ̄ − φ), φ ← φ + m, θ ← φ.

Every replica owns its φ and momentum m (CPU float32); there is no global φ, so ``shared_phi`` is
False and the peer skips the φ-hash drift check. Decisions:

- **state for joiners** (``state_tensors``): φ *and* m of the member it is downloaded from. The
  joiner continues that member's trajectory (m decays with β = 0.5 within a few rounds anyway),
  and a checkpoint taken from one member resumes it exactly.
- **left out of a round's manifest** (``catch_up``): nothing to fetch, since no round result is
  shared. The replica takes the round as a group of one (ḡ = its own progress, φ̄ − φ = 0), the
  same update as a member whose partner missed the deadline, and trains on: no state download.
"""

from __future__ import annotations

import torch
from torch import nn

from lowcomm.algorithms.noloco import Contribution, NoLoCoConfig, contribution, delivered, outer_step
from lowcomm.algorithms.base import SyncHooks
from lowcomm.algorithms.outer import OuterReplica
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.pair_exchange import ExchangeResult, PairExchange


class NoLoCo(OuterReplica):
    shared_phi = False  # every replica has its own φ: no drift check, no global φ hash
    announces_ahead = False

    def __init__(self, model: nn.Module, config: NoLoCoConfig, collective: PairExchange, key: GroupKey,
                 tokens_per_step: int = 1, hooks: SyncHooks | None = None):
        super().__init__(model, collective, key, config.inner_steps, tokens_per_step, hooks)
        self.config = config
        self.momentum = [torch.zeros_like(p) for p in self.phi]
        self._own: Contribution | None = None

    def own_contribution(self) -> Contribution:
        """(θ − φ, φ) from the model's live parameters, on the CPU in float32."""
        theta = [p.detach().to("cpu", torch.float32) for p in self.model.parameters()]
        return contribution(theta, self.phi)

    def start_sync(self, round_: int, weight: float):
        self._own = self.own_contribution()
        return self.collective.start(self.key, round_, [*self._own.progress, *self._own.phi], weight)

    def apply(self, result: ExchangeResult) -> None:
        """The outer step on the group's arrivals (own included), then θ ← φ."""
        n = len(self.phi)
        received = {peer: Contribution(tensors[:n], tensors[n:]) for peer, tensors in result.received.items()}
        before = [p.clone() for p in self.phi], [m.clone() for m in self.momentum]
        outer_step(self.phi, self.momentum, delivered(result.group, result.me, received, self._own), self.config)
        if not all(bool(torch.isfinite(p).all()) for p in self.phi):
            # finite inputs near the float32 limit can still overflow the mean: the round is taken
            # as a group of one instead, so no mate's values can put inf or NaN into φ
            with torch.no_grad():
                for p, m, p0, m0 in zip(self.phi, self.momentum, *before):
                    p.copy_(p0)
                    m.copy_(m0)
            outer_step(self.phi, self.momentum, [self._own], self.config)
            result.info["overflow"] = True
        self._own = None
        self.load_phi_into_model()

    def catch_up(self, round_: int, manifest) -> ExchangeResult:
        """A round this replica was left out of: taken as a group of one (see the module docstring)."""
        me = self.collective.me
        outer_step(self.phi, self.momentum, [self.own_contribution()], self.config)
        self.load_phi_into_model()
        return ExchangeResult(me, (me,), {}, [me], [], {
            "caught_up": True, "leader": getattr(manifest, "leader", None),
            "trained_members": len(getattr(manifest, "members", ())) + 1,  # the round's members, and this one
            "record": {"group": [me], "pairing": None, "received_from": [], "pushed": {}}})

    # ---- state for joiners, resyncs and checkpoints ------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"phi.{name}": p for name, p in zip(self.names, self.phi)}
        out.update({f"momentum.{name}": m for name, m in zip(self.names, self.momentum)})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p, m in zip(self.names, self.phi, self.momentum):
                p.copy_(tensors[f"phi.{name}"])
                m.copy_(tensors[f"momentum.{name}"])
        self.load_phi_into_model()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {f"phi.{name}": tuple(p.shape) for name, p in zip(self.names, self.phi)}
        shapes.update({f"momentum.{name}": tuple(p.shape) for name, p in zip(self.names, self.phi)})
        return shapes
