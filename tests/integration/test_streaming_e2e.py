"""Streaming DiLoCo end to end: 4 real peer processes on localhost and a joiner, fragment rounds
reduced in the background and applied τ steps later, every peer on the same φ after every round.
Assertions are on records (rounds, contributors, hashes, events), never on durations."""

from __future__ import annotations

from pathlib import Path

import pytest
from children import events

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

PEERS, H, P, TAU, STEPS, JOIN_ROUND = 4, 10, 2, 2, 60, 4
ROUNDS = STEPS // H * P  # fragment rounds start at 5, 10, …, 60


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions ``text`` (the run's folder)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue  # gone meanwhile
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("streaming") / "run"
    config = default_config().override({
        "run.algo": "streaming-diloco", "run.steps": STEPS, "diloco.inner_steps": H,
        "streaming.fragments": P, "streaming.fragment_sync_delay": TAU,
        "data.eval_every_tokens": PEERS * 16 * 64 * 10, "data.eval_batches": 8, "checkpoint.every_rounds": 0,
        "sync.reduce_timeout_s": 8.0, "sync.announce_s": 3.0, "sync.manifest_s": 3.0,
        "churn.spec": f"join:1@r{JOIN_ROUND}"})
    sim = Simulation(config, PEERS, run_dir, progress=False, timeout_s=500)
    report = sim.run()  # raises if any process group outlived the run
    return {"report": report, "records": sim.records(), "run_dir": run_dir}



def test_every_fragment_round_has_all_its_members_and_one_phi(run):
    report = run["report"]
    assert report["failed_peers"] == []
    rows = report["rounds"]
    assert [r["round"] for r in rows] == list(range(ROUNDS))
    assert [r["fragment"] for r in rows] == [(n + 1) % P for n in range(ROUNDS)]  # fragment 1 first, then 0, …
    founders = {r["peer"] for r in events(run["records"], "start") if r.get("data_shard") in range(PEERS)}
    assert len(founders) == PEERS
    for row in rows:
        assert founders <= set(row["participants"]), f"round {row['round']} lost a founding peer"
        assert sorted(row["contributors"]) == sorted(row["participants"]), f"round {row['round']} missed one"
        assert len(row["phi_hashes"]) == 1, f"round {row['round']}: replicas hold different φ"
    assert not events(run["records"], "resync")
    finals = [r for r in run["records"] if r["type"] == "eval" and r.get("final")]
    assert len(finals) == PEERS + 1 and len({r["phi_hash"] for r in finals}) == 1
    assert finals[0]["phi_hash"] == rows[-1]["phi_hashes"][0]  # the final model is the last round's φ


def test_held_out_loss_of_the_global_model_falls(run):
    evals = run["report"]["evals"]
    assert len(evals) >= 2
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.3


def entry_round(records: list[dict]) -> int:
    """The round the joiner entered: that of the state it downloaded."""
    joiner = next(r["peer"] for r in events(records, "start") if r.get("data_shard") == PEERS)
    received = events(records, "state_received", joiner)
    assert received, "the joiner never received state"
    return received[0]["round"]


def test_a_fragment_round_moves_about_one_fragment(run):
    report = run["report"]
    # a source serves the state of round r only once it has landed round r − 1, so no state download
    # counts in the rounds before the joiner's entry
    before_join = [row for row in report["rounds"] if row["round"] < entry_round(run["records"])]
    assert before_join
    for row in before_join:
        n = len(row["participants"])
        # a DiLoCo uint8 round costs the peers 2(n − 1) bytes per parameter in all; a fragment about 1/P of it
        assert row["bytes"] < 1.3 / P * 2 * (n - 1) * report["model_params"]


def test_joiner_enters_at_a_round_boundary_and_contributes(run):
    records, report = run["records"], run["report"]
    joiner = next(r["peer"] for r in events(records, "start") if r.get("data_shard") == PEERS)
    received = events(records, "state_received", joiner)
    entry = entry_round(records)
    # released once the most advanced peer has landed round JOIN_ROUND − 1, the joiner picks its round from
    # the peer records, which carry a peer's round at its heartbeat: it may enter a round or two earlier
    assert entry >= 1  # mid-run, from a downloaded state, not the seeded φ_0
    by_round = {row["round"]: row for row in report["rounds"]}
    assert received[0]["phi_hash"] == by_round[entry - 1]["phi_hashes"][0]  # φ after the last applied round
    joined = [n for n, row in by_round.items() if joiner in row["contributors"]]
    assert joined and min(joined) >= entry and joined[-1] == ROUNDS - 1
    assert events(records, "done", joiner)


def test_no_process_of_the_run_is_left(run):
    assert processes_mentioning(str(run["run_dir"])) == []
