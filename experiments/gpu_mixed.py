"""A mixed swarm: one peer training on a GPU beside CPU peers in one run, and what a step costs each.

    python experiments/gpu_mixed.py [--gpu cuda:0] [--cpu-peers 2] [--algo diloco] [--steps 60]
        [--inner-steps 10] [--seed 0] [--config TOML] [--out experiments/out/gpu_mixed] [--cpu-only] [--again]

The swarm runs on the simulate machinery (lowcomm.runtime.sim.Simulation: a coordinator and 1 + N peer
processes over loopback, each in its own process group, all stopped at the end, the embedded default
run unless --config), with peer 0 started `--device GPU` and the others `--device cpu`. From each peer's
JSONL records it prints: its device, steps, wall seconds per step (from its first step to its last
record: compute, sync waits and evaluations), compute seconds per step (forward, backward and optimizer;
on CUDA measured after the device finished them), compute utilization (compute / wall), the shares of
sync wait and evaluation, rounds landed and resyncs. Then, for the algorithms whose replicas share φ,
how many rounds every peer that landed them did so with the same φ hash: the mixed swarm applied the
same aggregates. (ddp's inner optimizer steps on each peer's own device, so its φ is not expected to
agree bitwise across device types: docs/devices.md.)

Where torch sees no GPU the script exits at once with one line. `--cpu-only` runs the same swarm with
peer 0 on the CPU too: the script's own end-to-end check on a machine without a GPU. The row is kept as
OUT/<row>.json (the simulate report's summary and the per-peer rows) with its run folder OUT/runs/<row>/
(records, logs; not kept in git); a rerun prints the kept row (resumable) unless --again. OUT/table.md
holds the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lowcomm.config import ConfigError, load_config  # noqa: E402
from lowcomm.runtime.runlog import read_records  # noqa: E402
from lowcomm.runtime.trainer import resolve_device  # noqa: E402

SUMMARY_KEYS = ("algo", "peers", "final_loss", "final_loss_spread", "tokens", "bytes_sent", "wall_s", "startup_s",
                "compute_s", "compute_utilization", "sync_wait_share", "eval_share", "failed_peers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="cuda:0", help="the GPU peer's --device (cuda or cuda:N)")
    parser.add_argument("--cpu-peers", type=int, default=2, help="peers on --device cpu beside the GPU peer")
    parser.add_argument("--algo", default="diloco", help="run.algo")
    parser.add_argument("--steps", type=int, default=60, help="inner steps per peer (run.steps)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H of the round-based algorithms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, help="run config (TOML); default: the embedded default run")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "gpu_mixed")
    parser.add_argument("--cpu-only", action="store_true", help="peer 0 on the CPU too (no GPU needed)")
    parser.add_argument("--again", action="store_true", help="run the row again even if OUT/<row>.json exists")
    return parser.parse_args(argv)


def gpu_device(args) -> str:
    """The GPU peer's --device, or exit with one line where this machine cannot give it."""
    if args.cpu_only:
        return "cpu"
    if not torch.cuda.is_available():
        sys.exit(f"gpu_mixed: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees no GPU "
                 "here, so there is no mixed swarm to run; run it on a machine with one, or pass --cpu-only")
    try:
        device = resolve_device(args.gpu)
    except ConfigError as e:
        sys.exit(f"gpu_mixed: {e}")
    if device.type != "cuda":
        sys.exit(f"gpu_mixed: --gpu {args.gpu} is not a GPU; give cuda or cuda:N")
    return str(device)


def run_config(args):
    config = load_config(args.config).override({"run.algo": args.algo})
    h_key = f"{config.run.algo}.inner_steps" if config.run.algo in ("sparseloco", "noloco") else "diloco.inner_steps"
    return config.override({"run.steps": args.steps, "run.seed": args.seed, h_key: args.inner_steps})


def peer_rows(records: list[dict], devices: dict[int, str]) -> list[dict]:
    """One row per peer, from its start event, its last compute record, its rounds and its resyncs."""
    starts = {r["peer"]: r for r in records if r["type"] == "event" and r.get("kind") == "start"}
    compute = {r["peer"]: r for r in records if r["type"] == "compute"}  # the last one of each peer
    rounds = Counter(r["peer"] for r in records if r["type"] == "round")
    resyncs = Counter(r["peer"] for r in records if r["type"] == "event" and r.get("kind") == "resync")
    rows = []
    for peer, start in sorted(starts.items(), key=lambda item: item[1].get("data_shard", 0)):
        c, index = compute.get(peer, {}), start.get("data_shard")
        steps = c.get("steps", 0)
        wall = (c["last_step_t"] - c["first_step_t"]) if c.get("first_step_t") else 0.0
        rows.append({
            "index": index, "peer": peer[:12], "device": devices.get(index, start.get("device")),
            "recorded_device": start.get("device"), "steps": steps, "wall_s": wall,
            "wall_per_step_s": wall / steps if steps else None,
            "compute_per_step_s": c.get("compute_s", 0.0) / steps if steps else None,
            "utilization": c.get("compute_s", 0.0) / wall if wall > 0 else None,
            "sync_share": c.get("sync_wait_s", 0.0) / wall if wall > 0 else None,
            "eval_share": c.get("eval_s", 0.0) / wall if wall > 0 else None,
            "rounds": rounds[peer], "resyncs": resyncs[peer]})
    return rows


