"""Churn: the --churn parser, seeded victims and the executor's decisions on fake processes (the
simulate run with real processes is in tests/integration/test_churn_e2e.py). Assertions are on records
and events, never on durations; every wait has a deadline."""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lowcomm.config import ConfigError, default_config, load_config
from lowcomm.runtime.churn import (ChurnAction, ChurnExecutor, ChurnPlan, ChurnSpecError, choose_victims,
                                   parse_churn, rate_count, swarm_round)
from lowcomm.runtime.churn_spec import DOWN_S, SLOW_FACTOR
from lowcomm.runtime.runlog import read_records
from lowcomm.runtime.sim import Simulation

# ---- the spec ---------------------------------------------------------------------------------


def test_schedule_parses_into_typed_actions_in_order():
    plan = parse_churn("kill:1@r3, leave:1@r4,join:2@t30s,join:1@t0.5s")
    assert plan == ChurnPlan(actions=(ChurnAction("kill", 1, round=3), ChurnAction("leave", 1, round=4),
                                      ChurnAction("join", 2, seconds=30.0), ChurnAction("join", 1, seconds=0.5)))
    assert plan.scheduled_joiners == 3
    assert str(plan) == "kill:1@r3,leave:1@r4,join:2@t30s,join:1@t0.5s"
    assert parse_churn(str(plan)) == plan


@pytest.mark.parametrize("spec, rate", [("0.25/round", 0.25), ("1/round", 1.0), (".5/rounds", 0.5)])
def test_rate_parses(spec, rate):
    assert parse_churn(spec) == ChurnPlan(rate=rate)


@pytest.mark.parametrize("spec", [None, "", "  ", "none", "off", "NONE"])
def test_no_churn(spec):
    assert parse_churn(spec) is None


@pytest.mark.parametrize("spec, says", [
    ("kill:1", "cannot read 'kill:1'"),
    ("kill:1@3", "cannot read"),
    ("kill:1@t30", "cannot read"),  # seconds need their unit
    ("kill:-1@r3", "cannot read"),
    ("kill:0@r3", "at least 1"),
    ("crash:1@r3", "unknown churn action 'crash'"),
    ("kill:1@r3,", "cannot read ''"),
    ("0/round", "outside"),
    ("1.5/round", "outside"),
    ("25%", "cannot read"),
])
def test_bad_specs_name_the_accepted_forms(spec, says):
    with pytest.raises(ChurnSpecError, match=says) as error:
        parse_churn(spec)
    assert "kill:1@r3,leave:1@r4,join:2@t30s" in str(error.value) or "kill, leave, join" in str(error.value)


def test_slow_linkdown_and_kill_all_parse_with_their_arguments():
    plan = parse_churn("slow:1:3x@r5,linkdown:2:15s@t20s,kill:all@r9,slow:1@r2,linkdown:1:2.5s@r3")
    assert plan.actions == (ChurnAction("slow", 1, round=5, factor=3.0), ChurnAction("linkdown", 2, seconds=20.0, down_s=15.0),
                            ChurnAction("killall", 0, round=9), ChurnAction("slow", 1, round=2, factor=SLOW_FACTOR),
                            ChurnAction("linkdown", 1, round=3, down_s=2.5))
    assert str(plan) == f"slow:1:3x@r5,linkdown:2:15s@t20s,kill:all@r9,slow:1:{SLOW_FACTOR:g}x@r2,linkdown:1:2.5s@r3"
    assert parse_churn(str(plan)) == plan
    assert parse_churn("linkdown:1@r3").actions[0].down_s == DOWN_S
    assert plan.uses == {"slow", "linkdown", "killall"} and parse_churn("0.5/round").uses == {"kill", "join"}


@pytest.mark.parametrize("spec, says", [
    ("slow:1:1x@r5", "above 1"),
    ("slow:1:5s@r5", "slow takes a factor ':Kx'"),
    ("linkdown:1:4x@r3", "linkdown takes a duration ':Ds'"),
    ("linkdown:1:0s@r3", "more than 0 s"),
    ("kill:1:3x@r3", "kill takes no ':' argument"),
    ("leave:all@r3", "only kill takes 'all'"),
    ("slow:0@r3", "at least 1"),
    ("kill:all@r", "cannot read"),
])
def test_bad_arguments_say_what_the_action_takes(spec, says):
    with pytest.raises(ChurnSpecError, match=says):
        parse_churn(spec)


def test_actions_fire_by_round_or_by_time():
    assert not ChurnAction("kill", 1, round=3).due(2, 1e9) and ChurnAction("kill", 1, round=3).due(3, 0)
    assert not ChurnAction("join", 1, seconds=30).due(99, 29.9) and ChurnAction("join", 1, seconds=30).due(0, 30)


