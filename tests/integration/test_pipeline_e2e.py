"""Pipelines end to end: real peer processes serving stages on localhost, whole stages killed.

3 stages × 2 peers with both peers of stage 1 killed → a peer moves there and rebuilds it by
CheckFree from stages 0 and 2, and training goes on; 4 stages with stage 0 killed → CheckFree+
copies stage 1's blocks and its replica of the embedding; an overloaded stage receives a peer at
the `rebalance@N` hook. Assertions are on events, round records and losses, never on durations.
"""

from __future__ import annotations

import pytest
from children import events

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation



def pipeline_config(stages: int, steps: int, churn: str = "", **extra):
    return default_config().override({
        "run.steps": steps, "model.d_model": 32, "model.n_heads": 2, "model.n_layers": stages,
        "model.context": 32, "inner.batch_size": 8, "inner.warmup_steps": 10, "data.eval_batches": 4,
        "pipeline.stages": stages, "pipeline.round_s": 6.0, "pipeline.rebalance_every_rounds": 0,
        "pipeline.stage_wait_s": 240.0, "sync.announce_s": 1.0, "sync.manifest_s": 3.0,
        "sync.reduce_timeout_s": 8.0, "checkpoint.every_rounds": 0, "churn.spec": churn, **extra})


def simulate(tmp_path_factory, name: str, config, peers: int, **kwargs) -> dict:
    run_dir = tmp_path_factory.mktemp(name) / "run"
    sim = Simulation(config, peers, run_dir, progress=False, timeout_s=900, **kwargs)
    report = sim.run()  # raises if any process group outlived the run
    return {"report": report, "records": sim.records()}


STEPS = 400  # microbatches per driver: no driver is done before the kill after the first round, and over half
# of them come after the rebuild, for the held-out loss to fall from it


def loss_after_rebuild(report: dict) -> tuple[float, float]:
    """(the first held-out loss scored after the rebuild, the final one): training went on from it."""
    rebuilt = min(e["t"] for e in report["events"] if e["kind"] == "recover")
    after = [e["loss"] for e in report["evals"] if e["t"] > rebuilt]
    return after[0], report["final_loss"]


@pytest.fixture(scope="module")
def middle_stage_lost(tmp_path_factory):
    return simulate(tmp_path_factory, "checkfree", pipeline_config(3, STEPS, "killstage:1@r1"), peers=6)


@pytest.fixture(scope="module")
def first_stage_lost(tmp_path_factory):
    return simulate(tmp_path_factory, "checkfree-plus", pipeline_config(4, STEPS, "killstage:0@r1"), peers=6)


def test_a_lost_middle_stage_is_rebuilt_from_its_neighbours(middle_stage_lost):
    report, records = middle_stage_lost["report"], middle_stage_lost["records"]
    kills = [e for e in report["events"] if e["kind"] == "kill"]
    assert len(kills) == 2 and {e["stage"] for e in kills} == {1}
    recovered = events(records, "recover")
    assert len(recovered) == 1, recovered
    assert recovered[0]["stage"] == 1 and recovered[0]["method"] == "checkfree"
    assert set(recovered[0]["norms"]) == {"0", "2"}  # weighted by both neighbours' gradient norms
    moved = events(records, "rebalance")
    assert [e["stage"] for e in moved] == [1] and moved[0]["reason"] == "empty stage"
    # stage 1 syncs again after the rebuild, and every stage's replicas hold one φ per round
    kill_t = min(e["t"] for e in kills)
    assert any(r.get("stage") == 1 and r["t"] > kill_t for r in report["rounds"])
    assert all(len(r["phi_hashes"]) == 1 for r in report["rounds"])
    rebuilt, final = loss_after_rebuild(report)
    assert final < rebuilt, f"held-out loss {rebuilt:.4f} after the rebuild, {final:.4f} at the end"
    assert report["failed_peers"] == []


def test_a_lost_first_stage_is_copied_from_its_neighbour(first_stage_lost):
    report, records = first_stage_lost["report"], first_stage_lost["records"]
    recovered = events(records, "recover")
    assert len(recovered) == 1 and recovered[0]["stage"] == 0 and recovered[0]["method"] == "checkfree+"
    rebuilt, final = loss_after_rebuild(report)
    assert final < rebuilt, f"held-out loss {rebuilt:.4f} after the rebuild, {final:.4f} at the end"
    assert report["failed_peers"] == []


def test_an_overloaded_stage_receives_a_peer(tmp_path_factory):
    """Stage 1's only peer computes 4x slower; at the hook the planned mover of stage 0 moves there."""
    config = pipeline_config(2, STEPS // 2)
    run = simulate(tmp_path_factory, "rebalance", config, peers=3, stage_of={0: 0, 1: 0, 2: 1},
                   slowdowns={2: 4.0}, peer_faults={0: "rebalance@2", 1: "rebalance@2", 2: "rebalance@2"})
    moved = events(run["records"], "rebalance")
    assert len(moved) == 1, moved
    assert moved[0]["previous"] == 0 and moved[0]["stage"] == 1 and moved[0]["reason"] == "hook"
    throughputs = moved[0]["throughputs"]
    assert throughputs["1"] < throughputs["0"] / 2  # it moved because stage 1 was the bottleneck
    joined = [e for e in events(run["records"], "stage") if e["how"] == "move"]
    assert joined and joined[0]["peer"] == moved[0]["peer"]
    received = events(run["records"], "state_received")  # parameters and optimizer state from stage 1's replica
    assert received and received[0]["stage"] == 1 and received[0]["peer"] == moved[0]["peer"]
    assert run["report"]["failed_peers"] == []


def test_the_restart_baseline_rolls_every_stage_back_to_one_checkpoint(tmp_path_factory):
    """recovery = "checkpoint": the lost stage comes back from the newest round all stages checkpointed,
    and every other replica loads its own stage's checkpoint of that round at the same round boundary."""
    config = pipeline_config(3, STEPS, "killstage:1@r2", **{"pipeline.recovery": "checkpoint",
                                                          "pipeline.checkpoint_every_rounds": 1})
    run = simulate(tmp_path_factory, "restart", config, peers=6)
    recovered = events(run["records"], "recover")
    assert len(recovered) == 1 and recovered[0]["method"] == "checkpoint" and recovered[0]["stage"] == 1
    rollbacks = events(run["records"], "rollback")
    survivors = {e["peer"] for e in events(run["records"], "exit")} - {recovered[0]["peer"]}
    assert {e["peer"] for e in rollbacks} == survivors  # every other peer went back ...
    assert {(e["round"], e["at"]) for e in rollbacks} == {(recovered[0]["round"], recovered[0]["rollback_at"])}
    assert not any(e["late"] for e in rollbacks)  # ... at the same boundary
    assert all(len(r["phi_hashes"]) == 1 for r in run["report"]["rounds"])
    assert run["report"]["failed_peers"] == []


def test_sparseloco_syncs_the_replicas_of_each_stage(tmp_path_factory):
    config = pipeline_config(2, STEPS // 2, **{"run.algo": "sparseloco"})
    run = simulate(tmp_path_factory, "sparseloco", config, peers=4)
    report = run["report"]
    assert {r["stage"] for r in report["rounds"]} == {0, 1}
    for row in report["rounds"]:
        assert len(row["contributors"]) == 2 and len(row["phi_hashes"]) == 1, row
    assert report["final_loss"] < report["evals"][0]["loss"]
    assert report["failed_peers"] == []
