"""Step 5's experiment: losing a whole pipeline stage, and rebalancing peers of unequal speed.

    python experiments/stage_failure.py [--steps 240] [--kill-round 4] [--checkpoint-every 3]
        [--parts failure rebalance] [--out experiments/out/stage_failure]

Failure (3 stages × 2 peers, model d_model 128 with one block per stage, DiLoCo inside each stage):
  none        no failure
  checkfree   both peers of stage 1 killed at round --kill-round, two fresh peers join at once; the
              empty stage is rebuilt from its neighbours (ALGORITHMS.md §6)
  checkpoint  the same failure, and the restart baseline: every stage goes back to the newest round
              all stages have a checkpoint of (written every --checkpoint-every rounds by each
              stage's round leader; runtime.stage_checkpoints)
  The failure rows run up to --failure-budget times the no-failure run's microbatches per driver
  (BENCHMARKS.md: a time-to-target run continues up to 2x the tokens and says "not reached" otherwise).
  Metric: wall time from the first training step until the held-out loss first reaches the no-failure
  run's final loss, and the final loss.

Rebalance (2 stages, 4 peers; every peer's compute is stretched --base-slowdown times, so the stages'
capacity, not the 2 shared cores, bounds the pipeline; peers 2 and 3 are --slow times slower still):
  bad-static    fast peers on stage 0, slow ones on stage 1, no rebalancing
  rebalanced    the same start, throughput-based rebalancing every 2 rounds
  best-static   the assignment pipeline.rebalance.best_static_assignment picks, no rebalancing
  Metric: pipeline throughput (microbatches per second, all drivers) over the second half of the
  run, before the first driver finished; the target is rebalanced ≥ 0.9 × best-static.

Each row is one `simulate` run whose report is kept as OUT/<row>.json; a row whose report exists is
not run again (resumable), and the table OUT/table.md, OUT/results.json and OUT/loss.png are
rewritten after every row with the rows still missing listed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.config import default_config  # noqa: E402
from lowcomm.pipeline.rebalance import best_static_assignment  # noqa: E402
from lowcomm.runtime.sim import Simulation  # noqa: E402

FAILURE_ROWS = ("none", "checkfree", "checkpoint")
REBALANCE_ROWS = ("bad-static", "rebalanced", "best-static")


def base_config(stages: int, steps: int, layers: int, **extra):
    return default_config().override({
        "run.steps": steps, "model.n_layers": layers, "pipeline.stages": stages, "pipeline.round_s": 10.0,
        "pipeline.rebalance_every_rounds": 0, "sync.announce_s": 1.0, "data.eval_batches": 8,
        "checkpoint.every_rounds": 0, **extra})


def failure_run(row: str, args) -> tuple:
    extra, steps = {}, args.steps
    if row != "none":
        extra["churn.spec"] = f"killstage:1@r{args.kill_round},join:2@r{args.kill_round}"
        steps = round(args.steps * args.failure_budget)
    if row == "checkpoint":
        extra.update({"pipeline.recovery": "checkpoint", "pipeline.checkpoint_every_rounds": args.checkpoint_every})
    return base_config(3, steps, 3, **extra), 6, {}


def rebalance_run(row: str, args) -> tuple:
    slowdowns = {i: args.base_slowdown * (args.slow if i >= 2 else 1.0) for i in range(4)}
    if row == "best-static":
        assignment, _ = best_static_assignment({str(i): 1 / slowdowns[i] for i in range(4)}, 2)
        stage_of = {int(p): s for p, s in assignment.items()}
    else:
        stage_of = {0: 0, 1: 0, 2: 1, 3: 1}
    every = 2 if row == "rebalanced" else 0
    return base_config(2, args.steps, 4, **{"pipeline.rebalance_every_rounds": every}), 4, {
        "stage_of": stage_of, "slowdowns": slowdowns}


def run_row(out: Path, row: str, args) -> dict:
    config, peers, kwargs = (failure_run if row in FAILURE_ROWS else rebalance_run)(row, args)
    sim = Simulation(config, peers, out / "runs" / row, progress=True, timeout_s=3600, **kwargs)
    report = sim.run()
    report["row"], report["stage_of"] = row, kwargs.get("stage_of")
    (out / f"{row}.json").write_text(json.dumps(report, indent=1))
    return report


# ---- figures from the reports -------------------------------------------------------------------

def time_to_loss(report: dict, target: float) -> float:
    return next((e["t"] for e in report["evals"] if e["loss"] <= target), math.inf)


def pipeline_throughput(report: dict, run_dir: Path) -> float:
    """Microbatches per second, all drivers together, between the run's midpoint and the first driver done."""
    from lowcomm.runtime.runlog import read_records

    series: dict[str, list[tuple[float, int]]] = {}
    for r in read_records(run_dir / "peers"):
        if r["type"] == "compute":
            series.setdefault(r["peer"], []).append((r["last_step_t"], r["steps"]))
    start = min(r["first_step_t"] for r in read_records(run_dir / "peers") if r["type"] == "compute")
    end = min(points[-1][0] for points in series.values())
    mid = start + (end - start) / 2

    def steps_at(points, t):
        before = [s for when, s in points if when <= t]
        return before[-1] if before else 0

    return sum(steps_at(p, end) - steps_at(p, mid) for p in series.values()) / max(end - mid, 1e-9)


