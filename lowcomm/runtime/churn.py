"""Churn for `simulate --churn SPEC`: the launcher-side executor (the parser is runtime.churn_spec).

A spec is a schedule or a rate:

    kill:1@r3,leave:1@r4,join:2@t30s   at swarm round R (`rR`) or T seconds after training started
                                       (`tTs`): kill -9 of N live peers' whole process groups,
                                       graceful leave of N peers (SIGTERM), or N new joiners
    killstage:1@r4                     pipelines: kill -9 of every peer serving stage 1 (0-based),
                                       as the peers' latest `stage` events say
    slow:1:4x@r5                       N peers become K times slower devices from then on (default
                                       4x): each peer's compute is stretched K-fold (`slowdown` event)
    linkdown:1:15s@r6                  --netns only: N peers' links go down for D seconds (default
                                       10 s; `ip link set` on the host end of each one's veth, as a
                                       cable pulled), then up again (`linkup` event)
    kill:all@r9                        kill -9 of every process group: the peers, parked joiners and
                                       the coordinator (a whole-swarm crash; resume with
                                       `simulate --resume RUN_DIR/checkpoints`)
    0.25/round                         each round, round(F x live peers) (at least 1) peers killed
                                       and as many new joiners released

The swarm is at round R once some peer has finished R rounds (read from the peers' JSONL round
records, never from the DHT). For ddp, whose rounds are single steps, the rate applies once per
membership epoch (`ddp.epoch_steps`), and only while a joiner can still enter a round. Victims
are drawn by one RNG seeded with run.seed, in event order, from the swarm's members (the first
peers, and joiners once they hold the global state) in index order, so a spec and a seed name the
same victims. At least one member is always kept: joiners download the global state from one.
A slow peer is told through its slowdown file (`peer join --slowdown-file`, RUN_DIR/slowdown-I,
read before each step), so it stays the same process with the same state and links.

Joiners are started ahead and parked at their own start file, so a join measures lowcomm, not
Python's start-up; the rate form keeps a pool of parked joiners ahead of need, and a join is
released only to a parked, ready joiner (owed until one is). A join is skipped when the run ends
before the joiner could enter a round. Every action is written as an event (`kill`, `leave`,
`join`, `slow`, `linkdown`, `linkup`, `skip`, with `by: "churn"`) to launcher/churn.jsonl in the
run folder, which the report reads beside the peers' records.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from lowcomm.runtime.churn_spec import ChurnAction, ChurnConfig, ChurnPlan, ChurnSpecError, parse_churn
from lowcomm.runtime.runlog import RunLog

if TYPE_CHECKING:
    from lowcomm.runtime.processes import Process
    from lowcomm.runtime.sim import Simulation

logger = logging.getLogger(__name__)
__all__ = ["ChurnAction", "ChurnConfig", "ChurnExecutor", "ChurnPlan", "ChurnSpecError", "choose_victims",
           "parse_churn", "rate_count", "swarm_round"]


def rate_count(rate: float, live: int) -> int:
    """How many of `live` peers one round of the rate form replaces: round(F x live), at least 1."""
    return max(1, round(rate * live))


def choose_victims(rng: random.Random, live: list[str], count: int) -> list[str]:
    """`count` of the `live` names, listed in index order (at least one is always kept), drawn by `rng`."""
    return rng.sample(list(live), max(0, min(count, len(live) - 1)))


def swarm_round(records: list[dict]) -> int:
    """The round the swarm is in: rounds finished by the most advanced peer, counted from the first round
    (pipelines number their rounds by wall clock since the run's epoch, so their first is not 0)."""
    rounds = [r["round"] for r in records if r["type"] == "round"]
    return max(rounds) + 1 - min(rounds) if rounds else 0


class ChurnExecutor:
    """Applies a plan to a running Simulation, called from its wait loop (no thread of its own).

    `begin(running)` takes the list of processes the wait loop waits on and appends released
    joiners to it; kills and leaves take effect at once (the wait loop sees those processes end).
    Victims are drawn from the swarm's members: the first peers, and joiners once they hold the
    global state (a joiner still starting or downloading is not one yet). A join whose joiner is not
    parked and ready yet is owed and released as soon as one is.
    """

    def __init__(self, plan: ChurnPlan, sim: "Simulation", seed: int, total_rounds: int, epoch_rounds: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.plan, self.sim, self.clock = plan, sim, clock
        self.total_rounds, self.epoch_rounds = total_rounds, epoch_rounds
        self.rng = random.Random(seed)
        self.pending = list(plan.actions)
        self.owed: list[tuple[int, str]] = []  # joins due but not released yet: (round due, what asked)
        self.spares: list[Process] = []  # started and parked, not released yet
        self.live: list[Process] = []  # released, neither killed nor sent away
        self.running: list[Process] = []
        self.removed: dict[str, str] = {}  # process name -> "kill" | "leave"
        self.next_index = sim.peers
        self.rate_rounds: set[int] = set()
        self.log = RunLog(Path(sim.run_dir) / "launcher" / "churn.jsonl", "launcher")
        self.started_at: float | None = None
        self.slowed: set[str] = set()  # names of the peers made slower
        self.down: list[tuple[float, "Process", str]] = []  # links down: (up again at, process, what asked)
        self.ended = False  # kill:all fired: nothing more to do

    # ---- the pool of parked joiners ----------------------------------------------------------

    @property
    def pool_size(self) -> int:
        """Joiners to keep started: every join still to come (schedule), or two rounds' worth (rate)."""
        if self.plan.rate is not None:
            ahead = 2 * rate_count(self.plan.rate, self.sim.peers)  # a round's joiners and the next round's
        else:
            ahead = sum(a.count for a in self.pending if a.action == "join")
        return ahead + len(self.owed)

    def start_spares(self) -> list["Process"]:
        """Starts parked joiners until the pool is full (replacing any that died); returns the new ones."""
        self.spares = [p for p in self.spares if p.popen.poll() is None]
        new = []
        while len(self.spares) < self.pool_size:
            index = self.next_index
            self.next_index += 1
            start_file = Path(self.sim.run_dir) / f"start-{index}"
            start_file.unlink(missing_ok=True)
            process = self.sim.start_peer(index, park=True, start_file=start_file)
            self.spares.append(process)
            new.append(process)
        return new

    def begin(self, running: list["Process"]) -> None:
        self.running = running
        self.live = list(running)
        self.started_at = self.clock()

    # ---- during training ---------------------------------------------------------------------

    def poll(self, records: list[dict]) -> None:
        if self.ended:
            return
        round_ = swarm_round(records)
        elapsed = self.clock() - self.started_at
        self._links_up(round_, records)
        due = [a for a in self.pending if a.due(round_, elapsed)]
        self.pending = [a for a in self.pending if a not in due]
        for action in due:
            if action.action == "join":
                self._owe(action.count, round_, str(action))
            elif action.action == "killstage":
                self._kill_stage(action.count, round_, records, str(action))
            elif action.action == "slow":
                self._slow(action, round_, records)
            elif action.action == "linkdown":
                self._link_down(action, round_, records)
            elif action.action == "killall":
                self._kill_all(round_, records, str(action))
                return
            else:
                self._remove(action.action, action.count, round_, records, str(action))
        if self.plan.rate is not None and round_ >= 1 and round_ % self.epoch_rounds == 0 \
                and round_ not in self.rate_rounds:
            self.rate_rounds.add(round_)
            if self._joinable(round_):
                count = rate_count(self.plan.rate, len(self._members(records)))
                self._owe(self._remove("kill", count, round_, records, str(self.plan)), round_, str(self.plan))
        self._release_owed(round_, records)
        self.start_spares()

    def _members(self, records: list[dict]) -> list["Process"]:
        """Released peers still running that are in the swarm, in index order (victims are drawn from these)."""
        self.live = sorted((p for p in self.live if p.popen.poll() is None), key=lambda p: p.index)
        ids = self.sim.peer_ids(records)
        joined = {r["peer"] for r in records
                  if r["type"] == "round" or (r["type"] == "event" and r.get("kind") == "state_received")}
        return [p for p in self.live if p.index < self.sim.peers or ids.get(p.index) in joined]

    def _joinable(self, round_: int) -> bool:
        """Whether a joiner released now can still enter a round before the run ends."""
        boundary = (round_ // self.epoch_rounds + 1) * self.epoch_rounds
        return boundary < self.total_rounds

    def _owe(self, count: int, round_: int, at: str) -> None:
        if count and not self._joinable(round_):
            self._event("skip", action="join", count=count, round=round_, at=at,
                        reason="the run ends before a joiner could enter a round")
            return
        self.owed += [(round_, at)] * count

    def _release_owed(self, round_: int, records: list[dict]) -> None:
        """Releases owed joins to parked, ready joiners while a joiner can still enter a round."""
        if self.owed and not self._joinable(round_):
            for due_round, at in self.owed:
                self._event("skip", action="join", count=1, round=round_, at=at, due_round=due_round,
                            reason="no parked joiner was ready before the run's last round")
            self.owed = []
            return
        ids, ready = self.sim.peer_ids(records), self.sim.ready_ids(records)
        for process in [p for p in self.spares if ids.get(p.index) in ready and p.popen.poll() is None]:
            if not self.owed:
                return
            due_round, at = self.owed.pop(0)
            self.spares.remove(process)
            self.running.append(process)  # the wait loop waits on it from now on
            self.live.append(process)
            process.start_file.touch()
            self._event("join", peer=ids[process.index], name=process.name, round=round_, at=at,
                        due_round=due_round)

    def _remove(self, action: str, count: int, round_: int, records: list[dict], at: str) -> int:
        """Kills (or sends away) `count` seeded victims among the swarm's members; returns how many."""
        members = self._members(records)
        victims = set(choose_victims(self.rng, [p.name for p in members], count))
        if len(victims) < count:
            self._event("skip", action=action, count=count - len(victims), round=round_, at=at,
                        reason=f"only {len(members)} peers in the swarm; at least one is kept")
        ids = self.sim.peer_ids(records)
        for process in [p for p in members if p.name in victims]:
            if action == "kill":
                process.kill_group(signal.SIGKILL)
            else:  # only the peer itself: its handler expires its records and stops its DHT daemons
                process.popen.send_signal(signal.SIGTERM)
            self.live.remove(process)
            self.removed[process.name] = action
            self._event(action, peer=ids.get(process.index), name=process.name, round=round_, at=at)
        return len(victims)

    def _kill_stage(self, stage: int, round_: int, records: list[dict], at: str) -> None:
        """Kills every live peer whose latest `stage` event says it serves `stage` (the others are kept)."""
        serving = {}
        for r in records:
            if r["type"] == "event" and r.get("kind") == "stage":
                serving[r["peer"]] = r["stage"]
        ids = self.sim.peer_ids(records)
        victims = [p for p in self._members(records) if serving.get(ids.get(p.index)) == stage]
        if not victims:
            self._event("skip", action="killstage", stage=stage, round=round_, at=at, reason="no peer serves it")
        for process in victims:
            process.kill_group(signal.SIGKILL)
            self.live.remove(process)
            self.removed[process.name] = "kill"
            self._event("kill", peer=ids.get(process.index), name=process.name, round=round_, at=at, stage=stage)

    def _slow(self, action: ChurnAction, round_: int, records: list[dict]) -> None:
        """Makes seeded members `factor` times slower through their slowdown files (runtime.peer reads them)."""
        members = [p for p in self._members(records) if p.name not in self.slowed]
        ids = self.sim.peer_ids(records)
        for process in self._victims(action, members, round_):
            path = Path(self.sim.run_dir) / f"slowdown-{process.index}"
            path.with_suffix(".tmp").write_text(f"{action.factor:g}\n")
            os.replace(path.with_suffix(".tmp"), path)
            self.slowed.add(process.name)
            self._event("slow", peer=ids.get(process.index), name=process.name, round=round_, at=str(action),
                        factor=action.factor)

    def _link_down(self, action: ChurnAction, round_: int, records: list[dict]) -> None:
        """Takes seeded members' links down (namespace mode) until `down_s` seconds from now."""
        down = {p.name for _, p, _ in self.down}
        members = [p for p in self._members(records) if p.name not in down]
        ids = self.sim.peer_ids(records)
        for process in self._victims(action, members, round_):
            self.sim.set_link(process.name, up=False)
            self.down.append((self.clock() + action.down_s, process, str(action)))
            self._event("linkdown", peer=ids.get(process.index), name=process.name, round=round_, at=str(action),
                        down_s=action.down_s)

    def _links_up(self, round_: int, records: list[dict], everything: bool = False) -> None:
        """Brings up the links whose time is over (`everything`: all that are down)."""
        ids, now = self.sim.peer_ids(records), self.clock()
        for entry in [e for e in self.down if everything or e[0] <= now]:
            self.down.remove(entry)
            _, process, at = entry
            self.sim.set_link(process.name, up=True)
            self._event("linkup", peer=ids.get(process.index), name=process.name, round=round_, at=at)

    def _victims(self, action: ChurnAction, candidates: list["Process"], round_: int) -> list["Process"]:
        """`action.count` seeded victims among `candidates` (one always spared); a `skip` event for the rest."""
        chosen = set(choose_victims(self.rng, [p.name for p in candidates], action.count))
        if len(chosen) < action.count:
            self._event("skip", action=action.action, count=action.count - len(chosen), round=round_, at=str(action),
                        reason=f"only {len(candidates)} peers to choose from; at least one is spared")
        return [p for p in candidates if p.name in chosen]

    def _kill_all(self, round_: int, records: list[dict], at: str) -> None:
        """kill -9 of every process group of the run: each peer (parked joiners too) and the coordinator."""
        ids = self.sim.peer_ids(records)
        for process in [p for p in self.running + self.spares if p.popen.poll() is None]:
            process.kill_group(signal.SIGKILL)
            self.removed[process.name] = "kill"
            self._event("kill", peer=ids.get(process.index), name=process.name, round=round_, at=at)
        self.sim.coordinator.kill_group(signal.SIGKILL)
        self._event("kill", peer="coordinator", name="coordinator", round=round_, at=at)
        self.live, self.spares, self.ended = [], [], True

    # ---- after training ----------------------------------------------------------------------

    def close(self, records: list[dict]) -> None:
        """Logs what never fired and ends the joiners that were never released."""
        round_ = swarm_round(records)
        if self.down and not self.ended:
            self._links_up(round_, records, everything=True)
        for action in self.pending:
            self._event("skip", action=action.action, count=action.count, round=round_, at=str(action),
                        reason="the run ended first")
        for due_round, at in self.owed:
            self._event("skip", action="join", count=1, round=round_, at=at, due_round=due_round,
                        reason="the run ended before a parked joiner was ready")
        for process in self.spares:
            process.kill_group(signal.SIGKILL)
        self.log.close()

    def summary(self) -> dict:
        return {"spec": str(self.plan),
                "killed": sorted(n for n, a in self.removed.items() if a == "kill"),
                "left": sorted(n for n, a in self.removed.items() if a == "leave"),
                "joined": sorted(p.name for p in self.running if p.index is not None and p.index >= self.sim.peers),
                "slowed": sorted(self.slowed)}

    def _event(self, kind: str, **fields) -> None:
        logger.info("churn: %s %s", kind, fields)
        self.log.event(kind, by="churn", **fields)
