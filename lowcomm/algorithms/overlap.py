"""One-step-delay overlap (ALGORITHMS.md §1): the reduce of round t runs during round t+1's inner steps.

Each replica (φ_0 = initial weights, s_1 = φ_0, nothing pending before round 1):

    round t:  H inner steps from s_t end at e_t;  Δ_t = s_t − e_t
              start the reduce of Δ_t
              if the reduce of Δ_{t−1} is pending:
                  wait → Δ̄_{t−1};  φ_{t−1} = OuterOpt(φ_{t−2}, Δ̄_{t−1})
              s_{t+1} = start_from(φ_{t−1}, Δ_t)

``start_from`` is the update rule. "delayed" (`next_start`): s_{t+1} = φ_{t−1} − Δ_t, the newest
global point plus this replica's unsynced progress, which restarts every round one outer step
stale. "eager" (`EagerStart`, Kale, Douillard, Donchev 2025): s_{t+1} = OuterOpt(φ_{t−1}, ĝ_t)
previewed, φ and the outer state untouched, where ĝ_t stands in for the average Δ̄_t still in
flight: this replica's own fresh Δ_t for its share, the others' Δ_{t−1} (read from Δ̄_{t−1}) for
theirs (`eager_estimate`). Either way φ is stepped only with the agreed averages, so it stays
identical on every replica, and with gradients independent of θ the φ sequence is plain DiLoCo's.

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
UPDATES = ("eager", "delayed")  # the overlap's update rules (`diloco.overlap_update`)


def progress(start: Params, end: Params) -> list[torch.Tensor]:
    """Δ_t = s_t − e_t: this round's own progress, with DiLoCo's sign (the outer step descends it)."""
    return [s.detach().float() - e.detach().float() for s, e in zip(start, end)]


def next_start(phi: Params, own_progress: Params) -> list[torch.Tensor]:
    """s_{t+1} = φ − Δ_t: the newest agreed φ plus the progress the next reduce will replace."""
    return [p.detach().float() - d for p, d in zip(phi, own_progress)]


def eager_estimate(own: Params, mean_before: Params | None, own_before: Params | None,
                   count_before: int) -> list[torch.Tensor]:
    """ĝ_t, the stand-in for round t's average: each replica's share of it is the freshest Δ known here.

    ``mean_before``: Δ̄_{t−1}, the mean of ``count_before`` contributions; ``own_before``: this replica's
    Δ_{t−1} where it was one of them, else None. ĝ_t = Δ̄_{t−1} + (Δ_t − Δ_{t−1})/n where it was (its own
    share replaced by the fresh one), (Δ_t + n·Δ̄_{t−1})/(n + 1) where it was not; Δ_t alone while no
    average has landed (round 1, or after a state download).
    """
    if mean_before is None or count_before < 1:
        return [d.clone() for d in own]
    n = float(count_before)
    if own_before is not None:
        return [m + (d - b) / n for m, d, b in zip(mean_before, own, own_before)]
    return [(d + n * m) / (n + 1.0) for m, d in zip(mean_before, own)]


class EagerStart:
    """The eager rule's ``start_from``: s_{t+1} = ``preview(φ_{t−1}, ĝ_t)``, the outer step on ĝ_t
    that leaves φ and the outer optimizer's state as they are. ``landed()`` says what the round that
    just landed gave: (Δ̄_{t−1}, its contributor count, whether this replica was one), or None."""

    def __init__(self, preview: Callable[[Params, list[torch.Tensor]], list[torch.Tensor]],
                 landed: Callable[[], tuple[list[torch.Tensor], int, bool] | None]):
        self.preview, self.landed = preview, landed
        self.own_before: list[torch.Tensor] | None = None  # Δ_{t−1}, sent in the round that lands next

    def __call__(self, phi: Params, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        landed = self.landed()
        if landed is None:
            estimate = eager_estimate(delta, None, None, 0)
        else:
            mean, count, contributed = landed
            estimate = eager_estimate(delta, mean, self.own_before if contributed else None, count)
        self.own_before = delta
        return self.preview(phi, estimate)

    def forget(self) -> None:
        """A state download or resync: this replica's Δ_{t−1} is in no round it will see land."""
        self.own_before = None


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
