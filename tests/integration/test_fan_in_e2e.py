"""A bound G on a round's fan-in (sync.max_contributors) in a run of real peers: every round takes G
contributions and every member applies the same aggregate (the rule's unit cases: tests/unit/test_fan_in.py)."""

from __future__ import annotations

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation


def test_rounds_take_g_contributions_and_every_member_applies_the_same_aggregate(tmp_path):
    steps, h = 12, 3
    config = default_config().override({
        "run.steps": steps, "diloco.inner_steps": h, "sync.max_contributors": 2, "sync.reduce_timeout_s": 8.0,
        "sync.announce_s": 3.0, "sync.manifest_s": 3.0, "data.eval_every_tokens": 10 ** 9})
    report = Simulation(config, 3, tmp_path / "run", progress=False).run()
    assert not report["failed_peers"]
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(steps // h))
    for r in rounds:
        assert len(r["participants"]) == 3 and len(r["contributors"]) == 2, r
        assert len(r["phi_hashes"]) == 1
    assert not [e for e in report["events"] if e["kind"] == "resync"]
