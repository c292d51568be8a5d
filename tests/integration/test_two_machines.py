"""Machines apart, as network namespaces on one bridge: the coordinator in one, two peers in others
that reach it only at its bridge address. Everything listens on its default, 0.0.0.0; each peer
runs the join command the coordinator printed (read from its output), plus the test's own flags
(records, CPU, a start barrier). One peer refuses every inbound connection (NetnsLab.refuse_inbound:
a NAT without forwarding), so the coordinator's dial-back fails and it must run in client mode; the
other must not. Both train to the end in rounds together, and every round's manifest (its owners,
in each peer's round records) makes the serving peer the only shard owner. Assertions are on the
printed command and the records, never on durations; every wait has a deadline; the lab kills what
runs inside it and goes away."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from children import default_sigint, events, rounds_of, small_diloco_toml, wait_until

from lowcomm.runtime.processes import child_env
from lowcomm.transport import netns
from lowcomm.transport.netns import NetnsLab, NetnsUnavailable, lab_objects, unavailable_reason

REPO = Path(__file__).resolve().parents[2]
H, ROUNDS = 3, 2
SMALL = small_diloco_toml(H, ROUNDS, eval_every_tokens=1000000000, checkpoint_every_rounds=0)

needs_netns = pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"namespace tests need root and iproute2: {unavailable_reason()}")


def start(node, argv: list[str], log: Path) -> subprocess.Popen:
    """`lowcomm ARGV` inside `node`'s namespace, in a process group of its own, its output in `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(node.wrap([sys.executable, "-m", "lowcomm.cli", *argv]), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env=child_env(), preexec_fn=default_sigint)


def printed_join_command(process: subprocess.Popen, log: Path) -> list[str]:
    def find():
        if process.poll() is not None:
            raise AssertionError(f"the coordinator exited ({process.returncode}): {log.read_text()[-2000:]}")
        lines = [line.strip() for line in log.read_text().splitlines()]
        return next((shlex.split(line) for line in lines if line.startswith("lowcomm peer join ")), None)
    return wait_until(find, 120, "the coordinator's join command")


def records(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "peers").glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def by_address(records_: list[dict], kind: str) -> dict[str, dict]:
    """One peer's `kind` event per address its endpoint announces."""
    return {e["endpoint"].rsplit(":", 1)[0]: e for e in events(records_, kind)}


@pytest.fixture
def lab():
    try:
        opened = NetnsLab().open()
    except NetnsUnavailable as error:
        pytest.skip(str(error))
    started: list[subprocess.Popen] = []
    try:
        yield opened, started
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        opened.close()
        assert lab_objects(opened.tag) == {"netns": [], "links": []} and not (netns.RUN_DIR / opened.tag).exists()


@needs_netns
@pytest.mark.timeout(240)
def test_peers_on_other_machines_join_from_the_printed_command(lab, tmp_path):
    lab, started = lab
    coordinator_node, open_node, nat_node = (lab.add_node(name) for name in ("coordinator", "open", "nat"))
    lab.refuse_inbound(nat_node)
    config, run_dir, start_file = tmp_path / "small.toml", tmp_path / "run", tmp_path / "start"
    config.write_text(SMALL)
    coordinator_log = tmp_path / "coordinator.log"
    coordinator = start(coordinator_node, ["coordinator", "start", "--config", str(config),
                                           "--run-dir", str(tmp_path / "coordinator")], coordinator_log)
    started.append(coordinator)

    command = printed_join_command(coordinator, coordinator_log)
    assert command[:3] == ["lowcomm", "peer", "join"]
    maddr = command[command.index("--coordinator") + 1]
    assert maddr.startswith(f"/ip4/{coordinator_node.address}/tcp/"), maddr  # never 0.0.0.0 or 127.0.0.1
    test_flags = ["--run-dir", str(run_dir), "--device", "cpu", "--start-file", str(start_file)]
    peers = {node.name: start(node, [*command[1:], *test_flags], tmp_path / f"{node.name}.log")
             for node in (open_node, nat_node)}
    started.extend(peers.values())

    def ready():
        dead = {name: p.returncode for name, p in peers.items() if p.poll() is not None}
        assert not dead, f"peers exited before training: {dead}; logs in {tmp_path}"
        found = records(run_dir)
        ready_ids = {e["peer"] for e in events(found, "ready")}
        starts = by_address(found, "start")
        return len(starts) == 2 and all(e["peer"] in ready_ids for e in starts.values())
    wait_until(ready, 150, "both peers connected and parked")
    start_file.touch()
    for name, process in peers.items():
        assert process.wait(timeout=150) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    found = records(run_dir)
    # each announced its bridge address on both planes, and the coordinator answered the dial-back
    checks = by_address(found, "reachability")
    assert set(checks) == {open_node.address, nat_node.address}
    for address, check in checks.items():
        assert check["how"] == "dial-back" and check["helper"].startswith(f"{coordinator_node.address}:"), check
        assert len(check["dht"]) == 1 and check["dht"][0].startswith(f"/ip4/{address}/tcp/"), check
    assert checks[open_node.address]["client_mode"] is False
    assert checks[nat_node.address]["client_mode"] is True and "no answer" in checks[nat_node.address]["detail"]
    assert [e["about"] for e in events(found, "warning")] == ["reachability"]  # the client-mode peer's
    starts = by_address(found, "start")
    assert starts[open_node.address]["client_mode"] is False and starts[nat_node.address]["client_mode"] is True
    open_id, nat_id = starts[open_node.address]["peer"], starts[nat_node.address]["peer"]

    # both trained to the end, every round with both; the manifests made the serving peer the only owner
    assert {e["peer"] for e in events(found, "exit")} == {open_id, nat_id}
    rounds = rounds_of(found)
    assert sorted(rounds) == list(range(ROUNDS))
    for round_, landed in rounds.items():
        assert {r["peer"] for r in landed} == {open_id, nat_id}, round_
        for r in landed:
            assert sorted(r["contributors"]) == sorted([open_id, nat_id]), r
            assert sorted(r["participants"]) == sorted([open_id, nat_id]), r
            assert r["owners"] == [open_id], r  # the client-mode peer owns no shard
    assert not [e for e in found if e["type"] == "event" and e.get("owner") == nat_id]  # nobody waited on it
