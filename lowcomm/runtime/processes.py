"""simulate's processes: `lowcomm` children, each in its own process group, and the launcher's signals.

Every child leads its own group (start_new_session), so killing the group also ends a DHT helper
or p2pd the child started; a zombie leader is reaped before its group is declared gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lowcomm.transport.netns import Node


class SimulationError(RuntimeError):
    """The simulation could not run to the end; the message says what to look at."""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path
    index: int | None = None  # simulate's peer index (its data shard); None for the coordinator
    start_file: Path | None = None  # the barrier a parked peer waits at

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session=True: the child leads its own group

    def kill_group(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # a zombie leader keeps the group id alive: reap it first
        self.popen.poll()
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False


def spawn(name: str, args: list[str], run_dir: Path, node: Node | None = None) -> Process:
    """`lowcomm <args>` in its own process group (inside `node`'s namespace when given)."""
    log_path = run_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lowcomm.cli", *args]
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(node.wrap(cmd) if node is not None else cmd, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, env=child_env())
    return Process(name, popen, log_path)


def wait_for_file(path: Path, process: Process, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if process.popen.poll() is not None:
            raise SimulationError(f"{process.name} exited with code {process.popen.returncode} before it was "
                                  f"ready; see {process.log_path}")
        time.sleep(0.1)
    raise SimulationError(f"{process.name} was not ready after {timeout:.0f}s; see {process.log_path}")


@contextlib.contextmanager
def terminate_raises():
    """In the main thread: SIGTERM (and SIGHUP, unless ignored) raise SystemExit, so every finally runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signum == signal.SIGTERM or signal.getsignal(signum) == signal.SIG_DFL:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def terminate_ignored():
    """In the main thread: SIGTERM and SIGHUP are ignored meanwhile (the clean-up runs to its end)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
