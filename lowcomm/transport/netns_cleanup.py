"""A netns lab's lifetime beyond its owner: markers under /run, the lock, killing what runs inside,
removing a lab, the reaper process and the clean-up of stale labs.

Part of transport.netns (the lab); see its docstring for the whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

from lowcomm.transport.netns_commands import (KILL_TIMEOUT_S, LOCK_TIMEOUT_S, NETNS_DIR, RUN_DIR, TAG_PATTERN,
                                              NetnsError, NetnsUnavailable, _list_links, _list_netns, _run,
                                              unavailable_reason)

logger = logging.getLogger(__name__)


def _process_start(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a reused pid apart); None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _marker_path(tag: str) -> Path:
    return RUN_DIR / tag


def _read_marker(tag: str) -> dict | None:
    try:
        return json.loads(_marker_path(tag).read_text())
    except (OSError, ValueError):
        return None


def _owner_alive(marker: dict) -> bool:
    return marker.get("start") is not None and _process_start(int(marker.get("pid", 0))) == marker["start"]


@contextlib.contextmanager
def _locked():
    """One lab at a time picks its tag and subnets, and removal does not race creation."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(RUN_DIR / ".lock", "w") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NetnsError(f"{RUN_DIR / '.lock'} stayed locked for {LOCK_TIMEOUT_S:.0f}s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pids_inside(netns: str) -> list[int]:
    """What `ip netns pids` prints, without a process per call. A zombie has left its namespace."""
    try:
        target = os.stat(NETNS_DIR / netns)
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                inode = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (inode.st_ino, inode.st_dev) == (target.st_ino, target.st_dev):
                pids.append(int(entry))
    return pids


def _kill_inside(namespaces: list[str]) -> list[int]:
    """SIGKILLs every process in these namespaces until none is left (or KILL_TIMEOUT_S); returns survivors."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    while True:
        pids = [pid for ns in namespaces for pid in _pids_inside(ns)]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def lab_objects(tag: str) -> dict[str, list[str]]:
    """The namespaces and root-namespace links of lab `tag` that exist now."""
    return {"netns": [ns for ns in _list_netns() if ns.startswith(f"{tag}-")],
            "links": [link for link in _list_links() if re.fullmatch(rf"{tag}(br|h\d+)", link)]}


def remove_lab(tag: str) -> dict[str, list[str]]:
    """Kills the processes inside lab `tag`, deletes its veths, namespaces, bridge and then its marker.

    Returns what is still there (empty lists when all went); the marker stays while anything does.
    """
    objects = lab_objects(tag)
    survivors = _kill_inside(objects["netns"])
    if survivors:
        logger.warning("processes %s in lab %s survived SIGKILL for %.0fs", survivors, tag, KILL_TIMEOUT_S)
    bridge = f"{tag}br"
    for link in sorted(objects["links"], key=lambda name: name == bridge):  # the bridge last
        _run(["ip", "link", "del", link], check=False)  # deleting one end of a veth deletes both
    for ns in objects["netns"]:
        _run(["ip", "netns", "del", ns], check=False)
    left = lab_objects(tag)
    if not left["netns"] and not left["links"]:
        _marker_path(tag).unlink(missing_ok=True)
    return left


def cleanup_stale() -> list[str]:
    """Removes every lab whose owner process is gone, and lab objects that have no marker; returns their tags."""
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    removed = []
    with _locked():
        names = [*_list_netns(), *_list_links(), *(p.name for p in RUN_DIR.iterdir())]
        tags = {m.group(0) for m in (TAG_PATTERN.match(name) for name in names) if m}
        for tag in sorted(tags):
            marker = _read_marker(tag)
            if marker is not None and _owner_alive(marker):
                continue
            left = remove_lab(tag)
            if left["netns"] or left["links"]:
                logger.warning("could not remove all of stale lab %s: %s", tag, left)
            else:
                logger.info("removed stale lab %s (owner pid %s)", tag, (marker or {}).get("pid"))
                removed.append(tag)
    return removed


def _reap(tag: str, fd: int) -> None:
    """The reaper: blocks until its owner closes the pipe (by close() or by dying), then removes what is left."""
    while os.read(fd, 4096):
        pass
    if _read_marker(tag) is not None:
        with _locked():
            remove_lab(tag)
