"""Churn with real processes: one simulate run with a kill, a joiner and a graceful leave. Assertions
are on records and events, never on durations; every wait has a deadline."""

from __future__ import annotations

import random
import signal

import pytest

from lowcomm.config import default_config
from lowcomm.runtime.churn import choose_victims
from lowcomm.runtime.sim import Simulation

# ---- real processes ---------------------------------------------------------------------------

H, ROUNDS, SPEC = 5, 8, "kill:1@r2,join:1@r3,leave:1@r5"


@pytest.mark.timeout(400)
def test_simulate_with_a_kill_a_joiner_and_a_leave(tmp_path):
    config = default_config().override({
        "run.steps": H * ROUNDS, "diloco.inner_steps": H, "data.eval_every_tokens": 1 << 40,
        "data.eval_batches": 4, "sync.reduce_timeout_s": 8.0, "sync.announce_s": 3.0, "sync.manifest_s": 3.0,
        "checkpoint.every_rounds": 0, "churn.spec": SPEC})
    sim = Simulation(config, 3, tmp_path / "run", progress=False, timeout_s=300)
    report = sim.run()  # raises if any process group outlived the run
    records = sim.records()

    assert report["failed_peers"] == []
    churn = [e for e in report["events"] if e.get("by") == "churn"]
    assert [e["kind"] for e in churn] == ["kill", "join", "leave"]
    kill, join, leave = churn
    assert kill["round"] >= 2 and join["round"] >= 3 and join["due_round"] >= 3 and leave["round"] >= 5
    assert all(e["peer"] for e in churn) and len({kill["peer"], join["peer"], leave["peer"]}) == 3
    # the same seed names the same victims: peer-0..2 in index order, then the joiner appended
    rng = random.Random(config.run.seed)
    expected_kill = choose_victims(rng, ["peer-0", "peer-1", "peer-2"], 1)[0]
    assert kill["name"] == expected_kill
    survivors = [n for n in ("peer-0", "peer-1", "peer-2") if n != expected_kill]
    assert leave["name"] == choose_victims(rng, survivors + ["peer-3"], 1)[0]
    assert report["churn"] == {"spec": SPEC, "killed": [kill["name"]], "left": [leave["name"]], "joined": ["peer-3"],
                              "slowed": []}
    assert any(e["kind"] == "timeout" for e in report["events"])  # the swarm went on without the dead peer

    rows = {row["round"]: row for row in report["rounds"]}
    assert sorted(rows) == list(range(ROUNDS))
    assert all(kill["peer"] not in row["contributors"] for r, row in rows.items() if r >= kill["round"])
    assert all(leave["peer"] not in row["contributors"] for r, row in rows.items() if r >= leave["round"])
    # the joiner enters at the round of the state it downloaded (the next boundary it saw), not before
    received = min((r for r in records if r["type"] == "event" and r.get("kind") == "state_received"
                    and r["peer"] == join["peer"]), key=lambda r: r["t"])
    assert received["round"] >= join["round"]
    joined = [r for r, row in rows.items() if join["peer"] in row["contributors"]]
    assert joined and min(joined) >= received["round"]
    if leave["peer"] != join["peer"]:
        assert joined == list(range(min(joined), ROUNDS))
    for row in rows.values():  # everyone who applied a round holds the same φ
        assert len(row["phi_hashes"]) == 1
    done = {r["peer"] for r in records if r["type"] == "event" and r.get("kind") == "done"}
    assert set(rows[ROUNDS - 1]["contributors"]) <= done and leave["peer"] not in done
    assert join["peer"] in done or join["peer"] == leave["peer"]
    assert report["final_loss"] is not None
    killed = next(p for p in sim.processes if p.name == kill["name"])
    assert killed.popen.returncode == -signal.SIGKILL and not killed.group_alive()
    assert sim.stop_all() == []
