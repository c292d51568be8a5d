"""The two tiers, the shared helpers, and the check that the tests leave no process behind.

tests/unit holds tests that run in this one process; tests/integration holds tests that start real
peer processes, network namespaces or the DHT's daemons. Every test under tests/integration gets the
`integration` marker here, so `pytest -m "not integration"` is the fast tier and `pytest` runs both.
The helpers (golden.py, children.py, fixtures/) stay in tests/ and are imported as top-level modules
(`from golden import ...`) from either tier."""

from __future__ import annotations

import os
import re
import select
import sys
import time
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
INTEGRATION = TESTS / "integration"

if str(TESTS) not in sys.path:  # pytest's default import mode puts it there too; not every mode does
    sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)


# ---- processes left behind --------------------------------------------------------------------

# What `pgrep -f 'lowcomm.cli|p2pd'` matches: peers, coordinators and simulate launchers, and the
# DHT's daemons.
WATCHED = re.compile(r"lowcomm\.cli|p2pd")
RUN_ENV = "LOWCOMM_TEST_RUN"
GRACE_S = 10.0  # a process may still be on its way out when the last test ends


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def watched_processes() -> dict[int, str]:
    """pid -> command line of the live processes whose command line matches WATCHED (zombies have none)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        raw = _read(f"/proc/{entry}/cmdline")
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip() if raw else ""
        if cmdline and WATCHED.search(cmdline):
            found[int(entry)] = cmdline
    return found


def started_by_this_run(pid: int, token: str) -> bool:
    """Whether `pid` inherited this test run's marker. The machine is shared: a peer another person
    started while these tests ran is not theirs. A process whose environment cannot be read counts."""
    environ = _read(f"/proc/{pid}/environ")
    return environ is None or f"{RUN_ENV}={token}".encode() in environ.split(b"\0")


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Whether `pid` ends within `timeout` seconds: waits on its pidfd (readable once it exits)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], max(0.0, timeout))
        return bool(readable)
    finally:
        os.close(fd)


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Fails the run if a process matching WATCHED that started during the test run outlives it.
    Processes that existed before the run are not the tests'; children inherit RUN_ENV,
    which tells ours from those others start meanwhile."""
    if not os.path.isdir("/proc"):
        yield
        return
    before = set(watched_processes())
    token = uuid.uuid4().hex
    previous = os.environ.get(RUN_ENV)
    os.environ[RUN_ENV] = token
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = previous
    deadline = time.monotonic() + GRACE_S
    left = {pid: cmd for pid, cmd in watched_processes().items()
            if pid not in before and started_by_this_run(pid, token)}
    for pid in list(left):
        if wait_for_exit(pid, deadline - time.monotonic()):
            del left[pid]
    if left:
        listing = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"processes left behind by the tests (still running {GRACE_S:.0f}s after the last "
                    f"test):\n{listing}", pytrace=False)
