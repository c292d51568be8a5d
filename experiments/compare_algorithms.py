"""Step 4's comparison: every algorithm against ddp on the reference model and data, loopback links.

    python experiments/compare_algorithms.py [--steps 2000] [--variants ...] [--seeds 0 1 2]
        [--peers 4] [--extra-peers 8] [--reuse experiments/out/backbone] [--out experiments/out/algorithms]

A cell is (variant, peers, seed): one `lowcomm simulate` run of --steps inner steps per peer. The
cells run in this order, so a session that ends early leaves the most useful table: every variant
with --peers peers and seed 0, then the other seeds, then --extra-peers peers with seed 0. A cell
whose report JSON exists is not run again (resumable per row); --reuse DIR takes `ddp-STEPS-pP-sS.json`
and `diloco-STEPS-pP-sS.json` from an earlier run of the same config (Step 1's backbone measurement)
instead of rerunning them. The table OUT/table.md, OUT/results.json and the loss plots are rewritten
after every cell from every finished cell of the whole grid (seeds 0-2, 4 and 8 peers, every variant),
whatever subset this run was given, with the grid's cells still missing listed.

Every cell averages the DiLoCo family's pseudo-gradients with the plain mean (BASE:
`diloco.aggregate = "mean"`), as the reference algorithms do; the robust default is measured by
experiments/byzantine.py.

Columns: final held-out loss (mean ± std over the seeds done), its gap to ddp's at the same peers
and seeds, bytes per token (everything the peers' gRPC sent, checkpoints apart), compression vs ddp,
the payload bound (the compression the method's payloads alone would give at its collective's
physical limit, from the codecs' exact sizes over the model's real tensor list: ddp's reduce of
4·numel bytes per step, 2(N−1)/N of it per peer, against a reduce's 2(N−1)/N, an all-gather's (N−1)
or NoLoCo's G−1 copies of one peer's payload per sync, over its steps per sync) and measured /
bound, the share of rounds every peer contributed to (a peer that announced too late is left out
and its round's steps are lost), compute utilization, the shares of the peers' wall time their
training loops spent in their syncs (codec work, network, DHT, bookkeeping) and evaluating the
held-out set (n/a for cells run before the peers logged them), and wall time. Time to ddp's loss over emulated links is measured by
experiments/vs_hivemind.py (namespace mode, the same algorithms).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.compress import get_codec  # noqa: E402
from lowcomm.config import ALGOS, default_config  # noqa: E402
from lowcomm.models.gpt import GPT  # noqa: E402
from lowcomm.runtime.plots import compare_reports  # noqa: E402

VARIANTS = {  # name: (run.algo, extra `simulate` flags[, run-config overrides])
    "ddp": ("ddp", []),
    "diloco": ("diloco", []),
    "diloco-overlap": ("diloco", ["--overlap"]),  # the default rule, momentum
    "diloco-overlap-delayed": ("diloco", ["--overlap"], {"diloco.overlap_update": "delayed"}),
    "diloco-overlap-eager": ("diloco", ["--overlap"], {"diloco.overlap_update": "eager"}),
    "diloco-overlap-projected": ("diloco", ["--overlap"], {"diloco.overlap_update": "projected"}),
    "diloco-overlap-lead0.1": ("diloco", ["--overlap"], {"diloco.overlap_lead": 0.1}),  # ⌈0.1·H⌉ = 3 of 30 steps
    "diloco-overlap-lead0.25": ("diloco", ["--overlap"], {"diloco.overlap_lead": 0.25}),  # 8 of 30
    "streaming-diloco": ("streaming-diloco", []),
    "demo": ("demo", []),
    "sparseloco": ("sparseloco", []),
    "sparseloco-overlap": ("sparseloco", ["--overlap"]),
    "noloco": ("noloco", []),
}


BASE = {"diloco.aggregate": "mean"}  # every cell: the reference algorithms' plain mean (no robust aggregate)


def available_variants() -> list[str]:
    return [name for name, (algo, *_) in VARIANTS.items() if algo in ALGOS]


# ---- the payload bound ----------------------------------------------------------------------------

def payload_per_sync(algo: str) -> tuple[float, int]:
    """(one peer's payload bytes per sync, inner steps per sync) from the codecs' exact sizes."""
    config = default_config().override({"run.algo": algo})
    shapes = [tuple(p.shape) for p in GPT(config.model).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    if algo == "ddp":
        return 4.0 * numel, 1
    if algo in ("diloco", "streaming-diloco"):  # streaming: P fragments per H steps, the whole model per H
        return float(get_codec(config.diloco.codec).raw_size((numel,))), config.diloco.inner_steps
    if algo == "sparseloco":
        return float(sum(config.sparseloco.codec_for(s).raw_size(s) for s in shapes)), config.sparseloco.inner_steps
    if algo == "demo":
        codec = config.demo.codec()
        return float(sum(codec.raw_size(s) for s in shapes)), 1
    if algo == "noloco":  # progress and φ
        codec = get_codec(getattr(config.noloco, "codec", "fp32"))
        return 2.0 * codec.raw_size((numel,)), config.noloco.inner_steps
    raise ValueError(f"no payload bound for {algo!r}")


def sent_per_step(algo: str, peers: int) -> float:
    """What one peer must send per inner step at its collective's physical limit (BENCHMARKS.md).

    A reduce of S sends 2(N−1)/N·S per peer (ddp, DiLoCo, Streaming DiLoCo); an all-gather of
    per-peer payloads S sends (N−1)·S (SparseLoCo, DeMo: sparse payloads are not reduced);
    NoLoCo sends its payload to each of the group's G − 1 others.
    """
    payload, steps = payload_per_sync(algo)
    if algo in ("sparseloco", "demo"):
        fan_out = peers - 1
    elif algo == "noloco":
        fan_out = default_config().noloco.group_size - 1
    else:
        fan_out = 2 * (peers - 1) / peers
    return fan_out * payload / steps


def bound_compression(algo: str, peers: int) -> float:
    """ddp's bytes over the method's, both at their collectives' limits: the best compression possible."""
    return sent_per_step("ddp", peers) / sent_per_step(algo, peers)


# ---- cells --------------------------------------------------------------------------------------

def cell_name(variant: str, steps: int, peers: int, seed: int) -> str:
    return f"{variant}-{steps}-p{peers}-s{seed}"


def run_cell(out: Path, variant: str, steps: int, peers: int, seed: int, reuse: Path | None) -> dict:
    path = out / f"{cell_name(variant, steps, peers, seed)}.json"
    if path.exists():
        return json.loads(path.read_text())
    if reuse is not None and (reuse / path.name).exists():
        shutil.copyfile(reuse / path.name, path)
        return json.loads(path.read_text())
    algo, flags, *overrides = VARIANTS[variant]
    tmp = path.with_suffix(".partial.json")
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--peers", str(peers), "--algo", algo, "--steps",
           str(steps), "--seed", str(seed), "--report", str(tmp), "--run-dir", str(out / "runs" / path.stem), *flags]
    config = out / "runs" / path.stem / "config.json"  # the embedded default run, BASE and the variant's keys
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(default_config().override(BASE | (overrides[0] if overrides else {})).to_dict(),
                                 indent=1))
    cmd += ["--config", str(config)]
    subprocess.run(cmd, check=True)
    tmp.replace(path)
    rename_figures(out, path.stem)
    return json.loads(path.read_text())


