"""The one-step-delay overlap's update rules against the plain algorithm, in one process (no network).

    python experiments/overlap_rules.py [--steps 2000] [--seeds 0] [--rules plain delayed momentum eager]
        [--outer-momentum MU] [--apply arrival|boundary] [--out experiments/out/overlap_rules]
    python experiments/overlap_rules.py --algo demo [--rules plain late eager] [--lr ETA] ...

A cell is (rule, seed): 4 replicas of the default model and config (the plain mean, as
experiments/compare_algorithms.py's cells) trained for --steps inner steps each by
lowcomm.runtime.in_process, the production replicas and combiner at the speed of the compute alone;
``plain`` is DiLoCo without overlap, the others set `diloco.overlap_update` (algorithms.overlap);
--outer-momentum sets `diloco.outer_momentum` for every cell (a lower momentum under delay); --apply sets
`diloco.overlap_apply` for the overlap's cells (when an arrived aggregate is applied: Decision 33).
With --algo demo the cells are DeMo's: ``plain`` without overlap, the others `demo.overlap` with that
`demo.overlap_update` (algorithms.demo_replica); --lr sets `demo.lr` for every cell.
A cell whose JSON exists is not run again (resumable per row); OUT/table.md is rewritten after every
cell, with the final held-out loss and its gap to the plain algorithm's at the same seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.algorithms.demo import OVERLAP_UPDATES as DEMO_UPDATES  # noqa: E402
from lowcomm.algorithms.overlap import UPDATES  # noqa: E402
from lowcomm.config import default_config  # noqa: E402
from lowcomm.runtime.in_process import run_in_process  # noqa: E402

PEERS = 4


def demo_keys(rule: str, lr: float | None) -> dict:
    keys = {"run.algo": "demo"} | ({} if lr is None else {"demo.lr": lr})
    return keys | ({} if rule == "plain" else {"demo.overlap": True, "demo.overlap_update": rule})


def run_cell(out: Path, rule: str, steps: int, seed: int, momentum: float | None, apply: str = "arrival",
             algo: str = "diloco", lr: float | None = None) -> dict:
    apply = "" if rule == "plain" or algo == "demo" else apply
    name = f"{rule}-{steps}-s{seed}{'' if momentum is None else f'-mu{momentum:g}'}{f'-{apply}' if apply else ''}"
    path = out / (f"demo-{name}{'' if lr is None else f'-lr{lr:g}'}.json" if algo == "demo" else f"{name}.json")
    if path.exists():
        return json.loads(path.read_text())
    keys = {"diloco.aggregate": "mean", "run.steps": steps, "run.seed": seed}
    if momentum is not None:
        keys["diloco.outer_momentum"] = momentum
    if algo == "demo":
        keys |= demo_keys(rule, lr)
    elif rule != "plain":
        keys |= {"diloco.overlap": True, "diloco.overlap_update": rule, "diloco.overlap_apply": apply}
    config = default_config().override(keys)
    t0 = time.time()
    run = run_in_process(config, peers=PEERS)
    result = {"rule": rule, "apply": apply, "steps": steps, "seed": seed, "loss": run.final_loss, "wall_s": round(time.time() - t0, 1),
              "outer_momentum": config.diloco.outer_momentum, "algo": algo, "lr": config.demo.lr if algo == "demo" else None}
    path.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict]) -> str:
    demo_lr = default_config().demo.lr

    def setting(r: dict) -> str:  # what the gap holds equal: DiLoCo's μ, DeMo's plain run at its default η
        return f"μ {r['outer_momentum']:g}" if r.get("algo", "diloco") == "diloco" else "DeMo"

    def baseline(r: dict) -> bool:
        return r["rule"] == "plain" and (r.get("algo", "diloco") == "diloco" or r["lr"] == demo_lr)

    plain = {(setting(r), r["steps"], r["seed"]): r["loss"] for r in results if baseline(r)}
    rows = ["| algorithm | rule | applied | outer momentum or η | steps | seeds | final held-out loss | gap vs plain |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        algo = r.get("algo", "diloco")
        knob = r["outer_momentum"] if algo == "diloco" else r["lr"]
        groups.setdefault((algo, r["rule"], r.get("apply", "boundary" if r["rule"] != "plain" else ""), knob,
                           r["steps"]), []).append(r)
    for (algo, rule, apply, knob, steps), rs in groups.items():
        losses = [r["loss"] for r in rs]
        gaps = [100 * (r["loss"] / plain[(setting(r), steps, r["seed"])] - 1) for r in rs
                if (setting(r), steps, r["seed"]) in plain]
        spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        gap = f"{statistics.mean(gaps):+.1f}%" if gaps and not baseline(rs[0]) else ""
        rows.append(f"| {algo} | {rule} | {apply or 'n/a'} | {knob:g} | {steps} | {','.join(str(r['seed']) for r in rs)} | "
                    f"{statistics.mean(losses):.4f}{spread} | {gap} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--algo", default="diloco", choices=["diloco", "demo"])
    parser.add_argument("--rules", nargs="+", default=None, choices=["plain", *UPDATES, *DEMO_UPDATES],
                        help="default: plain and every rule of --algo")
    parser.add_argument("--lr", type=float, default=None, help="demo.lr of every DeMo cell (default: the config's)")
    parser.add_argument("--outer-momentum", type=float, default=None)
    parser.add_argument("--apply", default="arrival", choices=["arrival", "boundary"])
    parser.add_argument("--out", type=Path, default=Path("experiments/out/overlap_rules"))
    args = parser.parse_args()
    rules = UPDATES if args.algo == "diloco" else DEMO_UPDATES
    args.rules = args.rules or ["plain", *rules]
    if not set(args.rules) <= {"plain", *rules}:
        parser.error(f"--algo {args.algo} has the rules plain, {', '.join(rules)}")
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(rule, seed) for seed in args.seeds for rule in args.rules]
    results, t0 = [], time.time()
    for i, (rule, seed) in enumerate(cells):
        print(f"[{i + 1}/{len(cells)}] {rule}, seed {seed} ...", flush=True)
        results.append(run_cell(args.out, rule, args.steps, seed, args.outer_momentum, args.apply, args.algo, args.lr))
        done = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]  # every cell of OUT
        (args.out / "table.md").write_text(table(done))
        left = len(cells) - i - 1
        print(f"  loss {results[-1]['loss']:.4f}; ETA {(time.time() - t0) / (i + 1) * left / 60:.0f} min "
              f"for {left} cells", flush=True)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
