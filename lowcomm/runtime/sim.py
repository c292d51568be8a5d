"""`lowcomm simulate`: a coordinator and N peers as separate local processes over real sockets.

Every process runs in its own process group with one torch thread; on every exit path the
launcher kills each group (so a DHT helper or p2pd never outlives its peer) and checks that
nothing is left. Progress comes from the peers' JSONL records; the report is built from them.
Each peer gets its emulated link from the config's [link] section as its own `--link` flag.
With a churn plan (runtime.churn), joiners are started ahead and parked, and the wait loop applies
the plan's actions (kills, leaves, joins, slow peers, links down) as the swarm's rounds advance;
`resume` restarts the swarm from a coordinator's checkpoint folder. Peers named in `byzantine` (by
index; `simulate --byzantine KIND:N`) start with `--byzantine KIND` (runtime.byzantine).

Namespace mode (`--netns`, `[link] netns = true`; Linux and root) runs each process through
`node.wrap` in its own node of a transport.netns lab: the coordinator's node is uncapped, each peer's
(joiners' too) is capped both ways at the RATE of its link by htb, and the peer gets only the
LATENCY as `--link unlimited:LATENCY` (or no --link), so no byte is paced twice; a peer with no
RATE is uncapped, its bytes still counted. gRPC listens on the node's data address and the DHT
(p2pd) on its control address, so the kernel counts the two planes apart. `ip netns exec` execs
the command, so the process keeps its pid and leads its own group as before. The lab is closed
(whatever is left inside killed, links and namespaces removed) on every exit path of `run()`:
normal, an exception, Ctrl-C, SIGTERM to the launcher (turned into SystemExit), and the lab's
reaper process covers a SIGKILLed launcher. The report adds `netns`, `wire_bytes` (every frame
every node sent, Ethernet/IP/TCP headers and the DHT included, start-up to shut-down),
`control_bytes` (the DHT's share of it; `wire_bytes_training`, `control_bytes_training`: from the peers'
release on), `netns_nodes` (per node: cap and veth bytes by plane) and
`links` with each peer's cap and latency; `bytes_sent` stays lowcomm's own data-plane count.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from lowcomm.config import ConfigError, RunConfig
from lowcomm.data.corpus import CorpusError, load_corpus
from lowcomm.models.factory import ModelFactoryError, build_model
from lowcomm.runtime.byzantine import Kind, check_supported
from lowcomm.runtime.churn import ChurnExecutor, ChurnPlan, parse_churn
from lowcomm.runtime.processes import (Process, SimulationError, spawn, terminate_ignored, terminate_raises,
                                       wait_for_file)
from lowcomm.runtime.report import build_report
from lowcomm.runtime.runlog import COORDINATOR_CALLS_FILE, read_records
from lowcomm.runtime.sim_netns import NamespaceMode
from lowcomm.transport.netns import NetnsLab
from lowcomm.transport.shaper import LinkSpec, parse_link_option

logger = logging.getLogger(__name__)


@dataclass
class Simulation(NamespaceMode):
    config: RunConfig
    peers: int
    run_dir: Path
    host: str = "127.0.0.1"
    peer_faults: dict[int, str] = field(default_factory=dict)  # test hooks, by peer index
    progress: bool = True
    timeout_s: float | None = None
    churn: ChurnPlan | None = None  # None: the config's [churn] spec
    netns: bool | None = None  # None: the config's link.netns
    slowdowns: dict[int, float] = field(default_factory=dict)  # pipelines: emulated slower peers, by index
    stage_of: dict[int, int] | None = None  # pipelines: initial stage by peer index (default: index mod S)
    byzantine: dict[int, Kind] = field(default_factory=dict)  # Byzantine members' kinds, by peer index
    peer_flags: dict[int, list[str]] = field(default_factory=dict)  # keys and tokens by index (runtime.sim_admission)
    resume: Path | None = None  # a checkpoint folder the coordinator restarts the swarm from (--resume)
    slowdown_files: bool = False  # peers read RUN_DIR/slowdown-I (churn's slow action): set by churn_executor
    processes: list[Process] = field(default_factory=list)
    lab: NetnsLab | None = None  # namespace mode: opened by open_lab() (or the first process), closed by close()
    node_indices: dict[str, int | None] = field(default_factory=dict)  # node name -> peer index (None: coordinator)
    wire_samples: list[tuple[float, int]] = field(default_factory=list)  # netns: (time.time(), peers' veth tx so far)
    released_bytes: dict[str, int] | None = None  # netns: what the nodes had sent by plane when the peers were released

    @property
    def use_netns(self) -> bool:
        return self.config.link.netns if self.netns is None else self.netns

    def close(self) -> list[str]:
        """stop_all(), then the lab; returns the names of groups that survived."""
        try:
            return self.stop_all()
        finally:
            self.close_lab()

    def start_coordinator(self, resume: Path | None = None) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for folder in ("peers", "launcher"):
            records = self.run_dir / folder
            if records.exists() and any(records.iterdir()):
                # A reused run dir: keep the old records, but out of this run's report.
                kept = self.run_dir / f"{folder}.before-{int(time.time())}"
                records.rename(kept)
                logger.warning("%s held records of an earlier run; moved them to %s", records, kept)
        config_path = self.run_dir / "run.json"
        config_path.write_text(json.dumps(self.config.to_dict(), indent=1))
        ready = self.run_dir / "coordinator.json"
        ready.unlink(missing_ok=True)
        node = self.node("coordinator", None, None)  # uncapped: it stands for the run owner's server
        args = ["coordinator", "start", "--config", str(config_path), "--run-dir", str(self.run_dir),
                "--host", node.address if node else self.host, "--ready-file", str(ready)]
        if node is not None:
            args += ["--dht-host", node.control_address]
        if resume is not None:
            args += ["--resume", str(resume)]
        self.coordinator = spawn("coordinator", args, self.run_dir, node)
        self.processes.append(self.coordinator)
        self.info = wait_for_file(ready, self.coordinator, timeout=120)
        return self.info

    @property
    def start_file(self) -> Path:
        return self.run_dir / "start"

    def release(self, peers: list[Process], timeout: float = 300) -> None:
        """Waits until every parked peer is connected and ready, then lets them all start training."""
        self.wait_ready(peers, timeout)
        if self.lab is not None and self.released_bytes is None:
            self.released_bytes = self.lab.sent_bytes()
        self.start_file.touch()

    def wait_ready(self, peers: list[Process], timeout: float = 300) -> None:
        """Waits until every one of `peers` is connected and parked at its start barrier."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.records()
            ids, ready = self.peer_ids(records), self.ready_ids(records)
            if all(ids.get(p.index) in ready for p in peers):
                return
            dead = [p.name for p in peers if p.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SimulationError(f"peers {dead or 'some'} never became ready; see {self.run_dir / 'logs'}")
            time.sleep(0.1)

    @staticmethod
    def peer_ids(records: list[dict]) -> dict[int, str]:
        """Peer ids by simulate index, from each peer's start event (it names its data shard)."""
        return {r["data_shard"]: r["peer"] for r in records
                if r["type"] == "event" and r.get("kind") == "start" and "data_shard" in r}

    @staticmethod
    def ready_ids(records: list[dict]) -> set[str]:
        return {r["peer"] for r in records if r["type"] == "event" and r.get("kind") == "ready"}

    def start_peer(self, index: int, fault: str | None = None, park: bool = True,
                   start_file: Path | None = None) -> Process:
        """Peer `index` (also its data shard); parked peers wait at `start_file` (default: the shared one)."""
        name = f"peer-{index}"
        link = parse_link_option(self.config.link.spec_for(index))
        capped = link is not None and not math.isinf(link.rate_bits)  # "unlimited:40ms": latency only
        node = self.node(name, index, link.rate_bits if capped else None)
        args = ["peer", "join", "--coordinator", self.info["maddrs"][0], "--run-key", self.info["run_key"],
                "--run", self.info["run"], "--host", node.address if node else self.host, "--data-shard", str(index),
                "--num-shards", str(max(self.peers, index + 1)), "--run-dir", str(self.run_dir), "--device", "cpu"]
        if node is not None:
            args += ["--dht-host", node.control_address]
        start_file = (start_file or self.start_file) if park else None
        if start_file is not None:
            args += ["--start-file", str(start_file)]
        if self.config.pipelined and index < self.peers:  # the initial placement; joiners pick their stage
            stage = (self.stage_of or {}).get(index, index % self.config.pipeline.stages)
            args += ["--stage", str(stage)]
        if self.slowdown_files:
            args += ["--slowdown-file", str(self.run_dir / f"slowdown-{index}")]
        if self.slowdowns.get(index, 1.0) != 1.0:
            args += ["--slowdown", str(self.slowdowns[index])]
        if index in self.byzantine:
            args += ["--byzantine", Kind(self.byzantine[index]).value]
        args += self.peer_flags.get(index, [])
        if fault or self.peer_faults.get(index):
            args += ["--fault", fault or self.peer_faults[index]]
        if node is not None and link is not None and link.latency_s > 0:
            args += ["--link", str(LinkSpec(math.inf, link.latency_s))]  # htb has the rate: latency only
        elif node is None and link is not None:
            args += ["--link", self.config.link.spec_for(index)]
        process = spawn(name, args, self.run_dir, node)
        process.index, process.start_file = index, start_file
        self.processes.append(process)
        return process

    def records(self) -> list[dict]:
        """The peers' records and the launcher's own (churn events)."""
        return read_records(self.run_dir / "peers") + read_records(self.run_dir / "launcher")

    def wait_peers(self, peers: list[Process], timeout: float, churn: ChurnExecutor | None = None) -> None:
        """Waits until every one of `peers` has exited; `churn` may append joiners to `peers` meanwhile."""
        total = self.config.run.steps * self.peers
        bar = tqdm(total=total, unit="step", desc=f"{self.config.run.algo} x{self.peers}", disable=not self.progress,
                   file=sys.stderr)
        deadline = time.monotonic() + timeout
        try:
            while running := [p for p in peers if p.popen.poll() is None]:
                if time.monotonic() > deadline:
                    raise SimulationError(f"peers still running after {timeout:.0f}s; see {self.run_dir / 'logs'}")
                records = self.records()
                if churn is not None:
                    churn.poll(records)
                done = sum(r.get("steps", 0) for r in _last_compute(records).values())
                self.sample_wire()
                if min(done, total) > bar.n:
                    bar.update(min(done, total) - bar.n)
                try:  # back when the first running peer exits (the last one ends the run), else at the next check
                    running[0].popen.wait(timeout=0.2 if churn is not None else 1.0)
                except subprocess.TimeoutExpired:
                    pass
            bar.update(max(0, total - bar.n))
        finally:
            bar.close()

    def stop_all(self) -> list[str]:
        """Stops every process group (TERM, then KILL); returns the names of groups that survived."""
        for p in self.processes:
            if p.popen.poll() is None:
                p.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.popen.poll() is None for p in self.processes):
            time.sleep(0.1)
        for p in self.processes:
            p.kill_group(signal.SIGKILL)
        survivors = []
        for p in self.processes:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            end = time.monotonic() + 10
            while p.group_alive() and time.monotonic() < end:
                p.kill_group(signal.SIGKILL)
                time.sleep(0.1)
            if p.group_alive():
                survivors.append(p.name)
        if self.lab is not None and not self.lab.closed:
            # every process of the run lives in one of the lab's namespaces: none may be left there
            deadline = time.monotonic() + 10
            while any(node.pids() for node in self.lab.nodes) and time.monotonic() < deadline:
                time.sleep(0.1)
            survivors += [f"{node.name} (pids {node.pids()} in its namespace)" for node in self.lab.nodes
                          if node.pids()]
        return survivors

    def churn_plan(self) -> ChurnPlan | None:
        """The churn plan (given, or the config's [churn] spec); ConfigError for linkdown without namespaces."""
        plan = self.churn if self.churn is not None else parse_churn(self.config.churn.spec)
        if plan is not None and "linkdown" in plan.uses and not self.use_netns:
            raise ConfigError("churn action linkdown takes a peer's veth down in namespace mode only: add --netns")
        return plan

    def churn_executor(self) -> ChurnExecutor | None:
        plan = self.churn_plan()
        if plan is None:
            return None
        self.slowdown_files = "slow" in plan.uses
        return ChurnExecutor(plan, self, seed=self.config.run.seed, total_rounds=self.config.total_rounds,
                             epoch_rounds=self.config.ddp.epoch_steps if self.config.per_step else 1)

    def run(self) -> dict:
        started = time.time()
        churn = None
        error: BaseException | None = None
        try:
            with terminate_raises():
                self.check_model_and_data()
                self.open_lab()  # where namespaces cannot be made, nothing has started
                self.start_coordinator(resume=self.resume)
                churn = self.churn_executor()
                self.start_file.unlink(missing_ok=True)
                peers = [self.start_peer(i) for i in range(self.peers)]
                if churn is not None:
                    self.wait_ready(churn.start_spares())  # joiners wait parked, fully started, until their turn
                self.release(peers)
                if churn is not None:
                    churn.begin(peers)
                timeout = self.timeout_s or max(600.0, self.config.run.steps * self.peers * 1.0)
                self.wait_peers(peers, timeout, churn)
                removed = churn.removed if churn is not None else {}
                failed = [p.name for p in peers if p.popen.returncode != 0 and removed.get(p.name) != "kill"]
        except BaseException as e:
            error = e
            raise
        finally:
            with terminate_ignored():  # a second SIGTERM does not cut the clean-up short
                try:
                    if churn is not None:
                        churn.close(self.records())
                finally:
                    try:
                        survivors = self.stop_all()
                    finally:
                        self._close_lab_after(error)
        if survivors:
            raise SimulationError(f"processes of {survivors} survived SIGKILL of their group")
        report = self.report(started)
        report["failed_peers"] = failed
        if churn is not None:
            report["churn"] = churn.summary()
        return report

    def _close_lab_after(self, error: BaseException | None) -> None:
        """close_lab(); a failure to remove the lab does not hide the error that ended the run."""
        if error is None:
            self.close_lab()
            return
        try:
            self.close_lab()
        except Exception:
            logger.exception("while removing the lab after %s", type(error).__name__)

    def check_model_and_data(self) -> None:
        """Byzantine kinds fit the algorithm, the [model] factory imports and builds a module, the [data]
        corpus loads and fits the model (a text folder's cache is built here, once), the churn plan fits the
        mode: ConfigError before any process starts."""
        self.churn_plan()
        for kind in set(self.byzantine.values()):
            check_supported(Kind(kind), self.config.run.algo, self.config.pipelined)
        model = self.config.model
        try:
            build_model(model)
            load_corpus(self.config.data, model.vocab_size, model.context)
        except (ModelFactoryError, CorpusError) as e:
            raise ConfigError(str(e)) from None

    def report(self, started: float) -> dict:
        torch_params = sum(p.numel() for p in build_model(self.config.model).parameters())
        records = self.records()
        extra = {"config_hash": self.config.config_hash(), "run_dir": str(self.run_dir),
                 "coordinator_control_calls": self._coordinator_calls()}
        links = None
        if self.lab is not None:
            ids = self.peer_ids(records)
            # the peers' start events say only "unlimited:LATENCY": the rate is the node's htb cap
            links = {peer: self.config.link.spec_for(index) or None for index, peer in ids.items()}
            extra.update(self.netns_figures(ids))
        extra["stages"] = self.config.pipeline.stages
        report = build_report(records, algo=self.config.run.algo, peers=self.peers, seed=self.config.run.seed,
                              model_params=torch_params, started_at=started, extra=extra, links_override=links)
        if self.lab is not None:
            report["wire_bytes_per_token"] = report["wire_bytes_peers"] / report["tokens"] if report["tokens"] else None
            first_t = started + report["startup_s"]
            # about once a second: what the peers had sent on the wire t seconds into training
            report["wire_timeline"] = [{"t": t - first_t, "bytes": b} for t, b in self.wire_samples]
        return report

    def _coordinator_calls(self) -> dict[str, int] | None:
        """The coordinator's DHT calls by kind, as it wrote them when it stopped (None: it did not)."""
        try:
            calls = json.loads((self.run_dir / COORDINATOR_CALLS_FILE).read_text()).get("control_calls")
        except (OSError, ValueError, AttributeError):
            return None
        return {str(k): int(v) for k, v in calls.items()} if isinstance(calls, dict) else None


def _last_compute(records: list[dict]) -> dict[str, dict]:
    out = {}
    for r in records:
        if r["type"] == "compute":
            out[r["peer"]] = r
    return out
