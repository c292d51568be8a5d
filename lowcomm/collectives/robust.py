"""What a shard owner makes of its shard's dense parts: the weighted mean or a robust stand-in for it.

Every function takes the shard's parts as ``(values, weight)`` pairs in sender order (the owner
sorts by sender id), so the result is the same bytes whatever order the parts arrived in:

- ``weighted_mean``: Σ w_i·v_i / Σ w_i, summed in that order (defences off).
- ``median_clip``: each v_i scaled by min(1, median_norm / (‖v_i‖ + 1e-8)), the median over the
  parts present (torch's lower middle value for an even count, as SparseLoCo, ALGORITHMS.md §3),
  then the weighted mean: a member's share of it is at most w_i/Σw × median_norm long.
- ``trimmed_mean``: per coordinate, the ⌊f·n⌋ largest and smallest values left out (at least one
  value kept), the weighted mean of the rest: each coordinate stays within the honest parts' range
  while at most ⌊f·n⌋ parts are hostile.
- ``centered_clip`` (Karimireddy et al. 2021, BTARD): from the median-clipped mean, v ← v +
  Σ w_i·clip_τ(x_i − v) / Σ w_i a few times, τ = clip_tau × the median of ‖x_i − v₀‖: one
  member moves v by at most w_i/Σw × τ per iteration. τ is relative because a shard's scale
  depends on its size, the model and the learning rate; an absolute radius would not carry over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

AGGREGATES = ("median-clip", "mean", "trimmed-mean", "centered-clip")
CLIP_EPS = 1e-8  # as SparseLoCo's clip
CENTERED_CLIP_ITERATIONS = 5
TRIM_BLOCK = 1 << 20  # coordinates sorted at once: the sort holds parts × block values and indices

Part = tuple[torch.Tensor, float]  # (values, weight) of one sender


def weighted_mean(parts: Sequence[Part]) -> torch.Tensor:
    """Σ w_i·v_i / Σ w_i in float32, summed in the given order."""
    total = sum(values.to(torch.float32) * weight for values, weight in parts)
    return total / sum(weight for _, weight in parts)


def median_clip(parts: Sequence[Part]) -> list[Part]:
    """Each part scaled to at most the median of the parts' norms; weights unchanged."""
    values = [v.to(torch.float32) for v, _ in parts]
    norms = torch.stack([v.norm() for v in values])
    median = norms.median()  # the lower middle value for an even count
    return [(v * torch.clamp(median / (norm + CLIP_EPS), max=1.0), w)
            for v, norm, (_, w) in zip(values, norms, parts)]


def trim_count(parts: int, fraction: float) -> int:
    """Values left out at each end of a coordinate: ⌊fraction·parts⌋, keeping at least one value."""
    return min(int(fraction * parts), (parts - 1) // 2)


def trimmed_mean(parts: Sequence[Part], fraction: float) -> torch.Tensor:
    """Per coordinate, the weighted mean of the values left after trimming ``trim_count`` at each end."""
    k = trim_count(len(parts), fraction)
    if k == 0:
        return weighted_mean(parts)
    stacked = torch.stack([v.to(torch.float32) for v, _ in parts])
    weights = torch.tensor([w for _, w in parts], dtype=torch.float64)
    out = torch.empty(stacked.shape[1], dtype=torch.float32)
    for start in range(0, stacked.shape[1], TRIM_BLOCK):
        block = stacked[:, start:start + TRIM_BLOCK]
        # stable: equal values keep sender order, so ties are broken the same way on every owner
        ordered, index = torch.sort(block, dim=0, stable=True)
        kept, kept_weights = ordered[k:len(parts) - k].double(), weights[index[k:len(parts) - k]]
        out[start:start + TRIM_BLOCK] = ((kept * kept_weights).sum(0) / kept_weights.sum(0)).float()
    return out


def centered_clip(parts: Sequence[Part], tau: float, iterations: int = CENTERED_CLIP_ITERATIONS) -> torch.Tensor:
    """CenteredClip from the median-clipped mean, with radius ``tau`` × the parts' median distance from it."""
    center = weighted_mean(median_clip(parts))
    values = [v.to(torch.float32) for v, _ in parts]
    total = sum(w for _, w in parts)
    radius = tau * torch.stack([(v - center).norm() for v in values]).median()
    for _ in range(iterations):
        step = sum(w * _clip(v - center, radius) for v, (_, w) in zip(values, parts))
        center = center + step / total
    return center


def _clip(difference: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    return difference * torch.clamp(radius / (difference.norm() + CLIP_EPS), max=1.0)


@dataclass(frozen=True)
class Aggregate:
    """One of AGGREGATES with its parameters; called on a shard's parts in sender order."""

    name: str = "mean"
    trim_fraction: float = 0.25  # trimmed-mean: the share of values left out at each end of a coordinate
    clip_tau: float = 1.0  # centered-clip: τ as a multiple of the parts' median distance from the start

    def __post_init__(self):
        if self.name not in AGGREGATES:
            raise ValueError(f"aggregate {self.name!r}: use one of {', '.join(AGGREGATES)}")

    def __call__(self, parts: Sequence[Part]) -> torch.Tensor:
        if self.name == "mean":
            return weighted_mean(parts)
        if self.name == "median-clip":
            return weighted_mean(median_clip(parts))
        if self.name == "trimmed-mean":
            return trimmed_mean(parts, self.trim_fraction)
        return centered_clip(parts, self.clip_tau)
