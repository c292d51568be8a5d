"""The one-step-delay overlap's update rules against plain DiLoCo, in one process (no network).

    python experiments/overlap_rules.py [--steps 2000] [--seeds 0] [--rules plain delayed momentum eager]
        [--outer-momentum MU] [--apply arrival|boundary] [--out experiments/out/overlap_rules]

A cell is (rule, seed): 4 replicas of the default model and config (the plain mean, as
experiments/compare_algorithms.py's cells) trained for --steps inner steps each by
lowcomm.runtime.in_process, the production replicas and combiner at the speed of the compute alone;
``plain`` is DiLoCo without overlap, the others set `diloco.overlap_update` (algorithms.overlap);
--outer-momentum sets `diloco.outer_momentum` for every cell (a lower momentum under delay); --apply sets
`diloco.overlap_apply` for the overlap's cells (when an arrived aggregate is applied: Decision 33).
A cell whose JSON exists is not run again (resumable per row); OUT/table.md is rewritten after every
cell, with the final held-out loss and its gap to plain DiLoCo's at the same seed.
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

from lowcomm.algorithms.overlap import UPDATES  # noqa: E402
from lowcomm.config import default_config  # noqa: E402
from lowcomm.runtime.in_process import run_in_process  # noqa: E402

PEERS = 4


def run_cell(out: Path, rule: str, steps: int, seed: int, momentum: float | None, apply: str = "arrival") -> dict:
    apply = "" if rule == "plain" else apply
    path = out / f"{rule}-{steps}-s{seed}{'' if momentum is None else f'-mu{momentum:g}'}{f'-{apply}' if apply else ''}.json"
    if path.exists():
        return json.loads(path.read_text())
    keys = {"diloco.aggregate": "mean", "run.steps": steps, "run.seed": seed}
    if momentum is not None:
        keys["diloco.outer_momentum"] = momentum
    if rule != "plain":
        keys |= {"diloco.overlap": True, "diloco.overlap_update": rule, "diloco.overlap_apply": apply}
    t0 = time.time()
    run = run_in_process(default_config().override(keys), peers=PEERS)
    result = {"rule": rule, "apply": apply, "steps": steps, "seed": seed, "loss": run.final_loss, "wall_s": round(time.time() - t0, 1),
              "outer_momentum": default_config().override(keys).diloco.outer_momentum}
    path.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict]) -> str:
    plain = {(r["steps"], r["seed"], r["outer_momentum"]): r["loss"] for r in results if r["rule"] == "plain"}
    rows = ["| rule | applied | outer momentum | steps | seeds | final held-out loss | gap vs plain DiLoCo (same μ) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["rule"], r.get("apply", "boundary" if r["rule"] != "plain" else ""), r["outer_momentum"],
                           r["steps"]), []).append(r)
    for (rule, apply, mu, steps), rs in groups.items():
        losses = [r["loss"] for r in rs]
        gaps = [100 * (r["loss"] / plain[(steps, r["seed"], mu)] - 1) for r in rs if (steps, r["seed"], mu) in plain]
        spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        gap = f"{statistics.mean(gaps):+.1f}%" if gaps and rule != "plain" else ""
        rows.append(f"| {rule} | {apply or 'n/a'} | {mu:g} | {steps} | {','.join(str(r['seed']) for r in rs)} | "
                    f"{statistics.mean(losses):.4f}{spread} | {gap} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rules", nargs="+", default=["plain", *UPDATES], choices=["plain", *UPDATES])
    parser.add_argument("--outer-momentum", type=float, default=None)
    parser.add_argument("--apply", default="arrival", choices=["arrival", "boundary"])
    parser.add_argument("--out", type=Path, default=Path("experiments/out/overlap_rules"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(rule, seed) for seed in args.seeds for rule in args.rules]
    results, t0 = [], time.time()
    for i, (rule, seed) in enumerate(cells):
        print(f"[{i + 1}/{len(cells)}] {rule}, seed {seed} ...", flush=True)
        results.append(run_cell(args.out, rule, args.steps, seed, args.outer_momentum, args.apply))
        done = [json.loads(p.read_text()) for p in sorted(args.out.glob("*.json"))]  # every cell of OUT
        (args.out / "table.md").write_text(table(done))
        left = len(cells) - i - 1
        print(f"  loss {results[-1]['loss']:.4f}; ETA {(time.time() - t0) / (i + 1) * left / 60:.0f} min "
              f"for {left} cells", flush=True)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
