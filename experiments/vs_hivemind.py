"""Side by side on the same emulated network: lowcomm ddp, lowcomm's low-communication algorithms and
hivemind.Optimizer(use_local_updates=True), training the reference model on the same data.

    sudo python experiments/vs_hivemind.py [--rates 100 20] [--ddp-steps 300] [--peers 4]
        [--systems ddp diloco hivemind] [--target-loss LOSS] [--out experiments/out/vs_hivemind]

Every row runs in namespace mode: each peer in its own network namespace with an htb cap of RATE
Mbit/s each way and no added latency (`lowcomm simulate --netns --link RATEmbit`; hivemind: the
same NetnsLab, one node per worker plus an uncapped node for its bootstrap DHT, as lowcomm's
coordinator). Bytes are what the peers' nodes put on their veth links (Ethernet frames, headers,
ACKs and DHT traffic included), counted the same way for every system; the bootstrap or
coordinator node is not counted.

ddp runs --ddp-steps steps per peer; its final held-out loss is the target (--target-loss gives it
instead, from an earlier ddp row, and ddp is not run). The others run up to 2x ddp's tokens
(hivemind: --hivemind-steps per peer where given, so that it can reach the target); a row's "time
to target" is the wall time (from the first training step) of its first held-out evaluation at or
below the target, its "bytes to target" what the peers had sent by then (interpolated in the ~1 s
samples of the veth counters), else "not reached".

Targets (BENCHMARKS.md): at 20 Mbit/s >= 5x faster than ddp to ddp's loss; at 100 Mbit/s >= 0.8 x
the ceiling (t_compute + t_ddp_sync) / t_compute measured in the ddp row; vs hivemind >= 3x less
time and >= 10x fewer bytes.

A row whose JSON exists under OUT/ is not run again (the script resumes a killed session); the
table OUT/table.md, OUT/results.json and the plots are rewritten after every row, from every row
under OUT/ (a run of a few --systems keeps the others' rows). Must run as root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.config import load_config  # noqa: E402
from lowcomm.runtime.plots import compare_reports  # noqa: E402
from lowcomm.transport.netns import NetnsLab  # noqa: E402

from experiments.sync_worker import touch  # noqa: E402

HIVEMIND_WORKER = REPO / "experiments" / "hivemind_worker.py"
BOOT_WORKER = REPO / "experiments" / "sync_worker.py"
LOWCOMM_ALGOS = ("ddp", "diloco", "sparseloco", "demo", "streaming-diloco", "noloco")
OVERLAP = "-overlap"  # `diloco-overlap`, `sparseloco-overlap`, `demo-overlap`: the algorithm with `simulate --overlap`
STARTUP_TIMEOUT_S = 600.0


def row_name(system: str, rate: int, steps: int, peers: int, seed: int = 0) -> str:
    return f"{system}-{rate}mbit-{steps}-p{peers}" + (f"-s{seed}" if seed else "")


# ---- lowcomm rows ------------------------------------------------------------------------------

def run_lowcomm(out: Path, algo: str, rate: int, steps: int, peers: int, seed: int) -> dict:
    name = row_name(algo, rate, steps, peers, seed)
    report_path = out / "runs" / f"{name}.report.json"
    base = algo.removesuffix(OVERLAP)
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--peers", str(peers), "--algo", base,
           "--steps", str(steps), "--seed", str(seed), "--netns", "--link", f"{rate}mbit",
           "--report", str(report_path), "--run-dir", str(out / "runs" / name)]
    subprocess.run(cmd + (["--overlap"] if base != algo else []), check=True)
    return lowcomm_row(out, report_path, algo, rate, steps, peers, seed)


def lowcomm_row(out: Path, report_path: Path, algo: str, rate: int, steps: int, peers: int, seed: int = 0) -> dict:
    report = json.loads(report_path.read_text())
    return {"system": f"lowcomm {algo}", "algo": algo, "rate_mbit": rate, "steps": steps, "peers": peers, "seed": seed,
            "final_loss": report["final_loss"], "tokens": report["tokens"], "wall_s": report["wall_s"],
            "compute_s": report["compute_s"], "wire_bytes": report["wire_bytes_peers"],
            # what the wire bytes hold besides the payloads: the DHT (p2pd) and the state the peers
            # served to the coordinator's checkpoints (hivemind's rows have neither checkpoints nor a split)
            "control_bytes": report["control_bytes"], "checkpoint_bytes": report["checkpoint_bytes"],
            "app_bytes": report["bytes_sent"],
            "evals": [{k: e[k] for k in ("t", "tokens", "loss")} for e in report["evals"]],
            "wire_timeline": report["wire_timeline"], "report": str(report_path.relative_to(out))}


# ---- hivemind rows -----------------------------------------------------------------------------

def _spawn(node, cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(node.wrap(cmd), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)


def _wait(paths: list[Path], procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p.args[-1] for p in procs if p.poll() not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'a process exited' if dead else 'timed out'}; "
                               f"missing {[p.name for p in paths if not p.exists()][:4]}")
        time.sleep(0.05)


def run_hivemind(out: Path, rate: int, steps: int, peers: int, config: str | None) -> dict:
    row_dir = out / "runs" / row_name("hivemind", rate, steps, peers)
    row_dir.mkdir(parents=True, exist_ok=True)
    for stale in row_dir.iterdir():
        stale.unlink()
    procs: list[subprocess.Popen] = []
    samples: list[tuple[float, int]] = []
    with NetnsLab() as lab:
        boot_node = lab.add_node("boot")
        workers = [lab.add_node(f"w{i}", rate=rate * 1e6) for i in range(peers)]
        try:
            procs.append(_spawn(boot_node, [sys.executable, str(BOOT_WORKER), "boot", "--system", "hivemind",
                                            "--dir", str(row_dir), "--host", boot_node.address], row_dir / "boot.log"))
            _wait([row_dir / "boot.json"], procs, STARTUP_TIMEOUT_S, "hivemind bootstrap")
            for i, node in enumerate(workers):
                cmd = [sys.executable, str(HIVEMIND_WORKER), "--dir", str(row_dir), "--index", str(i),
                       "--peers", str(peers), "--steps", str(steps), "--host", node.address]
                if config:
                    cmd += ["--config", config]
                procs.append(_spawn(node, cmd, row_dir / f"worker-{i}.log"))
            _wait([row_dir / f"ready-{i}" for i in range(peers)], procs, STARTUP_TIMEOUT_S, "hivemind workers")
            touch(row_dir / "go")
            deadline = time.monotonic() + max(3600.0, steps * 10.0)
            while any(p.poll() is None for p in procs[1:]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"hivemind workers still running after {steps * 10:.0f}s")
                samples.append((time.time(), sum(n.counters()["tx"] for n in workers)))
                time.sleep(1.0)
            samples.append((time.time(), sum(n.counters()["tx"] for n in workers)))
            failed = [i for i, p in enumerate(procs[1:]) if p.returncode != 0]
            if failed:
                raise RuntimeError(f"hivemind workers {failed} failed; see {row_dir}/worker-*.log")
        finally:
            touch(row_dir / "stop")
            _kill_groups(procs)
        wire = sum(n.counters()["tx"] for n in workers)
    logs = [[json.loads(line) for line in (row_dir / f"log-{i}.jsonl").read_text().splitlines()] for i in range(peers)]
    done = [next(r for r in log if r["type"] == "done") for log in logs]
    first_t = min(d["first_step_t"] for d in done)
    evals = [{"t": r["t"] - first_t, "tokens": r["tokens"], "loss": r["loss"]} for r in logs[0] if r["type"] == "eval"]
    final = sum(d["final_loss"] for d in done) / peers
    evals.append({"t": max(d["last_step_t"] for d in done) - first_t, "tokens": sum(d["tokens"] for d in done),
                  "loss": final, "final": True})
    return {"system": "hivemind", "algo": "hivemind", "rate_mbit": rate, "steps": steps, "peers": peers,
            "final_loss": final, "tokens": sum(d["tokens"] for d in done),
            "wall_s": max(d["last_step_t"] for d in done) - first_t, "compute_s": sum(d["compute_s"] for d in done),
            "wire_bytes": wire, "evals": evals, "epochs": [d["epoch"] for d in done],
            "wire_timeline": [{"t": t - first_t, "bytes": b} for t, b in samples]}


# ---- the table -----------------------------------------------------------------------------------

def bytes_at(timeline: list[dict], t: float) -> float | None:
    """What the peers had sent t seconds into training, interpolated between the counter samples."""
    before = [s for s in timeline if s["t"] <= t]
    after = [s for s in timeline if s["t"] >= t]
    if not before or not after:
        return None
    a, b = before[-1], after[0]
    if b["t"] == a["t"]:
        return float(a["bytes"])
    return a["bytes"] + (b["bytes"] - a["bytes"]) * (t - a["t"]) / (b["t"] - a["t"])


def to_target(row: dict, target: float) -> dict:
    """When (s from the first step), after how many bytes (sent from the first step on) and tokens the
    row's held-out loss first reached `target`; Nones if it never did."""
    hit = next((e for e in row["evals"] if e["loss"] <= target), None)
    if hit is None:
        return {"time_s": None, "bytes": None, "tokens": None}
    timeline = row["wire_timeline"]
    start = bytes_at(timeline, 0.0)
    start = timeline[0]["bytes"] if start is None else start
    sent = bytes_at(timeline, hit["t"])
    return {"time_s": hit["t"], "bytes": None if sent is None else sent - start, "tokens": hit["tokens"]}


