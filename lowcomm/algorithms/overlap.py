"""One-step-delay overlap (ALGORITHMS.md §1): the reduce of round t runs during round t+1's inner steps.

Each replica (φ_0 = initial weights, s_1 = φ_0, nothing pending before round 1):

    round t:  H inner steps from s_t end at e_t;  Δ_t = s_t − e_t
              start the reduce of Δ_t
              if the reduce of Δ_{t−1} is pending:
                  wait → Δ̄_{t−1};  φ_{t−1} = OuterOpt(φ_{t−2}, Δ̄_{t−1})
              s_{t+1} = start_from(φ_{t−1}, Δ_t)

``start_from`` is the update rule (`start_rule`), with OuterOpt previewed: the step computed from
the outer optimizer's state as it is, which it leaves unchanged.
- "delayed" (`next_start`): s_{t+1} = φ_{t−1} − Δ_t, the newest global point plus this replica's
  unsynced progress. It restarts every round one outer step stale.
- "momentum": s_{t+1} = OuterOpt(φ_{t−1}, 0) − Δ_t: the part of the step to φ_t that no gradient
  changes (ημ²·m_{t−1} for Nesterov SGD) is taken at once, the rest is stood in for by the replica's
  own progress, as "delayed" does.
- "eager": s_{t+1} = OuterOpt(φ_{t−1}, Δ_t): the whole outer step, on this replica's own Δ_t
  standing in for the average Δ̄_t still in flight (after Kale, Douillard, Donchev 2025).
- "projected" (`Projected`): s_{t+1} = OuterOpt(φ_{t−1}, â·Δ_t), the outer step on the own Δ_t
  scaled by â, the share of it the last rounds' agreed steps carried: each landed round measures
  the â that would have put its start on the φ it agreed, and â follows those measures.
φ itself is stepped only with the agreed averages, so it stays identical on every replica whatever
the rule, and with gradients independent of θ the φ sequence is plain DiLoCo's.

The algorithm supplies two callables, so DiLoCo (dense mean, Nesterov) and SparseLoCo (error
feedback on Δ_t unchanged, then a sparse payload) share this code: ``launch(Δ_t)`` starts the
exchange and returns any handle; ``finish(handle)`` waits for it, applies the outer step and
returns the new φ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

Params = Sequence[torch.Tensor]
UPDATES = ("momentum", "delayed", "eager", "projected")  # the overlap's update rules (`diloco.overlap_update`)


def progress(start: Params, end: Params) -> list[torch.Tensor]:
    """Δ_t = s_t − e_t: this round's own progress, with DiLoCo's sign (the outer step descends it)."""
    return [s.detach().float() - e.detach().float() for s, e in zip(start, end)]


def next_start(phi: Params, own_progress: Params) -> list[torch.Tensor]:
    """s_{t+1} = φ − Δ_t: the newest agreed φ plus the progress the next reduce will replace."""
    return [p.detach().float() - d for p, d in zip(phi, own_progress)]


class StartRule:
    """``start_from(φ, Δ_t)`` of a rule, told when a round lands (``observe``) and when the start it made
    does not apply (``forget``: the replica took a downloaded state). The fixed rules ignore both."""

    def __init__(self, start_from: Callable[[Params, list[torch.Tensor]], list[torch.Tensor]] | None = None):
        self._start_from = start_from

    def __call__(self, phi: Params, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._start_from(phi, delta)

    def observe(self, phi: Params) -> None:
        """The round whose reduce was in flight landed on ``phi``."""

    def forget(self) -> None:
        """The start made last estimates no round that will land (a downloaded state, a round caught up)."""


def start_rule(update: str, preview: Callable[[Params, list[torch.Tensor]], list[torch.Tensor]]) -> StartRule:
    """The rule ``update`` (one of UPDATES); ``preview(φ, g)``: φ after an outer step on g, the outer
    optimizer's state read and left as it is."""
    if update == "delayed":
        return StartRule(next_start)
    if update == "momentum":  # the step's part that no gradient changes: ημ²·m for Nesterov SGD
        return StartRule(lambda phi, delta: next_start(preview(phi, [torch.zeros_like(d) for d in delta]), delta))
    if update == "eager":
        return StartRule(preview)
    if update == "projected":
        return Projected(preview)
    raise ValueError(f"overlap update {update!r}: one of {', '.join(UPDATES)}")


class Projected(StartRule):
    """s_{t+1} = OuterOpt(φ_{t−1}, â·Δ_t): the rule "projected".

    The outer steps here (Nesterov SGD, SparseLoCo's plain one) are affine in their gradient, so the
    starts on offer are P₀ + a·D with P₀ = OuterOpt(φ_{t−1}, 0) and D = OuterOpt(φ_{t−1}, Δ_t) − P₀.
    Once round t lands on φ_t, ``observe`` measures the a that lies nearest it,
    a* = â + ⟨φ_t − s_{t+1}, D⟩ / ⟨D, D⟩ (the own progress projected on the agreed step), and â moves
    a share ``follow`` of the way to it. Peers whose own Δ_t say less of the average (more peers,
    noisier shards, later in training) thus start nearer P₀. â starts at ``first`` and stays
    within [0, ``most``]; a measure that is not finite (D = 0) is dropped.
    """

    def __init__(self, preview: Callable[[Params, list[torch.Tensor]], list[torch.Tensor]],
                 first: float = 0.5, follow: float = 0.2, most: float = 2.0):
        self.preview, self.share, self.follow, self.most = preview, first, follow, most
        self._made: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (s_{t+1}, D) until round t lands

    def __call__(self, phi: Params, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        base = self.preview(phi, [torch.zeros_like(d) for d in delta])
        step = [p - b for p, b in zip(self.preview(phi, delta), base)]
        start = [b + self.share * d for b, d in zip(base, step)]
        self._made = (start, step)
        return start

    def observe(self, phi: Params) -> None:
        """Round t landed on ``phi`` (φ_t): â follows the share that would have started there."""
        if self._made is None:
            return
        start, step = self._made
        self.forget()
        along = sum(float(((p.detach().float() - s) * d).sum()) for p, s, d in zip(phi, start, step))
        norm = sum(float((d * d).sum()) for d in step)
        measured = self.share + along / norm if norm > 0 else float("nan")
        if math.isfinite(measured):
            self.share += self.follow * (min(max(measured, 0.0), self.most) - self.share)

    def forget(self) -> None:
        self._made = None


class OneStepDelay:
    """Holds the one reduce in flight; `round` runs the recurrence's bookkeeping for round t."""

    def __init__(self) -> None:
        self.pending: Any = None

    def round(self, start: Params, end: Params, phi: Params,
              launch: Callable[[list[torch.Tensor]], Any],
              finish: Callable[[Any], Params],
              start_from: Callable[[Params, list[torch.Tensor]], list[torch.Tensor]] = next_start) -> list[torch.Tensor]:
        """Starts the reduce of Δ_t, completes the one of Δ_{t−1} if any, returns s_{t+1} = start_from(φ, Δ_t).

        ``phi`` is the newest φ this replica has (φ_{t−2}); it stands when nothing is pending.
        """
        delta = progress(start, end)
        handle = launch(delta)
        if self.pending is not None:
            phi = finish(self.pending)
        self.pending = handle
        return start_from(phi, delta)

    def drain(self, phi: Params, finish: Callable[[Any], Params]) -> list[torch.Tensor]:
        """End of training: completes the last reduce and returns the final φ (θ ← φ)."""
        if self.pending is not None:
            phi = finish(self.pending)
            self.pending = None
        return [p.detach().float().clone() for p in phi]
