"""Placement of peers on pipeline stages (ALGORITHMS.md §5): throughput-based, with hysteresis.

Pure policy over a snapshot of who serves which stage at what throughput; the runtime reads the
snapshot from the DHT and carries out the moves. Every peer evaluating `plan_move` on the same
snapshot gets the same answer, so at most one peer moves per snapshot. A pipeline is as fast as its
slowest stage; stages hold equal numbers of blocks, so a peer's throughput does not depend on its
stage. `best_static_assignment` is the exhaustive optimum that experiments compare the greedy
moves against.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Placement:
    peer_id: str
    stage: int
    throughput: float  # tasks/s this peer sustains for its stage


def _stage_members(placements: Iterable[Placement], stages: int) -> list[list[Placement]]:
    if stages < 1:
        raise ValueError(f"a pipeline has at least one stage, got {stages}")
    members: list[list[Placement]] = [[] for _ in range(stages)]
    seen: set[str] = set()
    for placement in placements:
        if not 0 <= placement.stage < stages:
            raise ValueError(f"peer {placement.peer_id} serves stage {placement.stage}, outside 0..{stages - 1}")
        if placement.peer_id in seen:
            raise ValueError(f"peer {placement.peer_id} is placed twice; keep one record per peer")
        seen.add(placement.peer_id)
        members[placement.stage].append(placement)
    for stage in members:  # a fixed summation order: identical totals whatever order peers listed them in
        stage.sort(key=lambda placement: placement.peer_id)
    return members


def _totals(members: list[list[Placement]]) -> list[float]:
    return [sum((placement.throughput for placement in stage), 0.0) for stage in members]


def _neediest_stage(members: list[list[Placement]], totals: list[float]) -> int:
    return min(range(len(members)), key=lambda stage: (bool(members[stage]), totals[stage], stage))


def stage_throughputs(placements: Iterable[Placement], stages: int) -> list[float]:
    """Total throughput per stage; 0.0 for an empty stage."""
    return _totals(_stage_members(placements, stages))


def pipeline_throughput(placements: Iterable[Placement], stages: int) -> float:
    return min(stage_throughputs(placements, stages))


def joiner_stage(placements: Iterable[Placement], stages: int) -> int:
    """The lowest empty stage, else the stage with the least total throughput (ties: lowest index)."""
    members = _stage_members(placements, stages)
    return _neediest_stage(members, _totals(members))


DEFAULT_HYSTERESIS = 0.1


def _sum(placements: Iterable[Placement]) -> float:
    """Total throughput, summed in peer_id order: the same float whatever order the peers came in."""
    return sum((p.throughput for p in sorted(placements, key=lambda placement: placement.peer_id)), 0.0)


def plan_move(placements: Iterable[Placement], stages: int,
              hysteresis: float = DEFAULT_HYSTERESIS) -> tuple[str, int, int] | None:
    """(mover, from stage, to stage), or None when no move qualifies.

    The target is the neediest stage (the lowest empty stage, else the one with the least total
    throughput). Any other stage with at least two peers may donate any one of its peers, so a move
    never empties a stage. A move is allowed when the target is empty, or when both the donor and the
    target end above the target's current total by more than the factor 1 + hysteresis:
    min(donor after, target after) > (1 + hysteresis) * target before. Among allowed moves the one
    maximizing min(donor after, target after) wins; ties go to the lowest donor stage, then the
    lowest peer_id.

    A move fills an empty stage (and none is ever emptied), or replaces the lowest stage total and a
    higher one by two totals above the lowest, so the sorted stage totals rise lexicographically:
    rebalancing terminates, the pipeline throughput never drops, and moving a peer straight back is
    never allowed (it would leave its old target with no peer, or the two stages' minimum at the
    target's old total, below the threshold). Hysteresis must be >= 0.
    """
    if not hysteresis >= 0:
        raise ValueError(f"hysteresis must be >= 0 (a negative one can flip-flop), got {hysteresis}")
    members = _stage_members(placements, stages)
    totals = _totals(members)
    target = _neediest_stage(members, totals)
    threshold = (1 + hysteresis) * totals[target]
    best: tuple[float, int, str] | None = None  # (-(min after), donor, peer_id): the smallest wins
    for donor in range(stages):
        if donor == target or len(members[donor]) < 2:
            continue
        for mover in members[donor]:
            donor_after = _sum(p for p in members[donor] if p is not mover)
            target_after = _sum([*members[target], mover])
            worse = min(donor_after, target_after)
            if members[target] and not worse > threshold:
                continue
            key = (-worse, donor, mover.peer_id)
            if best is None or key < best:
                best = key
    return None if best is None else (best[2], best[1], target)


def should_move(placements: Iterable[Placement], stages: int, me: str,
                hysteresis: float = DEFAULT_HYSTERESIS) -> int | None:
    """The stage `me` should move to, when `me` is the planned mover."""
    move = plan_move(placements, stages, hysteresis)
    return move[2] if move is not None and move[0] == me else None


def best_static_assignment(throughputs: dict[str, float], stages: int) -> tuple[dict[str, int], float]:
    """The peer -> stage assignment (every stage served) maximizing pipeline throughput, and that throughput.

    Branch and bound over set partitions: stages are interchangeable, so a peer only opens the
    first empty stage, and a branch stops once it cannot beat the best found so far.
    """
    if stages < 1:
        raise ValueError(f"a pipeline has at least one stage, got {stages}")
    if len(throughputs) < stages:
        raise ValueError(f"{len(throughputs)} peers cannot serve {stages} stages: every stage needs a peer")
    peers = sorted(throughputs, key=lambda peer: (-throughputs[peer], peer))  # strong peers first: tight bounds early
    left = [0.0] * (len(peers) + 1)  # left[i]: throughput of peers[i:]
    for i in reversed(range(len(peers))):
        left[i] = left[i + 1] + throughputs[peers[i]]
    ceiling = left[0] / stages
    best_value, best_stages = -1.0, ()
    stage_of: list[int] = []

    def search(sums: tuple[float, ...], opened: int) -> None:
        nonlocal best_value, best_stages
        i = len(stage_of)
        if len(peers) - i < stages - opened:
            return
        if i == len(peers):
            if min(sums) > best_value:
                best_value, best_stages = min(sums), tuple(stage_of)
            return
        if min(min(sums) + left[i], ceiling) <= best_value:
            return
        for stage in range(min(opened + 1, stages)):
            stage_of.append(stage)
            search(sums[:stage] + (sums[stage] + throughputs[peers[i]],) + sums[stage + 1:], max(opened, stage + 1))
            stage_of.pop()

    search((0.0,) * stages, 0)
    assignment = dict(zip(peers, best_stages))
    return {peer: assignment[peer] for peer in throughputs}, best_value


def rebalance_until_stable(placements: Iterable[Placement], stages: int,
                           hysteresis: float = DEFAULT_HYSTERESIS, max_moves: int = 100) -> list[Placement]:
    """The placements after applying `plan_move` until it returns None (at most `max_moves` moves)."""
    current = list(placements)
    for _ in range(max_moves):
        move = plan_move(current, stages, hysteresis)
        if move is None:
            break
        mover, _, target = move
        current = [replace(p, stage=target) if p.peer_id == mover else p for p in current]
    return current
