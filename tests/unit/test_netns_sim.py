"""`lowcomm simulate --netns` without root: a clear message and exit code 2, nothing started (the runs
in namespaces: tests/integration/test_netns_sim.py)."""

from __future__ import annotations

from lowcomm.cli import main
from lowcomm.transport import netns


# ---- without root ------------------------------------------------------------------------

def test_not_root_says_what_to_do_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    report = tmp_path / "report.json"
    assert main(["simulate", "--netns", "--peers", "2", "--link", "50mbit", "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert "--netns" in err and "root (sudo)" in err and "drop --netns" in err and "Traceback" not in err
    assert not report.exists() and not (tmp_path / "report-run" / "logs").exists()
