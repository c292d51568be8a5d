"""`lowcomm simulate --netns`: a short run in network namespaces (the DHT counted apart, the wire at
least what lowcomm counts, every round with both peers), and the lab gone afterwards on every exit
path: a normal end, SIGINT and SIGTERM to the launcher (its finally blocks), SIGKILL (the lab's
reaper). Without root, a clear message and exit code 2. Assertions are on records and counters,
never on durations; every wait has a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from children import default_sigint, small_diloco_toml, wait_until

from lowcomm.transport import netns
from lowcomm.transport.netns import lab_objects, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
H, ROUNDS = 5, 3
# The control plane's budget per DHT node and second of the lab's life (start-up included): a record's
# store when it leaves round 0 and at half its life (Decision 58), the reads of the live records, the
# leader's manifest, the coordinator's anchors, the φ votes, start-up's looks and hivemind's upkeep; a
# round's announcements are posted, not stored (Decision 34; the count below). This run measured 3.4 KB/s
# per node with a search before every store (2.0 with reads from one node, Decision 40, withdrawn),
# 1.6-1.8 with direct stores and 1.6 with Decision 58's 30 s records; the bound, about two and a half
# times that, catches a regression to a tight poll loop (13.7 KB/s with the 50 ms poll) or to hivemind's
# cache refreshes. What a store sends is bounded in tests/integration/test_dht_store_bytes.py, the
# agreement's own reads per round in tests/unit/test_agreement_wakes.py.
CONTROL_BYTES_PER_NODE_S = 4_000
TEARDOWN_S = 30.0  # the lab counts until its nodes stop, after the last step
# tests/integration/test_integration.py's small_config, as a file for the command line
SMALL = small_diloco_toml(H, ROUNDS, eval_every_tokens=4 * H * 16 * 64 * 2, checkpoint_every_rounds=2)

needs_root = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"simulate --netns needs root and iproute2: {unavailable_reason()}")


def outside_state() -> tuple[set[str], set[str]]:
    """Namespaces and links that belong to no lab (other labs, e.g. experiments, may come and go)."""
    return ({ns for ns in netns._list_netns() if not netns.TAG_PATTERN.match(ns)},
            {link for link in netns._list_links() if not netns.TAG_PATTERN.match(link)})


def processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes that contain any of `needles` (a run dir, a lab's addresses)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(needle in cmdline for needle in needles):
                found.append(f"{entry}: {cmdline[:200]}")
    return found


def assert_lab_gone(tag: str, before: tuple[set[str], set[str]], *needles: str) -> None:
    assert lab_objects(tag) == {"netns": [], "links": []}
    assert not (netns.RUN_DIR / tag).exists()
    assert outside_state() == before
    assert processes_mentioning(*needles) == []


def simulate_cmd(tmp_path: Path, *extra: str) -> list[str]:
    config = tmp_path / "small.toml"
    config.write_text(SMALL)
    return [sys.executable, "-m", "lowcomm.cli", "simulate", "--netns", "--config", str(config),
            "--report", str(tmp_path / "report.json"), *extra]


# ---- as root -----------------------------------------------------------------------------

@needs_root
def test_two_peers_in_namespaces(tmp_path):
    before = outside_state()
    run = subprocess.run(simulate_cmd(tmp_path, "--peers", "2", "--link", "50mbit:20ms"), cwd=REPO,
                         capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    peers = sorted(node["peer"] for name, node in report["netns_nodes"].items() if name.startswith("peer-"))
    assert report["netns"] is True and report["failed_peers"] == []
    assert report["caps"] == {"coordinator": None, "peer-0": 50e6, "peer-1": 50e6}
    assert report["links"] == dict.fromkeys(peers, "50mbit:20ms")  # the cap and the latency
    # the kernel's counters: the DHT apart, and every byte lowcomm counted plus headers on the wire
    assert report["control_bytes"] > 0
    assert report["wire_bytes"] >= report["wire_bytes_peers"] >= report["bytes_sent"] > 0
    for name, node in report["netns_nodes"].items():
        assert node["tx"] == node["data_tx"] + node["control_tx"] and node["control_tx"] > 0, name
    assert report["control_bytes"] == sum(node["control_tx"] for node in report["netns_nodes"].values())
    # joining (p2pd's bootstrap, the first records) is sent before the release, the rounds' control after it
    assert 0 < report["control_bytes_training"] < report["control_bytes"], report
    lifetime_s = report["startup_s"] + report["wall_s"] + TEARDOWN_S
    assert report["control_bytes"] <= CONTROL_BYTES_PER_NODE_S * len(report["netns_nodes"]) * lifetime_s, report
    # the round's announcements went by post: only a lost post (or the first manifest's writer, whom no
    # previous round vouches for) stores one, against one per peer and round when each was stored
    calls = report["control_calls"]
    assert calls.get("store announce", 0) < ROUNDS, calls
    # the training went through the namespaces' addresses, with both peers in every round
    rounds = report["rounds"]
    assert [r["round"] for r in rounds] == list(range(ROUNDS))
    for r in rounds:
        assert sorted(r["contributors"]) == peers, r
        assert r["link_bound_s"] > 0  # computed with the cap
    starts = [e for e in report["events"] if e["kind"] == "start"]
    addresses = {node["address"] for node in report["netns_nodes"].values()}
    assert {e["endpoint"].rsplit(":", 1)[0] for e in starts} <= addresses
    assert [e["link"] for e in starts] == ["unlimited:20ms"] * 2  # the peers' shaper adds latency only
    # nothing of the run is left: namespaces, links, marker, processes
    assert_lab_gone(report["netns_lab"], before, str(tmp_path),
                    *(node["control_address"] for node in report["netns_nodes"].values()))


def lab_of(pid: int) -> str | None:
    for path in netns.RUN_DIR.glob("lcn*"):
        try:
            if json.loads(path.read_text()).get("pid") == pid:
                return path.name
        except (OSError, ValueError):
            continue
    return None


@needs_root
@pytest.mark.parametrize("signum, code, nodes", [(signal.SIGINT, 130, 1), (signal.SIGTERM, 128 + signal.SIGTERM, 3),
                                                 (signal.SIGKILL, -signal.SIGKILL, 1)])
def test_the_lab_goes_when_the_launcher_is_stopped(tmp_path, signum, code, nodes):
    """Once `nodes` nodes have processes inside (the coordinator starting; or it and both peers), the
    launcher is interrupted, terminated or killed."""
    before = outside_state()
    launcher = subprocess.Popen(simulate_cmd(tmp_path, "--peers", "2", "--link", "50mbit:20ms"), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=default_sigint)
    try:
        tag = wait_until(lambda: lab_of(launcher.pid), 120, "the launcher's lab")
        wait_until(lambda: len(lab_objects(tag)["netns"]) == nodes and all(
            netns._pids_inside(ns) for ns in lab_objects(tag)["netns"]), 300, f"{nodes} nodes with processes inside")
        control_net = json.loads((netns.RUN_DIR / tag).read_text())["control_net"]
        launcher.send_signal(signum)
        assert launcher.wait(timeout=120) == code, launcher.stderr.read()[-3000:]
        if signum != signal.SIGKILL:
            assert "Traceback" not in launcher.stderr.read()
        # SIGKILL: the reaper removes the lab, killing what runs inside
        wait_until(lambda: lab_objects(tag) == {"netns": [], "links": []} and not (netns.RUN_DIR / tag).exists(),
                   60, "the lab's removal")
        wait_until(lambda: not processes_mentioning(str(tmp_path), control_net.rsplit(".", 1)[0] + "."), 30,
                   "the run's processes to exit")
        assert_lab_gone(tag, before, str(tmp_path))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