def _fmt(x, spec: str, none: str = "not reached", unit: str = "") -> str:
    return none if x is None else format(x, spec) + unit


def _split(row: dict) -> str:
    if row.get("control_bytes") is None:
        return "n/a"
    return f"{row['control_bytes'] / row['wire_bytes']:.0%}, {row['checkpoint_bytes'] / row['wire_bytes']:.0%}"


def _mean(values: list) -> float | None:
    """The mean of the seeds that have a value (the table says how many reached ddp's loss)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _spread(values: list, spec: str) -> str:
    values = [v for v in values if v is not None]
    return f" ({format(min(values), spec)}-{format(max(values), spec)})" if len(values) > 1 else ""


def table(rows: dict, peers: int, target_loss: float | None = None) -> str:
    """One line per link and system; a system run with several seeds shows their mean (min-max), its time
    and bytes over the seeds that reached ddp's loss (how many did, if not all); ``target_loss`` stands
    for ddp's where no ddp row is under OUT."""
    lines = ["| link | system | seeds | steps/peer | final loss | time to ddp's loss s | wire bytes to it "
             "| speed-up vs ddp | vs hivemind: time, bytes | wire bytes/token | of all wire bytes: DHT, checkpoints "
             "| compute util. | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for rate in sorted({r["rate_mbit"] for r in rows.values()}, reverse=True):
        groups: dict[str, list[dict]] = {}
        for r in sorted((r for r in rows.values() if r["rate_mbit"] == rate), key=lambda r: r.get("seed", 0)):
            groups.setdefault(r["algo"], []).append(r)
        ddp = groups.get("ddp", [None])[0]
        hive = groups.get("hivemind", [None])[0]
        target = ddp["final_loss"] if ddp else target_loss
        hive_hit = to_target(hive, target) if hive and target is not None else None
        for algo in sorted(groups, key=lambda a: (a != "ddp", a == "hivemind", a)):
            group = groups[algo]
            hits = [to_target(r, target) if target is not None else {"time_s": None, "bytes": None} for r in group]
            times, sent = [h["time_s"] for h in hits], [h["bytes"] for h in hits]
            time_s, bytes_ = _mean(times), _mean(sent)
            speed = ddp["wall_s"] / time_s if ddp and time_s else None
            vs_h = "n/a"
            if hive_hit and time_s and algo not in ("hivemind", "ddp"):
                vs_h = (f"{hive_hit['time_s'] / time_s:.1f}x, {hive_hit['bytes'] / bytes_:.1f}x" if hive_hit["time_s"]
                        else "hivemind did not reach it")
            losses = [r["final_loss"] for r in group]
            utils = [r["compute_s"] / (r["peers"] * r["wall_s"]) for r in group if r["wall_s"]]
            per_token = _mean([r["wire_bytes"] / r["tokens"] for r in group])
            r = group[0]
            missed = sum(t is None for t in times)
            reached = f" ({len(times) - missed} of {len(times)} seeds reached it)" if missed and time_s else ""
            lines.append(f"| {rate} Mbit/s | {r['system']} | {','.join(str(g.get('seed', 0)) for g in group)} | "
                         f"{r['steps']} | {_mean(losses):.4f}{_spread(losses, '.3f')} | "
                         f"{_fmt(time_s, '.0f')}{_spread(times, '.0f')}{reached} | "
                         f"{_fmt(bytes_ and bytes_ / 1e6, '.1f', 'n/a', ' MB')} | "
                         f"{_fmt(speed, '.2f', 'n/a', 'x')} | {vs_h} | {per_token:.1f} | {_split(r)} | "
                         f"{_fmt(_mean(utils), '.2f', 'n/a')} | {_mean([g['wall_s'] for g in group]):.0f} |")
        if ddp is None and target is not None:
            notes.append(f"- {rate} Mbit/s: no ddp row here; the target loss {target:.4f} is given (--target-loss).")
        if ddp:
            per_step = ddp["wall_s"] / ddp["steps"]
            compute = ddp["compute_s"] / (ddp["peers"] * ddp["steps"])
            ceiling = per_step / compute
            notes.append(f"- {rate} Mbit/s: ddp's target loss {target:.4f}; a ddp step took {per_step:.3f} s of which "
                         f"{compute:.3f} s compute per peer: ceiling (t_compute + t_ddp_sync) / t_compute = "
                         f"{ceiling:.1f}x, 0.8 x ceiling = {0.8 * ceiling:.1f}x.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def plot(rows: dict, out: Path) -> list[Path]:
    written = []
    for rate in sorted({r["rate_mbit"] for r in rows.values()}):
        reports = {}
        for r in rows.values():
            if r["rate_mbit"] != rate or r.get("seed", 0):  # one curve per system: seed 0's
                continue
            evals = [{**e, "bytes": bytes_at(r["wire_timeline"], e["t"]) or r["wire_bytes"]}
                     for e in r["evals"] if not e.get("final")]
            reports[r["system"]] = {"evals": evals, "bytes_sent": r["wire_bytes"]}
        written.append(compare_reports(reports, out / f"loss-{rate}mbit.png",
                                       f"{rate} Mbit/s per peer, no added latency (bytes: veth frames of the peers)"))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=int, nargs="+", default=[100, 20], help="Mbit/s per peer, each way")
    parser.add_argument("--ddp-steps", type=int, default=300)
    parser.add_argument("--hivemind-steps", type=int, default=None,
                        help="steps per peer of the hivemind row (default: 2x --ddp-steps, as the lowcomm rows)")
    parser.add_argument("--systems", nargs="+", default=["ddp", "diloco", "sparseloco", "demo", "hivemind"],
                        choices=[*LOWCOMM_ALGOS, f"diloco{OVERLAP}", f"sparseloco{OVERLAP}", f"demo{OVERLAP}",
                                 "hivemind"],
                        help=f"hivemind and lowcomm algorithms: {', '.join(LOWCOMM_ALGOS)}; "
                             f"diloco{OVERLAP}, sparseloco{OVERLAP} and demo{OVERLAP} add `simulate --overlap`")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the --seeded systems")
    parser.add_argument("--seeded", nargs="+", default=["diloco", "sparseloco"],
                        help="systems run with every --seeds seed (the others with the first seed only)")
    parser.add_argument("--config", default=None, help="a lowcomm TOML for hivemind's workers (default: embedded)")
    parser.add_argument("--out", type=Path, default=Path("experiments/out/vs_hivemind"))
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="ddp's final loss from an earlier run: ddp is not run, times are to this loss")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load_config(args.config)  # a bad config fails here, before any namespace
    first = [] if args.target_loss is not None else ["ddp"]
    cells = [(s, r, seed) for r in args.rates for s in first + [s for s in args.systems if s != "ddp"]
             for seed in (args.seeds if s in args.seeded else args.seeds[:1])]
    started, ran = time.time(), 0

    def steps_of(system: str) -> int:
        if system == "ddp":
            return args.ddp_steps
        if system == "hivemind" and args.hivemind_steps:
            return args.hivemind_steps
        return 2 * args.ddp_steps

    for i, (system, rate, seed) in enumerate(cells):
        steps = steps_of(system)
        name = row_name(system, rate, steps, args.peers, seed)
        path = args.out / f"{name}.json"
        if not path.exists() and not args.table_only:
            t0 = time.time()
            print(f"[{i + 1}/{len(cells)}] {name} ...", flush=True)
            if system == "hivemind":
                row = run_hivemind(args.out, rate, steps, args.peers, args.config)
            else:
                row = run_lowcomm(args.out, system, rate, steps, args.peers, seed)
            path.write_text(json.dumps(row, indent=1))
            ran += 1
            left = sum(1 for s, r, sd in cells[i + 1:]
                       if not (args.out / f"{row_name(s, r, steps_of(s), args.peers, sd)}.json").exists())
            eta = (time.time() - started) / ran * left
            print(f"[{i + 1}/{len(cells)}] {name}: loss {row['final_loss']:.4f}, {time.time() - t0:.0f}s; "
                  f"ETA {eta / 60:.0f} min for {left} rows", flush=True)
        if path.exists():
            row = json.loads(path.read_text())
            report = args.out / row.get("report", "-")
            if system != "hivemind" and "control_bytes" not in row and report.exists():
                row = lowcomm_row(args.out, report, system, rate, steps, args.peers, seed)  # rows from before the split
                path.write_text(json.dumps(row, indent=1))
        write_outputs(args.out, args.peers, args.target_loss)
    print(write_outputs(args.out, args.peers, args.target_loss))


def write_outputs(out: Path, peers: int, target_loss: float | None = None) -> str:
    """table.md, results.json and the plots from every row under OUT (this run's and earlier ones)."""
    every = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob(f"*-p{peers}.json"))
             + sorted(out.glob(f"*-p{peers}-s*.json"))}
    text = table(every, peers, target_loss)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(every, indent=1))
    plot(every, out)
    return text


if __name__ == "__main__":
    main()
