"""tests/outsider.py as a process beside a swarm: started in its own process group, stopped whatever it
did. Used by tests/integration/test_outsider_e2e.py and experiments/byzantine.py's outsider row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from lowcomm.runtime.processes import child_env

SCRIPT = Path(__file__).resolve().parent / "outsider.py"


def start_outsider(run_dir: Path, deadline_s: float) -> subprocess.Popen:
    """The outsider against the swarm that runs (or will run) in ``run_dir``; it gives up after ``deadline_s``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("outsider.stop", "outsider.jsonl", "coordinator.json"):
        (run_dir / stale).unlink(missing_ok=True)
    with open(run_dir / "outsider.log", "w") as log:
        return subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), "--deadline-s", str(deadline_s)],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)


def stop_outsider(outsider: subprocess.Popen, run_dir: Path) -> None:
    """Asks the outsider to stop, then kills its group whatever it did (its DHT daemons included)."""
    (run_dir / "outsider.stop").touch()
    try:
        outsider.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(outsider.pid, sig)
        except ProcessLookupError:
            break
    outsider.wait(timeout=30)