def test_swarm_round_is_the_most_advanced_peers_finished_rounds():
    assert swarm_round([]) == 0
    records = [{"type": "round", "round": 0}, {"type": "round", "round": 2}, {"type": "event", "round": 7}]
    assert swarm_round(records) == 3


# ---- seeded victims ---------------------------------------------------------------------------


def test_victims_are_seeded_and_one_peer_is_always_kept():
    live = [f"peer-{i}" for i in range(8)]
    first = [choose_victims(random.Random(7), live, 3) for _ in range(2)]
    assert first[0] == first[1] and len(set(first[0])) == 3 and set(first[0]) <= set(live)
    assert choose_victims(random.Random(7), live, 3) != choose_victims(random.Random(8), live, 3) or \
        choose_victims(random.Random(7), live, 5) != choose_victims(random.Random(8), live, 5)
    assert len(choose_victims(random.Random(0), live[:2], 5)) == 1
    assert choose_victims(random.Random(0), live[:1], 1) == []


@pytest.mark.parametrize("rate, live, count", [(0.25, 4, 1), (0.25, 8, 2), (0.5, 3, 2), (0.01, 4, 1), (1.0, 4, 4)])
def test_rate_count(rate, live, count):
    assert rate_count(rate, live) == count


# ---- the executor on fake processes -----------------------------------------------------------


@dataclass
class FakePopen:
    code: int | None = None
    signals: list = field(default_factory=list)

    def poll(self):
        return self.code

    def send_signal(self, sig):
        self.signals.append(sig)
        self.code = 0


@dataclass
class FakeProcess:
    name: str
    index: int
    start_file: Path | None = None
    popen: FakePopen = field(default_factory=FakePopen)
    killed: bool = False

    def kill_group(self, sig=signal.SIGKILL):
        self.killed = True
        self.popen.code = -9


class FakeSim:
    """What the executor uses of Simulation: start_peer, peer ids, readiness, the run folder."""

    def __init__(self, run_dir: Path, peers: int):
        self.run_dir, self.peers, self.started = run_dir, peers, []
        self.coordinator = FakeProcess("coordinator", None)
        self.links: list[tuple[str, bool]] = []

    def set_link(self, name, up):
        self.links.append((name, up))

    def start_peer(self, index, park=True, start_file=None):
        process = FakeProcess(f"peer-{index}", index, start_file)
        self.started.append(process)
        return process

    @staticmethod
    def peer_ids(records):
        return Simulation.peer_ids(records)

    @staticmethod
    def ready_ids(records):
        return Simulation.ready_ids(records)


def id_records(indices, ready=True):
    out = [{"type": "event", "kind": "start", "peer": f"id{i}", "data_shard": i} for i in indices]
    return out + ([{"type": "event", "kind": "ready", "peer": f"id{i}"} for i in indices] if ready else [])


def rounds_done(n, peer="id0"):
    return [{"type": "round", "round": r, "peer": peer} for r in range(n)]


def holds_state(*indices):
    return [{"type": "event", "kind": "state_received", "peer": f"id{i}"} for i in indices]


def churn_events(run_dir):
    return [r for r in read_records(run_dir / "launcher") if r.get("by") == "churn"]


def test_schedule_executor_kills_leaves_and_releases_parked_joiners(tmp_path):
    sim = FakeSim(tmp_path, 3)
    clock = [0.0]
    executor = ChurnExecutor(parse_churn("kill:1@r2,join:1@r3,leave:1@r4,join:1@t50s"), sim, seed=0,
                             total_rounds=8, clock=lambda: clock[0])
    spares = executor.start_spares()
    assert [p.index for p in spares] == [3, 4] and all(p.start_file == tmp_path / f"start-{p.index}" for p in spares)
    peers = [FakeProcess(f"peer-{i}", i) for i in range(3)]
    running = list(peers)
    executor.begin(running)
    ids = id_records(range(5))
    executor.poll(ids + rounds_done(1))
    assert not any(p.killed for p in peers) and len(running) == 3
    executor.poll(ids + rounds_done(2))
    [victim] = [p for p in peers if p.killed]
    assert victim.name == choose_victims(random.Random(0), ["peer-0", "peer-1", "peer-2"], 1)[0]
    executor.poll(ids + rounds_done(3))
    assert running[-1].index == 3 and (tmp_path / "start-3").exists() and not (tmp_path / "start-4").exists()
    executor.poll(ids + rounds_done(4))
    leavers = [p for p in running if p.popen.signals]
    assert len(leavers) == 1 and leavers[0].popen.signals == [signal.SIGTERM] and not leavers[0].killed
    clock[0] = 50.0
    executor.poll(ids + rounds_done(5))
    assert running[-1].index == 4
    executor.close(ids + rounds_done(8))
    events = churn_events(tmp_path)
    assert [(e["kind"], e["round"]) for e in events] == [("kill", 2), ("join", 3), ("leave", 4), ("join", 5)]
    assert events[0]["peer"] == f"id{victim.index}" and events[1]["peer"] == "id3" and events[1]["due_round"] == 3
    assert executor.summary() == {"spec": "kill:1@r2,join:1@r3,leave:1@r4,join:1@t50s", "killed": [victim.name],
                                  "left": [leavers[0].name], "joined": ["peer-3", "peer-4"], "slowed": []}


