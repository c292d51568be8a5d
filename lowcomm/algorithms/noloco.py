"""NoLoCo (ALGORITHMS.md §4): no all-reduce; every H inner steps each replica averages with a small group.

    π = the round's members sorted by sha256(run ‖ round ‖ peer id)      # identical on every member
    n = ⌊W/G⌋ groups; group j = {π[j], π[j+n], …}; members left over join group 0
    ḡ = mean over the group of (θ_j − φ_j);  φ̄ = mean over the group of φ_j
    m_i ← β·m_i + α·ḡ + γ·(φ̄ − φ_i);  φ_i ← φ_i + m_i;  θ_i ← φ_i

Sign: ḡ = θ − φ is the direction of progress and φ moves along it (the opposite of DiLoCo's Δ).
The hash input is ``run``, ``round`` (decimal) and ``peer id`` as UTF-8 joined by NUL bytes, so no
two (run, round, peer) triples share one; ties in the hash (never seen) fall back to the peer id.

Late or gone partners: each member sends `Contribution(progress=θ−φ, phi=φ)` to its group and
waits for the others until the round's deadline, never longer. The update then averages over the
group members whose contribution arrived, itself always included, taken in group order
(`delivered`). A member whose partner missed the deadline therefore updates as a group of one:
ḡ = its own progress and φ̄ − φ_i = 0. Nobody waits for anything but the deadline, so a lost peer
cannot deadlock a round; the pair may end the round asymmetric (one side averaged, the other not),
which NoLoCo tolerates since replicas never share a single φ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass
class NoLoCoConfig:
    inner_steps: int = 30  # H; the paper's C4 runs use 50, lowcomm's reference run 30 (as diloco's)
    group_size: int = 2  # G (pairs)
    outer_lr: float = 0.7  # α
    momentum: float = 0.5  # β
    consensus: float | None = None  # γ; None = α, as the reference code
    codec: str = "fp32"  # wire codec of the contribution (runtime): fp32 | bf16 | uint8

    @property
    def gamma(self) -> float:
        return self.outer_lr if self.consensus is None else self.consensus


@dataclass
class Contribution:
    """What a member sends its group: its progress θ − φ and its outer parameters φ."""

    progress: list[torch.Tensor]
    phi: list[torch.Tensor]


def contribution(theta: Sequence[torch.Tensor], phi: Sequence[torch.Tensor]) -> Contribution:
    """This member's message: (θ − φ, φ), float32 copies."""
    return Contribution([t.detach().float() - p.float() for t, p in zip(theta, phi)],
                        [p.detach().float().clone() for p in phi])


# ---- pairing ---------------------------------------------------------------------------------

def pairing_key(run: str, round_: int, peer: str) -> bytes:
    return hashlib.sha256(b"\x00".join((run.encode(), str(int(round_)).encode(), peer.encode()))).digest()


def pairing_order(run: str, round_: int, members: Sequence[str]) -> list[str]:
    """π: the members sorted by sha256(run ‖ round ‖ peer id); independent of the input order."""
    if len(set(members)) != len(members):
        raise ValueError(f"duplicate member ids in {sorted(members)}")
    return sorted(members, key=lambda peer: (pairing_key(run, round_, peer), peer))


def groups(run: str, round_: int, members: Sequence[str], group_size: int = 2) -> list[tuple[str, ...]]:
    """The round's groups: group j = (π[j], π[j+n], …) with n = ⌊W/G⌋; the leftovers join group 0."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    order = pairing_order(run, round_, members)
    if not order:
        return []
    n = max(1, len(order) // group_size)
    out = [[order[j + i * n] for i in range(group_size) if j + i * n < len(order)] for j in range(n)]
    out[0].extend(order[n * group_size:])
    return [tuple(group) for group in out]


def group_of(run: str, round_: int, members: Sequence[str], group_size: int = 2) -> dict[str, tuple[str, ...]]:
    """Every member's group, as each member computes it alone from the round's manifest."""
    return {peer: group for group in groups(run, round_, members, group_size) for peer in group}


def delivered(group: Sequence[str], me: str, received: Mapping[str, Contribution],
              own: Contribution) -> list[Contribution]:
    """The contributions the update averages: the group's arrivals in group order, ``own`` always in."""
    if me not in group:
        raise ValueError(f"{me!r} is not in its group {tuple(group)}")
    return [own if peer == me else received[peer] for peer in group if peer == me or peer in received]


# ---- the outer step --------------------------------------------------------------------------

def _mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total.div_(len(tensors))


@torch.no_grad()
def outer_step(phi: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
               contributions: Sequence[Contribution], config: NoLoCoConfig) -> list[torch.Tensor]:
    """m ← βm + αḡ + γ(φ̄ − φ), φ ← φ + m (both in place); returns θ, a fresh copy of φ.

    ``contributions`` are the group's arrivals including this member's own (see `delivered`).
    """
    if not contributions:
        raise ValueError("no contributions: a member always averages at least with itself")
    for k, (p, m) in enumerate(zip(phi, momentum)):
        progress = _mean([c.progress[k] for c in contributions])
        phi_bar = _mean([c.phi[k] for c in contributions])
        m.mul_(config.momentum).add_(progress, alpha=config.outer_lr).add_(phi_bar - p, alpha=config.gamma)
        p.add_(m)
    return [p.clone() for p in phi]
