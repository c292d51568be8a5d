"""CheckFree and CheckFree+ (ALGORITHMS.md §6): rebuild a stage that lost every replica from its neighbours.

    ω_j = ‖g_j‖ + 1e-4                (stage j's last gradient norm, mean over its replicas)
    W_i = (ω_{i−1}·W_{i−1} + ω_{i+1}·W_{i+1}) / (ω_{i−1} + ω_{i+1})      blocks of an intermediate stage
    first / last stage (CheckFree+): copy the neighbour's blocks and its replica of the embedding / head

The rebuilt stage starts a fresh inner optimizer with its lr scaled by LR_SCALE from then on.
Tensors are dicts name → tensor with the stage-local names of pipeline.stages; any non-block tensor
of the lost stage (an embedding or head, or their replicas) is copied from the neighbour holding a
tensor of that name. Without CheckFree+ an end stage's embedding or head has no copy anywhere: it
is re-initialized from the run's seed (`fallback`) and the rebuild says so.
"""

from __future__ import annotations

import torch

LR_SCALE = 1.1
NORM_EPS = 1e-4


def weighted_blocks(prev: dict[str, torch.Tensor], nxt: dict[str, torch.Tensor], norm_prev: float,
                    norm_next: float) -> dict[str, torch.Tensor]:
    """The gradient-norm-weighted average of two neighbours' blocks (tensors named `blocks.*`)."""
    w_prev, w_next = norm_prev + NORM_EPS, norm_next + NORM_EPS
    names = [n for n in prev if n.startswith("blocks.")]
    if sorted(names) != sorted(n for n in nxt if n.startswith("blocks.")):
        raise ValueError("the two neighbours' blocks do not line up name for name")
    return {n: (w_prev * prev[n] + w_next * nxt[n]) / (w_prev + w_next) for n in names}


def rebuild_stage(stage: int, stages: int, expected: dict[str, tuple[int, ...]],
                  neighbours: dict[int, tuple[dict[str, torch.Tensor], float]],
                  fallback: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """(the lost stage's tensors, method) from `neighbours`: stage index → (its φ, its mean gradient norm).

    An intermediate stage needs both neighbours (CheckFree); an end stage copies its one neighbour
    (CheckFree+). Raises ValueError when a needed neighbour is missing.
    """
    sides = [s for s in (stage - 1, stage + 1) if 0 <= s < stages]
    missing = [s for s in sides if s not in neighbours]
    if missing:
        raise ValueError(f"stage {stage} cannot be rebuilt: neighbour stage(s) {missing} hold no replica")
    if len(sides) == 2:
        (prev, norm_prev), (nxt, norm_next) = neighbours[stage - 1], neighbours[stage + 1]
        out, method = weighted_blocks(prev, nxt, norm_prev, norm_next), "checkfree"
    else:
        out = {n: t.clone() for n, t in neighbours[sides[0]][0].items() if n.startswith("blocks.")}
        method = "checkfree+"
    fresh = set()
    for name in expected:
        if name in out:
            continue
        source = next((neighbours[s][0][name] for s in sides if name in neighbours[s][0]), None)
        if source is None:
            out[name] = fallback[name].clone()
            fresh.add(name.split(".")[0])
        else:
            out[name] = source.clone()
    if fresh:
        method += f" (fresh {', '.join(sorted(fresh))})"
    for name, shape in expected.items():
        if tuple(out[name].shape) != tuple(shape):
            raise ValueError(f"rebuilt {name} has shape {tuple(out[name].shape)}, stage expects {shape}")
    return {n: out[n] for n in expected}, method