def rename_figures(out: Path, stem: str) -> None:
    """simulate names its figures after the report (`<cell>.partial.*`): give them the cell's name."""
    for figure in out.glob(f"{stem}.partial.*"):
        figure.replace(out / figure.name.replace(".partial.", ".", 1))


def cells(variants: list[str], steps: int, peers: int, seeds: list[int], extra_peers: list[int]) -> list[tuple]:
    order = [(v, steps, peers, seeds[0]) for v in variants]
    order += [(v, steps, peers, s) for s in seeds[1:] for v in variants]
    order += [(v, steps, n, seeds[0]) for n in extra_peers for v in variants]
    return order


# ---- the table -----------------------------------------------------------------------------------

def _mean_std(values: list[float], spec: str) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{statistics.mean(values):{spec}} ± {statistics.stdev(values):{spec}}"


def _shares(by_seed: dict[int, dict], seeds: list[int], key: str) -> str:
    """A share of the peers' wall time, over the seeds that measured it (cells before it was logged did not)."""
    values = [by_seed[s][key] for s in seeds if by_seed[s].get(key) is not None]
    return _mean_std(values, ".2f") if values else "n/a"


def _full_rounds(report: dict) -> float:
    """The share of the cell's rounds that every peer contributed to (the others left a late peer out)."""
    rounds = report["rounds"]
    return sum(len(r["contributors"]) == report["peers"] for r in rounds) / len(rounds) if rounds else 0.0


