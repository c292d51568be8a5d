"""Report figures and summary: files beside the JSON, valid PNGs, the markdown's figures computed
from the report, and empty reports that still get their files."""

from __future__ import annotations

import json
from pathlib import Path

from lowcomm.runtime.plots import compare_reports, write_report_figures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_report(**overrides) -> dict:
    members = ["a", "b", "c"]
    rounds = [{"round": i, "t": 2.0 * i, "tokens": 1000, "bytes": 3_000_000, "sync_s": 0.5 + 0.1 * i,
               "link_bound_s": 0.4, "participants": members if i != 2 else members[:2],
               "contributors": members if i != 2 else members[:2], "phi_hashes": ["x"]} for i in range(5)]
    evals = [{"t": 2.0 * i + 1, "step": 10 * i, "tokens": 3000 * i, "bytes": 3_000_000 * i, "loss": 5.0 - 0.5 * i}
             for i in range(1, 5)]
    events = ([{"t": -1.0, "kind": "start", "peer": p} for p in members]
              + [{"t": 4.5, "kind": "kill", "peer": "c", "by": "churn", "round": 2},
                 {"t": 5.0, "kind": "timeout", "peer": "a", "round": 2},
                 {"t": 6.1, "kind": "join", "peer": "d", "by": "churn"},
                 {"t": 6.5, "kind": "resync", "peer": "d", "round": 3},
                 {"t": 7.0, "kind": "leave", "peer": "b", "by": "churn", "round": 3},
                 {"t": 7.1, "kind": "leave", "peer": "b", "signal": "SIGTERM"}])
    report = {"algo": "diloco", "peers": 3, "stages": 1, "seed": 7, "model_params": 867072, "tokens": 15000,
              "final_loss": 2.91234, "final_loss_spread": 0.0125, "bytes_sent": 15_123_456, "control_bytes": None,
              "checkpoint_bytes": 0, "wall_s": 10.5, "startup_s": 3.0, "compute_s": 20.0,
              "links": {"a": "10mbit", "b": None, "c": "10mbit"}, "rounds": rounds, "evals": evals, "events": events,
              "churn": {"spec": "kill:1@r2,join:1@t6s,leave:1@r3", "killed": ["peer-2"], "left": ["peer-1"],
                        "joined": ["peer-3"]},
              "failed_peers": [], "config_hash": "abc123"}
    report["bytes_per_token"] = report["bytes_sent"] / report["tokens"]
    report["compute_utilization"] = report["compute_s"] / (report["peers"] * report["wall_s"])
    report.update(overrides)
    return report


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert len(data) > 1000, path


def test_figures_and_summary_are_written_beside_the_report(tmp_path):
    report = synthetic_report()
    json_path = tmp_path / "diloco-5-p3-s7.json"
    json_path.write_text(json.dumps(report))
    paths = write_report_figures(report, json_path)
    assert [p.name for p in paths] == ["diloco-5-p3-s7.loss.png", "diloco-5-p3-s7.sync.png", "diloco-5-p3-s7.md"]
    assert all(p.parent == tmp_path for p in paths)
    assert_png(paths[0])
    assert_png(paths[1])

    summary = paths[2].read_text()
    assert f"{report['final_loss']:.4f}" in summary
    assert f"spread {report['final_loss_spread']:.4f}" in summary
    assert f"{report['bytes_sent'] / report['tokens']:,.1f}" in summary  # bytes per token
    assert f"{report['bytes_sent']:,} B" in summary
    assert "| rounds | 5 |" in summary
    assert "median 0.700 s" in summary  # sync_s 0.5..0.9
    assert "| kill | 1 | 1 |" in summary
    assert "| leave | 2 | 1 |" in summary  # the launcher's and the peer's own record
    assert "| join | 1 | 1 |" in summary
    assert "| timeout | 1 | 0 |" in summary
    assert "| resync | 1 | 0 |" in summary
    assert "| reject | 0 | 0 |" in summary
    assert "Other events: start 3" in summary
    assert "| b | unshaped |" in summary and "| a | 10mbit |" in summary
    assert "killed: peer-2" in summary and "joined: peer-3" in summary
    assert "control-plane" not in summary  # control_bytes is null
    assert "![diloco-5-p3-s7.loss.png](diloco-5-p3-s7.loss.png)" in summary
    assert "![diloco-5-p3-s7.sync.png](diloco-5-p3-s7.sync.png)" in summary


def test_control_bytes_are_shown_when_measured(tmp_path):
    paths = write_report_figures(synthetic_report(control_bytes=2_500_000), tmp_path / "r.json")
    assert "| control-plane bytes | 2.50 MB |" in paths[2].read_text()


def test_a_report_without_evals_or_rounds_still_gets_its_files(tmp_path):
    report = synthetic_report(rounds=[], evals=[], events=[], final_loss=None, final_loss_spread=None,
                              tokens=0, bytes_sent=0, bytes_per_token=None, wall_s=0.0,
                              compute_utilization=None, links={}, churn=None)
    paths = write_report_figures(report, tmp_path / "empty.json")
    assert_png(paths[0])
    assert_png(paths[1])
    summary = paths[2].read_text()
    assert "| final held-out loss | n/a |" in summary
    assert "| bytes per token | n/a |" in summary
    assert "| rounds | 0 |" in summary
    assert "| kill | 0 | 0 |" in summary


def test_a_minimal_report_with_missing_fields_does_not_raise(tmp_path):
    paths = write_report_figures({"algo": "ddp", "peers": 1, "seed": 0}, tmp_path / "bare.json")
    assert all(p.exists() for p in paths)


def test_compare_reports_draws_several_runs_on_one_figure(tmp_path):
    low = synthetic_report()
    high = synthetic_report(algo="ddp", bytes_sent=3_000_000_000,
                            evals=[{**e, "bytes": e["bytes"] * 200} for e in low["evals"]])
    out = compare_reports({"diloco": low, "ddp": high}, tmp_path / "plots" / "compare.png", title="two runs")
    assert out == tmp_path / "plots" / "compare.png"
    assert_png(out)


# ---- simulate writes them beside its report -------------------------------------------------------


def test_simulate_writes_the_figures_beside_its_report(tmp_path, monkeypatch, capsys):
    from lowcomm import cli
    from lowcomm.runtime.sim import Simulation

    monkeypatch.setattr(Simulation, "run", lambda self: synthetic_report())
    assert cli.main(["simulate", "--peers", "3", "--report", str(tmp_path / "r.json")]) == 0
    assert {p.name for p in tmp_path.iterdir()} >= {"r.json", "r.loss.png", "r.sync.png", "r.md"}
    assert "figures and summary:" in capsys.readouterr().out


def test_a_plotting_failure_does_not_fail_simulate(tmp_path, monkeypatch, caplog):
    from lowcomm import cli
    from lowcomm.runtime import plots
    from lowcomm.runtime.sim import Simulation

    def broken(report, json_path):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(Simulation, "run", lambda self: synthetic_report())
    monkeypatch.setattr(plots, "write_report_figures", broken)
    assert cli.main(["simulate", "--peers", "3", "--report", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.json").exists()
    assert "no fonts" in caplog.text
