"""Step 1's measurement: `lowcomm simulate` with 4 peers, DiLoCo (uint8, H=30) against ddp at equal tokens.

    python experiments/backbone_diloco_vs_ddp.py [--steps 600 2000] [--peers 4] [--out experiments/out/backbone]

Each row (algo, steps) is one simulation whose report is kept as JSON; a row whose report exists
is not run again, so the script resumes where a killed session stopped. The markdown table is
rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run_row(out: Path, algo: str, steps: int, peers: int, seed: int) -> dict:
    report = out / f"{algo}-{steps}-p{peers}-s{seed}.json"
    if report.exists():
        return json.loads(report.read_text())
    tmp = report.with_suffix(".partial.json")
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--peers", str(peers), "--algo", algo, "--steps",
           str(steps), "--seed", str(seed), "--report", str(tmp), "--run-dir", str(out / "runs" / report.stem)]
    subprocess.run(cmd, check=True)
    tmp.replace(report)
    return json.loads(report.read_text())


def table(rows: dict) -> str:
    lines = ["| steps/peer | algo | final loss | loss gap vs ddp | bytes/token | compression vs ddp | compute util. | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (algo, steps), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ddp = rows.get(("ddp", steps))
        gap = f"{r['final_loss'] / ddp['final_loss'] - 1:+.1%}" if ddp else "n/a"
        comp = f"{ddp['bytes_per_token'] / r['bytes_per_token']:.0f}x" if ddp else "n/a"
        lines.append(f"| {steps} | {algo} | {r['final_loss']:.4f} | {gap} | {r['bytes_per_token']:.1f} | {comp} | "
                     f"{r['compute_utilization']:.2f} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[600, 2000])
    parser.add_argument("--algos", nargs="+", default=["diloco", "ddp"])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("experiments/out/backbone"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(a, s) for s in args.steps for a in args.algos]
    rows, started = {}, time.time()
    for i, (algo, steps) in enumerate(cells):
        t0 = time.time()
        rows[(algo, steps)] = run_row(args.out, algo, steps, args.peers, args.seed)
        done = i + 1
        eta = (time.time() - started) / done * (len(cells) - done)
        print(f"[{done}/{len(cells)}] {algo} {steps} steps: loss {rows[(algo, steps)]['final_loss']:.4f} "
              f"({time.time() - t0:.0f}s); ETA {eta / 60:.0f} min", flush=True)
        (args.out / "table.md").write_text(table(rows))
        (args.out / "results.json").write_text(json.dumps({f"{a}-{s}": r for (a, s), r in rows.items()}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
