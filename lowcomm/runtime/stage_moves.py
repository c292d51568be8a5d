"""A stage peer's moves: where a joiner goes, and whether this peer is the one to move (pipeline.rebalance).

Every peer plans from the same DHT records (its own record too), so one peer moves: to an empty
stage at once, else every `rebalance_every_rounds` rounds (or at the `rebalance@R` test hook) when
the move lifts the weaker of its donor and target stages enough (`pipeline.hysteresis`).
"""

from __future__ import annotations

from collections.abc import Callable

from lowcomm.pipeline.rebalance import Placement, plan_move
from lowcomm.pipeline.server import StageServer
from lowcomm.runtime.context import PeerContext
from lowcomm.runtime.faults import Fault
from lowcomm.runtime.stage_state import StageState
from lowcomm.transport.control import PeerRecord


class StageMoves:
    def __init__(self, ctx: PeerContext, state: StageState, server: StageServer,
                 stage_records: Callable[[], list[PeerRecord]]):
        self.ctx, self.state, self.server, self.stage_records = ctx, state, server, stage_records
        self.config, self.stages = ctx.config, ctx.config.pipeline.stages
        self._empty_streak = 0  # consecutive checks that found a stage with no replica
        self._hook_fired = False

    def placements(self) -> list[Placement]:
        """Who serves what, as the DHT records say (this peer's own record too, so every peer plans from the
        same numbers); a newcomer's unknown throughput is taken as the median of the known ones."""
        records = {r.peer_id: r for r in self.stage_records()}
        known = sorted(r.throughput for r in records.values() if r.throughput > 0)
        default = known[len(known) // 2] if known else 1.0
        me, stage = self.ctx.me, self.state.stage
        out = [Placement(r.peer_id, r.stage, r.throughput or default) for r in records.values() if r.peer_id != me]
        if stage >= 0:
            mine = records.get(me)
            throughput = mine.throughput if mine is not None and mine.stage == stage else self.server.throughput
            out.append(Placement(me, stage, throughput or default))
        return out

    def maybe_move(self, round_: int, rounds_done: int) -> None:
        """A move when a stage is empty, every rebalance_every_rounds rounds, or at the `rebalance@R` hook.

        Every peer computes the same plan from the same records, so one peer moves. If a stage stays
        empty (its planned mover is stuck or gone before its record expired), each further check
        plans without one more of the movers planned before.
        """
        p = self.config.pipeline
        placements = self.placements()
        empty = any(not [q for q in placements if q.stage == s] for s in range(self.stages))
        self._empty_streak = self._empty_streak + 1 if empty else 0
        periodic = p.rebalance_every_rounds > 0 and round_ % p.rebalance_every_rounds == 0
        hook = self._hook_due(rounds_done)
        if not (empty or periodic or hook):
            return
        if not empty and any(r.stage_state == "joining" for r in self.stage_records()):
            return  # a move is under way: plan again once its throughput is known where it went
        skipped: set[str] = set()
        for _ in range(max(1, self._empty_streak)):
            plan = plan_move([q for q in placements if q.peer_id not in skipped], self.stages, p.hysteresis)
            if plan is None or plan[0] == self.ctx.me:
                break
            skipped.add(plan[0])
        if plan is None or plan[0] != self.ctx.me:
            return
        _, source, target = plan
        self.ctx.log.event("rebalance", stage=target, previous=source, round=round_,
                           reason="empty stage" if empty else ("hook" if hook else "throughput"),
                           skipped=sorted(skipped),
                           throughputs={str(s): round(sum(q.throughput for q in placements if q.stage == s), 3)
                                        for s in range(self.stages)})
        self._empty_streak = 0
        self.state.take(target, "move")

    def _hook_due(self, rounds_done: int) -> bool:
        """The test hook `rebalance@N`: one rebalancing check after this peer's N-th round."""
        faults = self.ctx.faults
        if self._hook_fired or faults.kind is not Fault.REBALANCE:
            return False
        self._hook_fired = rounds_done >= faults.round
        return self._hook_fired
