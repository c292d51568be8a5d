"""A Streaming DiLoCo replica on a real collective: DiLoCo's outer step, one fragment per round.

Round n (algorithms.streaming) syncs fragment p = (n + 1) mod P, strided over transformer blocks:

    after inner step round_start_step(n):       start the reduce of Δ_p = φ_p − θ_p
    after inner step round_start_step(n) + τ:   await it → Δ̄_p;  φ_p ← OuterSGD(φ_p, Δ̄_p)
                                                θ_p ← lerp(φ_p, θ_p, α)

φ, the outer Nesterov SGD and its per-parameter momentum are DiLoCo's (the parameters outside p
get no gradient, so their momentum stands still), and so is the state a joiner downloads. The
payload is fragment p's Δ flattened in parameter order; its codec is [streaming].codec. With
P = 1, τ = 0, α = 0 every round is a DiLoCo round.

The schedule (``after_inner_step``): the open round is awaited at its apply step, then the round
due at this step starts (and is awaited at once when τ = 0). At the run's last step every round
begun is awaited at once (the final sync): φ does not depend on when a round is applied, only θ
would, and θ is not trained any further. The next round is announced ahead as soon as nothing is
in flight, so a leader a few steps ahead counts this replica in. A round's ``sync_s`` is the
reduce itself (manifest + exchange, overlapped with τ inner steps); ``blocked_s`` what training
waited for at the apply step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from lowcomm.algorithms import streaming
from lowcomm.algorithms.base import SyncHooks
from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.algorithms.streaming import StreamingConfig
from lowcomm.collectives.base import Collective, GroupKey, RoundResult
from lowcomm.algorithms.diloco import DilocoConfig


@dataclass
class OpenRound:
    """A round whose reduce runs in the background until its apply step."""

    round: int
    handle: object
    apply_step: int
    weight: float
    t0: float
    bytes_before: int


class StreamingDiLoCo(DiLoCo):
    def __init__(self, model: nn.Module, config: DilocoConfig, streaming_config: StreamingConfig,
                 collective: Collective, key: GroupKey, tokens_per_step: int = 1, hooks: SyncHooks | None = None):
        super().__init__(model, config, collective, key, tokens_per_step, hooks)
        self.open: OpenRound | None = None
        self._offered = -1  # the last round offered for announcing ahead
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

    # ---- the schedule ------------------------------------------------------------------------

    def after_inner_step(self, step: int) -> bool:
        last = step >= self.hooks.total_steps
        if self.open is not None and (self.open.apply_step <= step or last):
            self._finish_open()
        round_ = self.round_starting(step)
        if round_ is not None:
            if not self.hooks.gate(round_):
                return False
            # each fragment round carries the tokens trained since the previous round began (H/P steps)
            steps = self.start_step(round_) - (self.start_step(round_ - 1) if round_ > 0 else 0)
            weight = self.tokens_per_step * steps
            t0, bytes_before = time.time(), self.hooks.meter()
            self.open = OpenRound(round_, self.start_sync(round_, weight), self.apply_step(round_), weight, t0,
                                  bytes_before)
            if self.open.apply_step <= step or last:  # τ = 0, or the final sync
                self._finish_open()
        return True

    def _finish_open(self) -> None:
        open_round, self.open = self.open, None
        round_, t_wait = open_round.round, time.time()
        result = self._await(round_, lambda: self.finish_sync(round_, open_round.handle, self.hooks.timeout_s))
        own = (result.info.get("manifest_s") or 0.0) + (result.info.get("reduce_s") or 0.0)
        self._landed(round_, result, open_round.weight, open_round.t0, self.hooks.meter() - open_round.bytes_before,
                     sync_s=own or time.time() - open_round.t0, fragment=self.fragment_of(round_),
                     blocked_s=time.time() - t_wait)

    def take_ahead(self) -> int | None:
        """The round after the last one applied, once nothing is in flight."""
        if self.open is not None or self._offered >= self.round:
            return None
        self._offered = self.round
        return self.round

    def enter(self, round_: int, wait_s: float = 0.0) -> bool:
        self.open = None  # a round begun before the downloaded state is void
        self._offered = -1
        return super().enter(round_, wait_s)

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
        delta = self.fragment_pseudo_gradient(self.fragment_of(round_))  # the round's own: its aggregate is built in it
        return self.collective.start(self.key, round_, delta, weight, donate=True)

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
