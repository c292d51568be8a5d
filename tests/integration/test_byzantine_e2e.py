"""A Byzantine member end to end: `lowcomm simulate --byzantine scale:1` with 4 peers of a tiny DiLoCo
run. The run finishes, the honest peers' final loss is finite, and the Byzantine peer's parts were
tampered every round (its `byzantine` events). Assertions are on the report and the records; the
launcher runs in its own process group and every wait has a deadline."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.runtime.runlog import read_records

from children import events

REPO = Path(__file__).resolve().parents[2]
PEERS, H, ROUNDS = 4, 3, 3
CONFIG = f"""
[run]
steps = {H * ROUNDS}
[model]
d_model = 32
n_layers = 1
n_heads = 2
context = 32
[data]
eval_batches = 2
eval_every_tokens = 1000000000
[inner]
batch_size = 4
warmup_steps = 0
[diloco]
inner_steps = {H}
[sync]
announce_s = 2.0
manifest_s = 3.0
reduce_timeout_s = 8.0
[checkpoint]
every_rounds = 0
"""


def simulate(tmp_path: Path, *flags: str, timeout: float) -> tuple[int, str]:
    """`lowcomm simulate` in its own process group; on a timeout the launcher is sent SIGTERM (it then
    kills its peers' groups), and SIGKILL if it does not exit."""
    launcher = subprocess.Popen([sys.executable, "-m", "lowcomm.cli", "simulate", *flags], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    return launcher.returncode, output


@pytest.mark.timeout(240)
def test_a_scaling_byzantine_member_is_named_tampers_every_round_and_the_honest_loss_stays_finite(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    report_path, run_dir = tmp_path / "report.json", tmp_path / "run"
    rc, output = simulate(tmp_path, "--config", str(config), "--peers", str(PEERS), "--byzantine", "scale:1",
                          "--report", str(report_path), "--run-dir", str(run_dir), timeout=180)
    assert rc == 0, output[-3000:]
    assert f"Byzantine peer-{PEERS - 1} (scale)" in output

    report = json.loads(report_path.read_text())
    assert report["failed_peers"] == []
    (liar,) = report["byzantine"]
    assert liar["kind"] == "scale" and liar["index"] == PEERS - 1
    assert report["final_loss"] is not None and math.isfinite(report["final_loss"])
    assert report["final_loss_honest"] == report["final_loss"]
    assert len(report["rounds"]) == ROUNDS

    records = read_records(run_dir / "peers")
    tampered = events(records, "byzantine")
    assert {e["peer"] for e in tampered} == {liar["peer"]}
    assert sorted(e["round"] for e in tampered) == list(range(ROUNDS))
    for e in tampered:
        assert e["byzantine"] == "scale" and e["sent_weight"] == e["weight"]
        assert math.isclose(e["sent_norm"], e["norm"] * 1e6, rel_tol=1e-4)
    honest = {r["peer"] for r in records if r["type"] == "eval" and r.get("final")} - {liar["peer"]}
    assert len(honest) == PEERS - 1  # every honest peer finished and scored the final model