def table(results: dict[tuple, dict], missing: list[tuple]) -> str:
    lines = ["| variant | peers | seeds | final loss | gap vs ddp | bytes/token | compression vs ddp | payload bound "
             "| measured / bound | rounds with all peers | compute util. | waiting on syncs | evaluating | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, dict[int, dict]] = {}
    for (variant, steps, peers, seed), report in results.items():
        groups.setdefault((variant, steps, peers), {})[seed] = report
    for (variant, steps, peers), by_seed in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1],
                                                                                    list(VARIANTS).index(kv[0][0]))):
        ddp = groups.get(("ddp", steps, peers), {})
        seeds = sorted(by_seed)
        gaps = [by_seed[s]["final_loss"] / ddp[s]["final_loss"] - 1 for s in seeds if s in ddp]
        per_seed = [by_seed[s]["bytes_per_token"] for s in seeds]
        ddp_bpt = statistics.mean(ddp[s]["bytes_per_token"] for s in ddp) if ddp else None
        bound = bound_compression(VARIANTS[variant][0], peers)
        # Seeds run before and after a change of the collective's bytes (sparse bundles stopped
        # echoing a member's own part) get a figure each, not a mean of two protocols.
        split = max(per_seed) > 1.05 * min(per_seed)
        figures = per_seed if split else [statistics.mean(per_seed)]
        bpt_text = " / ".join(f"{b:.1f}" for b in figures)
        comp_text = " / ".join(f"{ddp_bpt / b:.0f}x" for b in figures) if ddp_bpt else "n/a"
        ratio_text = " / ".join(f"{ddp_bpt / b / bound:.2f}" for b in figures) if ddp_bpt else "n/a"
        lines.append(
            f"| {variant} | {peers} | {','.join(map(str, seeds))} | "
            f"{_mean_std([by_seed[s]['final_loss'] for s in seeds], '.4f')} | "
            f"{_mean_std([100 * g for g in gaps], '+.1f') + '%' if gaps and variant != 'ddp' else ''} | {bpt_text} | "
            f"{comp_text} | {bound:.0f}x | {ratio_text} | "
            f"{_mean_std([_full_rounds(by_seed[s]) for s in seeds], '.2f')} | "
            f"{_mean_std([by_seed[s]['compute_utilization'] for s in seeds], '.2f')} | "
            f"{_shares(by_seed, seeds, 'sync_wait_share')} | {_shares(by_seed, seeds, 'eval_share')} | "
            f"{statistics.mean(by_seed[s]['wall_s'] for s in seeds):.0f} |")
    text = "\n".join(lines) + "\n"
    if missing:
        text += "\nNot run yet: " + ", ".join(cell_name(*c) for c in missing) + "\n"
    return text


def plot(results: dict[tuple, dict], out: Path) -> None:
    for peers in sorted({c[2] for c in results}):
        chosen = {f"{c[0]} (seed {c[3]})": r for c, r in results.items() if c[2] == peers and c[3] == 0}
        if chosen:
            compare_reports(chosen, out / f"loss-p{peers}.png", f"{peers} peers, seed 0, loopback")


def write_outputs(out: Path, grid: list[tuple]) -> None:
    """table.md, results.json and the plots from every finished cell of the grid."""
    results = {c: json.loads((out / f"{cell_name(*c)}.json").read_text()) for c in grid
               if (out / f"{cell_name(*c)}.json").exists()}
    (out / "table.md").write_text(table(results, [c for c in grid if c not in results]))
    (out / "results.json").write_text(json.dumps({cell_name(*c): r for c, r in results.items()}, indent=1))
    plot(results, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--variants", nargs="+", default=available_variants(), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--extra-peers", type=int, nargs="*", default=[8])
    parser.add_argument("--reuse", type=Path, default=Path("experiments/out/backbone"))
    parser.add_argument("--out", type=Path, default=Path("experiments/out/algorithms"))
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    todo = cells(args.variants, args.steps, args.peers, args.seeds, args.extra_peers)
    # the table covers the whole grid, so a run of a few variants or seeds keeps the other rows
    grid = cells(available_variants(), args.steps, args.peers, sorted({0, 1, 2, *args.seeds}),
                 sorted({8, *args.extra_peers}))
    grid += [c for c in todo if c not in grid]
    started, ran = time.time(), 0
    for i, cell in enumerate(todo):
        path = args.out / f"{cell_name(*cell)}.json"
        if not args.table_only and not path.exists():
            t0 = time.time()
            reused = args.reuse is not None and (args.reuse / path.name).exists()
            print(f"[{i + 1}/{len(todo)}] {cell_name(*cell)} ...", flush=True)
            run_cell(args.out, *cell, reuse=args.reuse)
            if reused:  # not run: it says nothing about how long a cell takes
                started += time.time() - t0
            else:
                ran += 1
            left = sum(1 for c in todo[i + 1:] if not (args.out / f"{cell_name(*c)}.json").exists())
            print(f"[{i + 1}/{len(todo)}] {cell_name(*cell)} done in {time.time() - t0:.0f}s; "
                  f"ETA {(time.time() - started) / max(ran, 1) * left / 60:.0f} min for {left} cells", flush=True)
            write_outputs(args.out, grid)
    write_outputs(args.out, grid)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