def phi_agreement(records: list[dict]) -> tuple[int, int]:
    """(rounds whose φ hash was the same on every peer that landed them, rounds landed by 2+ peers)."""
    hashes: dict[int, set[str]] = defaultdict(set)
    landed: Counter = Counter()
    for r in records:
        if r["type"] == "round" and r.get("phi_hash"):
            hashes[r["round"]].add(r["phi_hash"])
            landed[r["round"]] += 1
    shared = [round_ for round_, n in landed.items() if n >= 2]
    return sum(1 for round_ in shared if len(hashes[round_]) == 1), len(shared)


def table(row: dict) -> str:
    def f(value, fmt):
        return "n/a" if value is None else format(value, fmt)
    lines = [f"# {row['name']}: {row['summary']['algo']}, {len(row['peers'])} peers ({row['gpu']} + "
             f"{row['cpu_peers']} cpu), {row['steps']} steps each", "",
             "| peer | device | steps | wall / step (ms) | compute / step (ms) | utilization | sync share | "
             "eval share | rounds | resyncs |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in row["peers"]:
        lines.append(f"| {p['index']} ({p['peer']}) | {p['device']} | {p['steps']} | "
                     f"{f(p['wall_per_step_s'] and p['wall_per_step_s'] * 1e3, '.1f')} | "
                     f"{f(p['compute_per_step_s'] and p['compute_per_step_s'] * 1e3, '.1f')} | "
                     f"{f(p['utilization'], '.2f')} | {f(p['sync_share'], '.2f')} | {f(p['eval_share'], '.2f')} | "
                     f"{p['rounds']} | {p['resyncs']} |")
    s, (same, shared) = row["summary"], row["phi_agreement"]
    lines += ["", f"swarm: final held-out loss {f(s['final_loss'], '.4f')} "
              f"(spread {f(s['final_loss_spread'], '.4f')}), "
              f"wall {f(s['wall_s'], '.1f')} s, compute utilization {f(s['compute_utilization'], '.2f')}, "
              f"{s['bytes_sent'] / 1e6:.2f} MB sent; failed peers: {s['failed_peers'] or 'none'}",
              f"rounds with one φ hash on every peer that landed them: {same} of {shared}"
              + (" (NoLoCo keeps no shared φ)" if s["algo"] == "noloco" else "")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = gpu_device(args)
    if args.cpu_peers < 1:
        sys.exit("gpu_mixed: --cpu-peers must be at least 1 (a mixed swarm needs a CPU peer)")
    config = run_config(args)
    name = f"{config.run.algo}-{'cpu-only' if args.cpu_only else gpu.replace(':', '')}-cpu{args.cpu_peers}-s{args.seed}"
    args.out.mkdir(parents=True, exist_ok=True)
    kept = args.out / f"{name}.json"
    if kept.exists() and not args.again:
        row = json.loads(kept.read_text())
        print(f"kept row {kept} (--again runs it again)")
    else:
        from lowcomm.runtime.sim import Simulation  # the network stack loads only for a run

        run_dir = args.out / "runs" / name
        peers = 1 + args.cpu_peers
        devices = {0: gpu, **{i: "cpu" for i in range(1, peers)}}
        print(f"gpu_mixed: {config.run.algo}, peer 0 on {gpu}, peers 1-{peers - 1} on cpu, {config.run.steps} steps "
              f"each; records in {run_dir}", file=sys.stderr)
        report = Simulation(config, peers, run_dir, peer_flags={0: ["--device", gpu]}).run()
        records = read_records(run_dir / "peers")
        row = {"name": name, "gpu": gpu, "cpu_peers": args.cpu_peers, "steps": config.run.steps,
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "gpu_name": torch.cuda.get_device_name(torch.device(gpu)) if gpu != "cpu" else None,
               "summary": {k: report.get(k) for k in SUMMARY_KEYS}, "peers": peer_rows(records, devices),
               "phi_agreement": phi_agreement(records)}
        kept.write_text(json.dumps(row, indent=1))
    text = table(row)
    (args.out / "table.md").write_text(text)
    print(text, end="")
    return 1 if row["summary"]["failed_peers"] else 0


if __name__ == "__main__":
    sys.exit(main())
