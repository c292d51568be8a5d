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
φ itself is stepped only with the agreed averages, so it stays identical on every replica whatever
the rule, and with gradients independent of θ the φ sequence is plain DiLoCo's.

The algorithm supplies two callables, so DiLoCo (dense mean, Nesterov) and SparseLoCo (error
feedback on Δ_t unchanged, then a sparse payload) share this code: ``launch(Δ_t)`` starts the
exchange and returns any handle; ``finish(handle)`` waits for it, applies the outer step and
returns the new φ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Params = Sequence[torch.Tensor]
UPDATES = ("momentum", "delayed", "eager")  # the overlap's update rules (`diloco.overlap_update`)


def progress(start: Params, end: Params) -> list[torch.Tensor]:
    """Δ_t = s_t − e_t: this round's own progress, with DiLoCo's sign (the outer step descends it)."""
    return [s.detach().float() - e.detach().float() for s, e in zip(start, end)]


def next_start(phi: Params, own_progress: Params) -> list[torch.Tensor]:
    """s_{t+1} = φ − Δ_t: the newest agreed φ plus the progress the next reduce will replace."""
    return [p.detach().float() - d for p, d in zip(phi, own_progress)]


def start_rule(update: str, preview: Callable[[Params, list[torch.Tensor]], list[torch.Tensor]]
               ) -> Callable[[Params, list[torch.Tensor]], list[torch.Tensor]]:
    """``start_from(φ, Δ_t)`` of the rule ``update`` (one of UPDATES); ``preview(φ, g)``: φ after an
    outer step on g, the outer optimizer's state read and left as it is."""
    if update == "delayed":
        return next_start
    if update == "momentum":  # the step's part that no gradient changes: ημ²·m for Nesterov SGD
        return lambda phi, delta: next_start(preview(phi, [torch.zeros_like(d) for d in delta]), delta)
    if update == "eager":
        return preview
    raise ValueError(f"overlap update {update!r}: one of {', '.join(UPDATES)}")


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
