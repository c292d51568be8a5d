"""SparseLoCo end to end: real peer processes on localhost, payloads forwarded by shard owners."""

from __future__ import annotations

import pytest

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

pytestmark = pytest.mark.integration
H, ROUNDS, PEERS = 5, 8, 3


def test_sparseloco_peers_agree_every_round_and_the_loss_falls(tmp_path):
    config = default_config().override({
        "run.algo": "sparseloco", "run.steps": H * ROUNDS, "sparseloco.inner_steps": H,
        "data.eval_every_tokens": PEERS * H * 16 * 64 * 2, "sync.reduce_timeout_s": 8.0,
        "sync.announce_s": 3.0, "sync.manifest_s": 3.0})
    report = Simulation(config, PEERS, tmp_path / "run", progress=False).run()
    assert not report.get("failed_peers")
    records = report["rounds"]
    assert [r["round"] for r in records] == list(range(ROUNDS))
    for r in records:
        assert r["contributors"], f"round {r['round']} had no contributor"
        assert len(r["phi_hashes"]) == 1, f"round {r['round']}: replicas hold different φ"
    evals = report["evals"]
    assert len(evals) >= 2 and evals[-1]["loss"] < evals[0]["loss"] - 0.3
    # One φ per round across peers (the drift check would have resynced a diverging peer).
    assert not [e for e in report["events"] if e["kind"] == "resync" and "disagrees" in e.get("reason", "")]
    # Sparse payloads: far fewer bytes than one dense fp32 copy of the model per peer and round.
    dense = 4 * report["model_params"]
    for r in records:
        assert r["bytes"] < len(r["participants"]) * dense / 10
