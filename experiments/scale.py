"""Scale on one small machine: `lowcomm simulate` with N = 4 … 32 peer processes of a small model.

    python experiments/scale.py [--peers 4 8 16 32] [--steps 60] [--netns] [--out experiments/out/scale]

Each row is one simulation (DiLoCo, uint8, H = 10) of a model of ≤ 100k parameters (d_model 32,
2 layers, context 32), batch 8, on loopback, with the sync deadlines scaled to the peers per core:
announce, manifest and reduce deadlines are multiplied by max(1, N / (2 · cores)), the rest is the
embedded default config. While it runs, every second the script sums the PSS
(/proc/PID/smaps_rollup) of each peer's process group: the peer itself, its DHT's forked helper and
its p2pd daemon; the table gives the largest per-peer sum, its mean over peers at the moment the
whole run peaked, and the host's available memory at that moment. Per N also the control plane:
the peers' mean wait from announcing a round to its manifest (`manifest_s`, waiting for slower peers
included), the agreement itself (`agreement s`: the median over rounds of the last peer's wait, when
everyone else waits already), their DHT calls per peer and round (the report's `control_calls`), and with --netns
(every process in its own network namespace, uncapped) the DHT's bytes per peer and round: all of them
(start-up to shut-down, over the run's rounds), those sent from the peers' release on (the rounds'
own cost: records, votes, reads and the DHT's upkeep), and per peer those sent before it (joining).

Rows are kept as JSON under OUT/ and skipped on a rerun (resumable); the table OUT/table.md is
rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.config import default_config  # noqa: E402
from lowcomm.models.gpt import GPT  # noqa: E402
from lowcomm.runtime.sim import Simulation  # noqa: E402
from revisions import agreement_s, round_records  # noqa: E402 (beside this script)

SMALL_MODEL = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.context": 32}


def small_config(peers: int, steps: int, seed: int, netns: bool = False):
    scale = max(1.0, peers / (2 * (os.cpu_count() or 1)))
    base = default_config()
    return base.override({
        **SMALL_MODEL, "inner.batch_size": 8, "run.steps": steps, "run.seed": seed, "diloco.inner_steps": 10,
        "data.eval_every_tokens": peers * 8 * 32 * 20,
        "sync.announce_s": base.sync.announce_s * scale, "sync.manifest_s": base.sync.manifest_s * scale,
        "sync.reduce_timeout_s": base.sync.reduce_timeout_s * scale,
        "sync.record_ttl_s": base.sync.record_ttl_s * scale, "link.netns": netns})


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def groups_pss(pgids: set[int]) -> dict[int, dict]:
    """Per process group: PSS in KiB summed over its processes, and their names."""
    out = {g: {"pss_kib": 0, "procs": []} for g in pgids}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
            pgid = int(fields[1].split()[2])
        except (OSError, IndexError, ValueError):
            continue
        if pgid in out:
            out[pgid]["pss_kib"] += pss_kib(int(entry))
            out[pgid]["procs"].append(name)
    return out


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


class MemorySampler(threading.Thread):
    def __init__(self, sim: Simulation, period: float = 1.0):
        super().__init__(daemon=True)
        self.sim, self.period = sim, period
        self.peak_total, self.peak = 0, {}
        self.max_per_peer, self.samples = 0, 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            peers = [p for p in list(self.sim.processes) if p.index is not None and p.popen.poll() is None]
            if not peers:
                continue
            pss = groups_pss({p.pgid for p in peers})
            per_peer = [pss[p.pgid]["pss_kib"] for p in peers]
            self.samples += 1
            self.max_per_peer = max(self.max_per_peer, max(per_peer))
            if sum(per_peer) > self.peak_total:
                self.peak_total = sum(per_peer)
                procs = sorted({name for g in pss.values() for name in g["procs"]})
                self.peak = {"peers_alive": len(peers), "total_pss_mib": sum(per_peer) / 1024,
                             "mean_peer_pss_mib": sum(per_peer) / len(per_peer) / 1024,
                             "mem_available_mib": mem_available_kib() / 1024, "process_names": procs,
                             "procs_per_peer": max(len(g["procs"]) for g in pss.values())}

    def stop(self) -> dict:
        self._halt.set()
        self.join(5)
        return {**self.peak, "max_peer_pss_mib": self.max_per_peer / 1024, "samples": self.samples}


def run_row(out: Path, peers: int, steps: int, seed: int, netns: bool = False) -> dict:
    path = out / f"n{peers}.json"
    if path.exists():
        return json.loads(path.read_text())
    config = small_config(peers, steps, seed, netns)
    sim = Simulation(config, peers, out / "runs" / f"n{peers}", progress=True)
    sampler = MemorySampler(sim)
    sampler.start()
    started = time.time()
    try:
        report = sim.run()
    finally:
        memory = sampler.stop()
    rounds = report["rounds"]
    records = round_records(out / "runs" / f"n{peers}")
    manifest_s = [r["manifest_s"] for r in records if "manifest_s" in r]
    peer_rounds = peers * max(1, len(rounds))
    row = {"peers": peers, "steps": steps, "model_params": GPT(config.model).num_parameters(),
           "launch_to_end_s": time.time() - started, "startup_s": report["startup_s"], "wall_s": report["wall_s"],
           "final_loss": report["final_loss"], "rounds": len(rounds),
           "full_rounds": sum(1 for r in rounds if len(r["contributors"]) == peers),
           "mean_sync_s": sum(r["sync_s"] for r in rounds) / len(rounds) if rounds else None,
           "failed_peers": report.get("failed_peers"), "compute_utilization": report["compute_utilization"],
           "resyncs": sum(1 for e in report["events"] if e["kind"] == "resync"),
           "timeouts": sum(1 for e in report["events"] if e["kind"] == "timeout"),
           "deadline_scale": config.sync.announce_s / default_config().sync.announce_s, "memory": memory,
           "manifest_s_mean": sum(manifest_s) / len(manifest_s) if manifest_s else None,
           "agreement_s": agreement_s(records),
           "dht_calls_per_peer_round": sum((report.get("control_calls") or {}).values()) / peer_rounds,
           "dht_bytes_per_peer_round": (report["control_bytes"] / peer_rounds
                                        if report.get("control_bytes") is not None else None),
           "dht_training_bytes_per_peer_round": (report["control_bytes_training"] / peer_rounds
                                                 if report.get("control_bytes_training") is not None else None),
           "dht_startup_bytes_per_peer": (
               (report["control_bytes"] - report["control_bytes_training"]) / peers
               if report.get("control_bytes_training") is not None else None)}
    path.write_text(json.dumps(row, indent=1))
    return row


def _fmt(value, spec: str, unit: float = 1.0) -> str:
    return "n/a" if value is None else format(value / unit, spec)


def table(rows: list[dict]) -> str:
    lines = ["| peers | params | startup s | wall s | wall / wall(N=4) | rounds (all N contributed) | mean sync s | "
             "resyncs | final loss | PSS per peer MiB (mean at peak; max) | processes per peer | "
             "total PSS MiB | MemAvailable at peak MiB | deadline scale | manifest s | agreement s | "
             "DHT calls / peer / round | DHT KB / peer / round | of which in training | DHT KB / peer at start-up |",
             "| --- " * 20 + "|"]
    base = next((r for r in rows if r["peers"] == 4), None)
    for r in sorted(rows, key=lambda r: r["peers"]):
        m = r["memory"]
        growth = f"{r['wall_s'] / base['wall_s']:.1f}x" if base else "n/a"
        lines.append(f"| {r['peers']} | {r['model_params']} | {r['startup_s']:.0f} | {r['wall_s']:.0f} | {growth} | "
                     f"{r['rounds']} ({r['full_rounds']}) | {r['mean_sync_s']:.1f} | {r['resyncs']} | "
                     f"{r['final_loss']:.3f} | {m.get('mean_peer_pss_mib', 0):.0f}; {m['max_peer_pss_mib']:.0f} | "
                     f"{m.get('procs_per_peer', 0)} | {m.get('total_pss_mib', 0):.0f} | "
                     f"{m.get('mem_available_mib', 0):.0f} | {r['deadline_scale']:.1f} | "
                     f"{_fmt(r.get('manifest_s_mean'), '.2f')} | {_fmt(r.get('agreement_s'), '.3f')} | "
                     f"{_fmt(r.get('dht_calls_per_peer_round'), '.1f')} | "
                     f"{_fmt(r.get('dht_bytes_per_peer_round'), ',.0f', 1e3)} | "
                     f"{_fmt(r.get('dht_training_bytes_per_peer_round'), ',.1f', 1e3)} | "
                     f"{_fmt(r.get('dht_startup_bytes_per_peer'), ',.0f', 1e3)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--netns", action="store_true", help="every process in its own network namespace (root)")
    parser.add_argument("--out", type=Path, default=Path("experiments/out/scale"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, started = [], time.time()
    for i, peers in enumerate(args.peers):
        t0 = time.time()
        rows.append(run_row(args.out, peers, args.steps, args.seed, args.netns))
        left = len(args.peers) - i - 1
        print(f"[{i + 1}/{len(args.peers)}] N={peers}: wall {rows[-1]['wall_s']:.0f}s "
              f"({time.time() - t0:.0f}s with start-up); ETA ≥ {(time.time() - started) / (i + 1) * left / 60:.0f} min",
              flush=True)
        (args.out / "table.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
