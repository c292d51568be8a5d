"""One `lowcomm simulate` launch for the experiments: its own process group, bounded in time.

On a timeout the launcher is sent SIGTERM (it stops its peers' groups, then exits), and SIGKILL to
its group if it is still there a minute later.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_simulate(cmd: list[str], cwd: Path, log_path: Path, timeout_s: float, env: dict | None = None) -> int | str:
    """The launcher's exit code, or "timeout"; its output goes to ``log_path``."""
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            return launcher.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            return "timeout"


def save_table(out: Path, lines: list[str], missing: list[str]) -> str:
    """Writes OUT/table.md: ``lines``, then the rows still missing (a resumable script's partial table)."""
    if missing:
        lines = lines + ["", f"Rows still missing: {', '.join(missing)}."]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table