def test_same_seed_same_victims(tmp_path):
    def victims(seed, folder):
        sim = FakeSim(folder, 6)
        executor = ChurnExecutor(parse_churn("kill:2@r1,leave:1@r2"), sim, seed=seed, total_rounds=10)
        peers = [FakeProcess(f"peer-{i}", i) for i in range(6)]
        executor.begin(list(peers))
        for n in (1, 2):
            executor.poll(id_records(range(6)) + rounds_done(n))
        return [(e["kind"], e["name"]) for e in churn_events(folder)]
    assert victims(3, tmp_path / "a") == victims(3, tmp_path / "b")
    assert len(victims(3, tmp_path / "c")) == 3


def test_joins_too_late_to_enter_a_round_and_unfired_actions_are_skipped(tmp_path):
    sim = FakeSim(tmp_path, 2)
    executor = ChurnExecutor(parse_churn("join:1@r3,kill:1@r9"), sim, seed=0, total_rounds=4)
    spare = executor.start_spares()[0]
    executor.begin([FakeProcess("peer-0", 0), FakeProcess("peer-1", 1)])
    executor.poll(id_records(range(3)) + rounds_done(3))  # round 3 is the last: nobody can enter after it
    executor.close(id_records(range(3)) + rounds_done(4))
    events = churn_events(tmp_path)
    assert [(e["kind"], e["action"]) for e in events] == [("skip", "join"), ("skip", "kill")]
    assert spare.killed and not (tmp_path / "start-2").exists()


def test_joiners_are_not_victims_before_they_hold_state_and_joins_wait_for_a_ready_joiner(tmp_path):
    sim = FakeSim(tmp_path, 2)
    executor = ChurnExecutor(parse_churn("join:1@r1,kill:1@r2,kill:1@r3"), sim, seed=0, total_rounds=10)
    executor.start_spares()
    executor.begin([FakeProcess("peer-0", 0), FakeProcess("peer-1", 1)])
    executor.poll(id_records(range(2)) + id_records([2], ready=False) + rounds_done(1))
    assert churn_events(tmp_path) == []  # the joiner is still starting: the join is owed
    executor.poll(id_records(range(3)) + rounds_done(2))  # now parked and ready: released; one first peer killed
    executor.poll(id_records(range(3)) + rounds_done(3))  # the joiner holds no state yet: the last first peer stays
    kinds = [(e["kind"], e.get("name"), e["round"]) for e in churn_events(tmp_path)]
    assert kinds[0][::2] == ("kill", 2) and kinds[0][1] in ("peer-0", "peer-1")
    assert kinds[1] == ("join", "peer-2", 2) and kinds[2][0] == "skip" and len(kinds) == 3
    executor.pending.append(ChurnAction("kill", 1, round=4))
    executor.poll(id_records(range(3)) + holds_state(2) + rounds_done(4))
    assert churn_events(tmp_path)[-1]["kind"] == "kill"


def test_rate_replaces_that_fraction_each_round_and_keeps_the_pool_full(tmp_path):
    sim = FakeSim(tmp_path, 4)
    executor = ChurnExecutor(parse_churn("0.25/round"), sim, seed=0, total_rounds=6)
    assert len(executor.start_spares()) == 2
    running = [FakeProcess(f"peer-{i}", i) for i in range(4)]
    executor.begin(running)
    for n in range(0, 7):
        records = id_records(range(12)) + holds_state(*range(12)) + rounds_done(n)
        executor.poll(records)
        executor.poll(records)  # a second look at the same round does nothing
        assert len(executor.spares) == 2
    events = churn_events(tmp_path)
    # rounds 1..4 can still be entered by a joiner (round 5 is the last)
    assert [(e["kind"], e["round"]) for e in events] == [(k, r) for r in range(1, 5) for k in ("kill", "join")]
    assert sum(p.popen.poll() is None for p in running) == 4