def table(results: dict[str, dict], out: Path, missing: list[str]) -> str:
    lines = []
    if any(r in results for r in FAILURE_ROWS):
        target = results.get("none", {}).get("final_loss")
        lines += ["| stage 1 lost | final loss | tokens | time to the no-failure loss | restart's time / this | "
                  "recover events |", "| --- | --- | --- | --- | --- | --- |"]
        restart = time_to_loss(results["checkpoint"], target) if "checkpoint" in results and target else None
        for row in FAILURE_ROWS:
            if row not in results:
                continue
            r = results[row]
            t = time_to_loss(r, target) if target else math.inf
            vs = ""
            if row == "checkfree" and restart is not None and math.isfinite(t):
                vs = f"{restart / t:.2f}x" if math.isfinite(restart) else "restart: not reached"
            rec = ", ".join(f"{e['method']} ({e['t']:.0f} s)" for e in r["events"] if e["kind"] == "recover")
            reached = f"{t:.0f} s" if math.isfinite(t) else "not reached"
            lines.append(f"| {row} | {r['final_loss']:.4f} | {r['tokens'] / 1e6:.2f} M | {reached} | {vs} | {rec} |")
        lines.append("")
    if any(r in results for r in REBALANCE_ROWS):
        lines += ["| placement | stages (by peer index) | moves | microbatches/s | vs best static |",
                  "| --- | --- | --- | --- | --- |"]
        best = (pipeline_throughput(results["best-static"], out / "runs" / "best-static")
                if "best-static" in results else None)
        for row in REBALANCE_ROWS:
            if row not in results:
                continue
            r = results[row]
            rate = pipeline_throughput(r, out / "runs" / row)
            moves = [f"{e['previous']}→{e['stage']}" for e in r["events"] if e["kind"] == "rebalance"]
            lines.append(f"| {row} | {r.get('stage_of')} | {', '.join(moves) or 'none'} | {rate:.2f} | "
                         f"{rate / best:.2f} |" if best else f"| {row} | {r.get('stage_of')} | {moves} | {rate:.2f} | |")
        lines.append("")
    if missing:
        lines.append(f"Not run yet: {', '.join(missing)}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in FAILURE_ROWS if r in results]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        evals = results[row]["evals"]
        ax.plot([e["t"] for e in evals], [e["loss"] for e in evals], marker=".", label=row)
        for e in results[row]["events"]:
            if e["kind"] == "recover":
                ax.axvline(e["t"], linestyle=":", color=ax.lines[-1].get_color())
    if "none" in results:
        ax.axhline(results["none"]["final_loss"], color="grey", linewidth=0.8)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out loss")
    ax.set_title("stage 1 of 3 lost (dotted: rebuilt)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=360, help="microbatches per driver")
    parser.add_argument("--kill-round", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--failure-budget", type=float, default=2.0,
                        help="the failure rows' microbatches per driver, as a multiple of --steps")
    parser.add_argument("--slow", type=float, default=3.0)
    parser.add_argument("--base-slowdown", type=float, default=4.0)
    parser.add_argument("--parts", nargs="+", default=["failure", "rebalance"], choices=["failure", "rebalance"])
    parser.add_argument("--out", type=Path, default=Path("experiments/out/stage_failure"))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [*(FAILURE_ROWS if "failure" in args.parts else ()), *(REBALANCE_ROWS if "rebalance" in args.parts else ())]
    results, started, ran = {}, time.time(), 0
    for i, row in enumerate(todo):
        path = args.out / f"{row}.json"
        if not args.table_only and not path.exists():
            t0 = time.time()
            print(f"[{i + 1}/{len(todo)}] {row} ...", flush=True)
            run_row(args.out, row, args)
            ran += 1
            left = sum(1 for r in todo[i + 1:] if not (args.out / f"{r}.json").exists())
            print(f"[{i + 1}/{len(todo)}] {row} done in {time.time() - t0:.0f}s; ETA "
                  f"{(time.time() - started) / ran * left / 60:.0f} min for {left} rows", flush=True)
        if path.exists():
            results[row] = json.loads(path.read_text())
        missing = [r for r in todo if not (args.out / f"{r}.json").exists()]
        (args.out / "table.md").write_text(table(results, args.out, missing))
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        plot(results, args.out)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
