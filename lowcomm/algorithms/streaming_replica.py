"""A Streaming DiLoCo replica on a real collective: DiLoCo's outer step, one fragment per round.

Round n (algorithms.streaming) syncs fragment p = (n + 1) mod P, strided over transformer blocks:

    after inner step round_start_step(n):       start the reduce of Δ_p = φ_p − θ_p
    after inner step round_start_step(n) + τ:   await it → Δ̄_p;  φ_p ← OuterSGD(φ_p, Δ̄_p)
                                                θ_p ← lerp(φ_p, θ_p, α)

φ, the outer Nesterov SGD and its per-parameter momentum are DiLoCo's (the parameters outside p
get no gradient, so their momentum stands still), and so is the state a joiner downloads. The
payload is fragment p's Δ flattened in parameter order; its codec is [streaming].codec. With
P = 1, τ = 0, α = 0 every round is a DiLoCo round. The peer loop decides when to call
``start_sync`` and ``finish_sync``; ``round_starting`` / ``apply_step`` say when.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from lowcomm.algorithms import streaming
from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.algorithms.streaming import StreamingConfig
from lowcomm.collectives.base import Collective, GroupKey, RoundResult
from lowcomm.algorithms.diloco import DilocoConfig


class StreamingDiLoCo(DiLoCo):
    def __init__(self, model: nn.Module, config: DilocoConfig, streaming_config: StreamingConfig,
                 collective: Collective, key: GroupKey):
        super().__init__(model, config, collective, key)
        self.inner_steps = config.inner_steps
        self.fragments = streaming_config.fragments
        self.delay = streaming_config.fragment_sync_delay
        self.alpha = streaming_config.alpha
        streaming.check_one_in_flight(self.inner_steps, self.fragments, self.delay)
        assignment = streaming.strided_fragments(self.names, self.fragments)
        self.members = [streaming.members(assignment, p) for p in range(self.fragments)]
        empty = [p for p, idx in enumerate(self.members) if not idx]
        if empty:
            raise ValueError(f"fragments {empty} hold no parameter: use at most as many fragments as "
                             f"transformer blocks ({self.fragments} asked)")

    # ---- the schedule, in rounds -------------------------------------------------------------

    def fragment_of(self, round_: int) -> int:
        return streaming.round_fragment(round_, self.fragments)

    def round_starting(self, step: int) -> int | None:
        return streaming.round_starting(step, self.inner_steps, self.fragments)

    def start_step(self, round_: int) -> int:
        return streaming.round_start_step(round_, self.inner_steps, self.fragments)

    def apply_step(self, round_: int) -> int:
        return self.start_step(round_) + self.delay

    def fragment_numel(self, fragment: int) -> int:
        return sum(self.phi[i].numel() for i in self.members[fragment])

    # ---- one round ---------------------------------------------------------------------------

    def fragment_pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """Δ_p = φ_p − θ_p over fragment p's parameters, flattened, on the CPU in float32."""
        params = list(self.model.parameters())
        return torch.cat([(self.phi[i].detach() - params[i].detach().to("cpu", torch.float32)).reshape(-1)
                          for i in self.members[fragment]])

    def start_sync(self, round_: int, weight: float):
        return self.collective.start(self.key, round_, self.fragment_pseudo_gradient(self.fragment_of(round_)), weight)

    def finish_sync(self, round_: int, handle, timeout: float | None = None) -> RoundResult:
        result = handle.result(timeout)
        self.apply_fragment(self.fragment_of(round_), result)
        return result

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
        return self.finish_sync(round_, self.start_sync(round_, weight), timeout)

    def catch_up(self, round_: int, manifest) -> RoundResult:
        """Applies a fragment round this replica was left out of, fetched from its members."""
        fragment = self.fragment_of(round_)
        result = self.collective.catch_up(self.key, round_, self.fragment_numel(fragment), manifest)
        self.apply_fragment(fragment, result)
        return result

    def apply(self, result: RoundResult) -> None:
        raise TypeError("a streaming round applies to one fragment: use finish_sync(round, handle)")

    @torch.no_grad()
    def apply_fragment(self, fragment: int, result: RoundResult) -> None:
        """The outer step on fragment p's agreed aggregate, then θ_p ← lerp(φ_p, θ_p, α)."""
        offset = 0
        for i in self.members[fragment]:
            p = self.phi[i]
            p.grad = result.aggregate[offset:offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
        if offset != result.aggregate.numel():
            raise ValueError(f"fragment {fragment} has {offset} values, the aggregate {result.aggregate.numel()}")
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        params = list(self.model.parameters())
        phi = [self.phi[i].detach().to(params[i].device) for i in self.members[fragment]]
        theta = [params[i] for i in self.members[fragment]]
        for live, merged in zip(theta, streaming.merge(phi, theta, self.alpha)):
            live.copy_(merged.to(live.device))

    @contextmanager
    def global_model(self):
        """φ in the model for the duration (evaluation of the global model), then the live θ back."""
        params = list(self.model.parameters())
        saved = [p.detach().clone() for p in params]
        self.load_phi_into_model()
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