def test_ddp_rate_fires_once_per_membership_epoch(tmp_path):
    executor = ChurnExecutor(parse_churn("0.5/round"), FakeSim(tmp_path, 2), seed=0, total_rounds=40,
                             epoch_rounds=10)
    executor.start_spares()
    executor.begin([FakeProcess("peer-0", 0), FakeProcess("peer-1", 1)])
    for n in range(41):
        executor.poll(id_records(range(8)) + holds_state(*range(8)) + rounds_done(n))
    assert [e["round"] for e in churn_events(tmp_path) if e["kind"] == "kill"] == [10, 20]


def test_slow_peers_are_told_through_their_file_and_links_come_back_up_on_time(tmp_path):
    sim, clock = FakeSim(tmp_path, 4), [0.0]
    executor = ChurnExecutor(parse_churn("slow:1:3x@r1,linkdown:2:10s@r2,slow:1@r3"), sim, seed=0, total_rounds=10,
                             clock=lambda: clock[0])
    peers = [FakeProcess(f"peer-{i}", i) for i in range(4)]
    executor.begin(list(peers))
    ids = id_records(range(4))
    executor.poll(ids + rounds_done(1))
    [slow] = [e for e in churn_events(tmp_path) if e["kind"] == "slow"]
    assert slow["factor"] == 3.0 and (tmp_path / f"slowdown-{slow['name'][5:]}").read_text() == "3\n"
    clock[0] = 5.0
    executor.poll(ids + rounds_done(2))
    down = [name for name, up in sim.links if not up]
    assert len(down) == 2 and len(set(down)) == 2 and not any(p.killed for p in peers)  # they stay members
    clock[0] = 14.9
    executor.poll(ids + rounds_done(3))  # the second slow action picks a peer not slowed yet
    assert len(sim.links) == 2 and len({e["name"] for e in churn_events(tmp_path) if e["kind"] == "slow"}) == 2
    clock[0] = 15.0
    executor.poll(ids + rounds_done(3))
    assert sorted(sim.links[2:]) == sorted((name, True) for name in down)
    kinds = [e["kind"] for e in churn_events(tmp_path)]
    assert kinds == ["slow", "linkdown", "linkdown", "slow", "linkup", "linkup"]
    assert executor.summary()["slowed"] == sorted(e["name"] for e in churn_events(tmp_path) if e["kind"] == "slow")


def test_kill_all_kills_every_group_and_the_coordinator_then_nothing_more(tmp_path):
    sim = FakeSim(tmp_path, 3)
    executor = ChurnExecutor(parse_churn("join:1@r5,kill:all@r2,kill:1@r3"), sim, seed=0, total_rounds=10)
    [spare] = executor.start_spares()
    peers = [FakeProcess(f"peer-{i}", i) for i in range(3)]
    executor.begin(list(peers))
    executor.poll(id_records(range(4)) + rounds_done(2))
    assert all(p.killed for p in peers) and spare.killed and sim.coordinator.killed
    executor.poll(id_records(range(4)) + rounds_done(3))
    assert len(sim.started) == 1  # no new joiner is started after it
    executor.close(id_records(range(4)) + rounds_done(3))
    events = churn_events(tmp_path)
    assert [e["name"] for e in events if e["kind"] == "kill"] == ["peer-0", "peer-1", "peer-2", "peer-3", "coordinator"]
    assert [e["at"] for e in events if e["kind"] == "skip"] == ["join:1@r5", "kill:1@r3"]
    assert executor.summary()["killed"] == ["peer-0", "peer-1", "peer-2", "peer-3"]


def test_linkdown_needs_namespace_mode(capsys):
    from lowcomm.cli import main
    sim = Simulation(default_config(), 2, Path("/nonexistent"), churn=parse_churn("linkdown:1@r2"), netns=False)
    with pytest.raises(ConfigError, match="--netns"):
        sim.churn_plan()
    assert main(["simulate", "--churn", "linkdown:1@r2", "--report", "/nonexistent/r.json"]) == 2
    assert "namespace mode only: add --netns" in capsys.readouterr().err


# ---- config and flags -------------------------------------------------------------------------


def test_churn_lives_in_the_config_outside_its_hash(tmp_path):
    config = default_config().override({"churn.spec": "0.25/round"})
    assert config.churn.spec == "0.25/round" and config.config_hash() == default_config().config_hash()
    path = tmp_path / "run.toml"
    path.write_text('[churn]\nspec = "kill:1@r3"\n')
    assert load_config(path).churn.spec == "kill:1@r3"
    path.write_text('[churn]\nspec = "kill:1@3"\n')
    with pytest.raises(ConfigError, match="churn.spec"):
        load_config(path)


def test_simulate_refuses_a_bad_churn_flag(capsys):
    from lowcomm.cli import main
    assert main(["simulate", "--churn", "kill:one@r2", "--report", "/nonexistent/r.json"]) == 2
    assert "churn.spec" in capsys.readouterr().err
