"""The status page read from the DHT, as a run owner meets it: `lowcomm coordinator start
--dashboard-port` and `lowcomm observe --dashboard-port` (a second, read-only DHT node), with two
`lowcomm peer join` peers training. Both pages list the peers with the stats they publish and the
rounds they report; /metrics lists the lowcomm_* series; a peer killed with SIGKILL is shown gone
once its record expires. Every process runs in its own process group, killed at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from children import free_port, page_get as get, page_status as status, small_diloco_toml, wait_until

PEERS = 2


@pytest.mark.timeout(420)
def test_coordinator_and_observe_pages_show_the_dht_s_peers_rounds_and_a_killed_peer(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(small_diloco_toml(inner_steps=4, rounds=400, eval_every_tokens=4 * 1024 * PEERS,
                                        checkpoint_every_rounds=0))
    cli = [sys.executable, "-m", "lowcomm.cli"]
    processes: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        process = subprocess.Popen([*cli, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        processes.append(process)
        return process

    def alive(process: subprocess.Popen, name: str) -> None:
        if process.poll() is not None:
            raise AssertionError(f"{name} exited {process.returncode}: {(tmp_path / f'{name}.log').read_text()[-2000:]}")

    coordinator_page, observer_page = (f"http://127.0.0.1:{free_port()}/" for _ in range(2))
    ready = tmp_path / "coordinator.json"
    try:
        coordinator = start("coordinator", "coordinator", "start", "--config", str(config), "--host", "127.0.0.1",
                            "--run-dir", str(tmp_path / "coordinator"), "--ready-file", str(ready),
                            "--dashboard-port", coordinator_page.split(":")[-1].strip("/"))
        info = wait_until(lambda: alive(coordinator, "coordinator") or (ready.exists() and json.loads(ready.read_text())),
                          120, "the coordinator's join info")
        join = ["peer", "join", "--coordinator", info["maddrs"][0], "--run-key", info["run_key"], "--run", info["run"],
                "--host", "127.0.0.1", "--device", "cpu"]
        peers = [start(f"peer-{i}", *join, "--run-dir", str(tmp_path / f"peer-{i}"), "--data-shard", str(i))
                 for i in range(PEERS)]
        observer = start("observe", "observe", "--coordinator", info["maddrs"][0], "--run", info["run"],
                         "--dashboard-port", observer_page.split(":")[-1].strip("/"))

        def trained(url: str):
            def check():
                for process, name in [(coordinator, "coordinator"), (observer, "observe")] + \
                        [(p, f"peer-{i}") for i, p in enumerate(peers)]:
                    alive(process, name)
                s = status(url)
                if not s:
                    return None
                training = [p for p in s["peers"] if p["state"] == "training" and not p["gone"] and p["tokens"] > 0]
                full = [r for r in s["rounds"] if r["contributors"] == PEERS]
                return s if len(training) == PEERS and full and s["evals"] else None
            return check

        for url in (coordinator_page, observer_page):
            s = wait_until(trained(url), 240, f"{PEERS} training peers and a full round on {url}", poll_s=1.0)
            assert s["source"] == "the DHT's peer records"
            rows = [p for p in s["peers"] if p["state"] == "training"]
            assert all(p["device"] == "cpu" and p["sent"] > 0 and p["contributed"] >= 1 and p["round"] >= 1
                       for p in rows), rows
            assert {e["kind"] for e in s["events"]} >= {"join"}
            full = [r for r in s["rounds"] if r["contributors"] == PEERS][0]
            assert full["bytes"] > 0 and full["norm"] is not None and len(full["phi"]) == 16, full
        families = {f.name: f for f in text_string_to_metric_families(get(observer_page + "metrics").decode())}
        up = {s.labels["peer"]: s.value for s in families["lowcomm_peer_up"].samples}
        assert sum(up.values()) >= PEERS and families["lowcomm_tokens"].samples[0].value > 0

        victim = peers[0]
        os.killpg(victim.pid, signal.SIGKILL)  # its record is no longer refreshed: it expires (record_ttl_s)
        victim.wait(timeout=30)

        def shown_gone():
            s = status(observer_page)
            gone = [p for p in s["peers"] if p["gone"]] if s else []
            return gone if len(gone) == 1 else None
        (gone,) = wait_until(shown_gone, 120, "the killed peer shown gone on the observer's page", poll_s=1.0)
        assert gone["gone_why"] == "its record expired" and gone["tokens"] > 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the DHT's helpers of a peer that did not stop
            except ProcessLookupError:
                pass
            process.wait(timeout=30)
