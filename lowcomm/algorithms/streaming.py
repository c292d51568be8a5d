"""Streaming DiLoCo's schedule (ALGORITHMS.md §1): P fragments synced in turn, each applied τ steps late.

Fragment p's reduce starts after every inner step t ≥ 1 with t ≡ p·⌊H/P⌋ (mod H) (fragment 0 at
H, 2H, …; fragment p > 0 first at p·⌊H/P⌋), on Δ_p = φ_p − θ_p at that step. It is awaited τ
inner steps later (`fragment_sync_delay`, 0 ≤ τ < H), where the outer step updates φ_p and the
live θ_p ← lerp(φ_p, θ_p, α) = φ_p + α(θ_p − φ_p) (α = 0 by default: θ_p = φ_p). With P = 1,
τ = 0, α = 0 this is plain DiLoCo. The outer step itself is DiLoCo's (per-parameter state, so
stepping one fragment leaves the others' momentum alone); these functions only say when and what.

The runtime numbers fragment syncs as one sequence of rounds n = 0, 1, 2, … in start order (each
cycle: fragments 1, …, P − 1, then 0), so round n syncs fragment (n + 1) mod P and one counter
orders memberships, φ hashes and snapshots as it does for DiLoCo. It also needs τ < ⌊H/P⌋ (torchft's
rule): a fragment's reduce is applied before the next one starts, so one round is in flight at a
time and after every applied round φ is the same on every replica, with nothing pending.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
CODECS = ("uint8", "fp8", "fp32")


@dataclass
class StreamingConfig:
    """[streaming]: H, the outer optimizer and its lr come from [diloco]; these say how to cut and delay."""

    fragments: int = 2  # P
    fragment_sync_delay: int = 5  # τ, in inner steps; < ⌊H/P⌋
    alpha: float = 0.0  # θ_p ← lerp(φ_p, θ_p, α) after fragment p's outer step
    codec: str = "uint8"  # the fragment payload on the wire: uint8 | fp8 | fp32


def check_schedule(inner_steps: int, fragments: int, delay: int) -> None:
    if fragments < 1 or inner_steps < fragments:
        raise ValueError(f"need 1 ≤ fragments ≤ inner_steps, got fragments={fragments}, inner_steps={inner_steps}")
    if not 0 <= delay < inner_steps:
        raise ValueError(f"fragment_sync_delay must be in [0, inner_steps={inner_steps}), got {delay}")


def check_one_in_flight(inner_steps: int, fragments: int, delay: int) -> None:
    """The runtime's stricter rule: τ < ⌊H/P⌋, so a fragment's reduce lands before the next one starts."""
    check_schedule(inner_steps, fragments, delay)
    if delay >= inner_steps // fragments:
        raise ValueError(f"fragment_sync_delay = {delay} must be < inner_steps // fragments = "
                         f"{inner_steps // fragments}: one fragment sync in flight at a time")


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


def round_fragment(round_: int, fragments: int) -> int:
    """The fragment synced by round ``round_`` (rounds counted from 0 in start order)."""
    return (round_ + 1) % fragments


def round_start_step(round_: int, inner_steps: int, fragments: int) -> int:
    """The inner step after which round ``round_``'s reduce starts."""
    cycle, fragment = divmod(round_ + 1, fragments)
    return cycle * inner_steps + sync_offset(fragment, inner_steps, fragments)


def round_starting(step: int, inner_steps: int, fragments: int) -> int | None:
    """The round whose reduce starts after inner step ``step``, if any (the inverse of round_start_step)."""
    starting = syncs_starting(step, inner_steps, fragments)
    if not starting:
        return None
    return (step // inner_steps) * fragments + starting[0] - 1


def step_after_rounds(completed: int, inner_steps: int, fragments: int, delay: int) -> int:
    """The inner step at which a replica has just applied round ``completed − 1`` (0: the start)."""
    return round_start_step(completed - 1, inner_steps, fragments) + delay if completed > 0 else 0


def rounds_started_by(step: int, inner_steps: int, fragments: int) -> int:
    """How many rounds start after an inner step ≤ ``step`` (the rounds of a run of ``step`` steps)."""
    cycles, rest = divmod(step, inner_steps)
    return cycles * fragments + sum(1 for p in range(1, fragments) if sync_offset(p, inner_steps, fragments) <= rest)


def strided_fragments(names: Sequence[str], fragments: int) -> list[int]:
    """Each parameter's fragment: transformer block b goes to b mod P (``blocks.<b>.`` in the name).

    Parameters before the first block (embeddings) join fragment 0, those after the last (head)
    fragment P − 1, so the extras do not all land on one fragment. A model with no ``blocks.<b>.``
    in any name (a user's own) is strided by parameter instead: parameter i goes to i mod P.
    """
    if not any(_BLOCK.search(name) for name in names):
        return [i % fragments for i in range(len(names))]
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
