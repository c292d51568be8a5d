"""One-step-delay overlap (ALGORITHMS.md §1): the reduce of round t runs during round t+1's inner steps.

Each replica (φ_0 = initial weights, s_1 = φ_0, nothing pending before round 1):

    round t:  H inner steps from s_t end at e_t;  Δ_t = s_t − e_t
              start the reduce of Δ_t
              if the reduce of Δ_{t−1} is pending:
                  wait → Δ̄_{t−1};  φ_{t−1} = OuterOpt(φ_{t−2}, Δ̄_{t−1})
              s_{t+1} = φ_{t−1} − Δ_t     # newest global point plus this replica's unsynced progress

The algorithm supplies two callables, so DiLoCo (dense mean, Nesterov) and SparseLoCo (error
feedback on Δ_t unchanged, then a sparse payload) share this code: ``launch(Δ_t)`` starts the
exchange and returns any handle; ``finish(handle)`` waits for it, applies the outer step and
returns the new φ. With gradients independent of θ the φ sequence is plain DiLoCo's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Params = Sequence[torch.Tensor]


def progress(start: Params, end: Params) -> list[torch.Tensor]:
    """Δ_t = s_t − e_t: this round's own progress, with DiLoCo's sign (the outer step descends it)."""
    return [s.detach().float() - e.detach().float() for s, e in zip(start, end)]


def next_start(phi: Params, own_progress: Params) -> list[torch.Tensor]:
    """s_{t+1} = φ − Δ_t: the newest agreed φ plus the progress the next reduce will replace."""
    return [p.detach().float() - d for p, d in zip(phi, own_progress)]


class OneStepDelay:
    """Holds the one reduce in flight; `round` runs the recurrence's bookkeeping for round t."""

    def __init__(self) -> None:
        self.pending: Any = None

    def round(self, start: Params, end: Params, phi: Params,
              launch: Callable[[list[torch.Tensor]], Any],
              finish: Callable[[Any], Params]) -> list[torch.Tensor]:
        """Starts the reduce of Δ_t, completes the one of Δ_{t−1} if any, returns s_{t+1}.

        ``phi`` is the newest φ this replica has (φ_{t−2}); it stands when nothing is pending.
        """
        delta = progress(start, end)
        handle = launch(delta)
        if self.pending is not None:
            phi = finish(self.pending)
        self.pending = handle
        return next_start(phi, delta)

    def drain(self, phi: Params, finish: Callable[[Any], Params]) -> list[torch.Tensor]:
        """End of training: completes the last reduce and returns the final φ (θ ← φ)."""
        if self.pending is not None:
            phi = finish(self.pending)
            self.pending = None
        return [p.detach().float().clone() for p in phi]
