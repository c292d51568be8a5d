"""Streaming DiLoCo's schedule (ALGORITHMS.md §1): P fragments synced in turn, each applied τ steps late.

Fragment p's reduce starts after every inner step t ≥ 1 with t ≡ p·⌊H/P⌋ (mod H) (fragment 0 at
H, 2H, …; fragment p > 0 first at p·⌊H/P⌋), on Δ_p = φ_p − θ_p at that step. It is awaited τ
inner steps later (`fragment_sync_delay`, 0 ≤ τ < H), where the outer step updates φ_p and the
live θ_p ← lerp(φ_p, θ_p, α) = φ_p + α(θ_p − φ_p) (α = 0 by default: θ_p = φ_p). With P = 1,
τ = 0, α = 0 this is plain DiLoCo. The outer step itself is DiLoCo's (per-parameter state, so
stepping one fragment leaves the others' momentum alone); these functions only say when and what.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def check_schedule(inner_steps: int, fragments: int, delay: int) -> None:
    if fragments < 1 or inner_steps < fragments:
        raise ValueError(f"need 1 ≤ fragments ≤ inner_steps, got fragments={fragments}, inner_steps={inner_steps}")
    if not 0 <= delay < inner_steps:
        raise ValueError(f"fragment_sync_delay must be in [0, inner_steps={inner_steps}), got {delay}")


def sync_offset(fragment: int, inner_steps: int, fragments: int) -> int:
    """p·⌊H/P⌋: where in each H-step cycle fragment p starts its reduce."""
    return fragment * (inner_steps // fragments)


def syncs_starting(step: int, inner_steps: int, fragments: int) -> list[int]:
    """Fragments whose reduce starts right after inner step ``step`` (counted from 1)."""
    if step < 1:
        return []
    return [p for p in range(fragments) if (step - sync_offset(p, inner_steps, fragments)) % inner_steps == 0]


def syncs_applying(step: int, inner_steps: int, fragments: int, delay: int) -> list[int]:
    """Fragments whose reduce, started ``delay`` steps ago, is awaited and applied after ``step``."""
    return syncs_starting(step - delay, inner_steps, fragments)


def strided_fragments(names: Sequence[str], fragments: int) -> list[int]:
    """Each parameter's fragment: transformer block b goes to b mod P (``blocks.<b>.`` in the name).

    Parameters before the first block (embeddings) join fragment 0, those after the last (head)
    fragment P − 1, so the extras do not all land on one fragment.
    """
    out, seen_block = [], False
    for name in names:
        match = _BLOCK.search(name)
        if match:
            seen_block = True
            out.append(int(match.group(1)) % fragments)
        else:
            out.append(fragments - 1 if seen_block else 0)
    return out


def members(assignment: Sequence[int], fragment: int) -> list[int]:
    """Indices of the parameters in ``fragment``."""
    return [i for i, p in enumerate(assignment) if p == fragment]


def merge(phi: Sequence[torch.Tensor], theta: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """θ_p ← lerp(φ_p, θ_p, α) = φ_p + α·(θ_p − φ_p), in θ's dtype."""
    return [torch.lerp(p.detach().float(), t.detach().float(), alpha).to(t.dtype) for p, t in zip(phi, theta)]
