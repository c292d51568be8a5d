"""Where DiLoCo's gap to ddp comes from: lowcomm's production path against a plain reference, factor by factor.

    python experiments/diloco_gap.py [--steps 2000] [--seeds 0 1 2] [--cells ...] [--jobs 2]
        [--out experiments/out/diloco_gap] [--table-only]

A cell is (variant, seed): 4 replicas of the default model and config trained for --steps inner
steps in this process (one core each cell; --jobs cells run side by side as child processes).

- ``ref-ddp``, ``ref-diloco``: the plain reference (tests/plain_diloco.py), written from the setup
  alone: fp32 mean, AdamW carried over, the numpy sampler lowcomm also uses.
- ``ref-diloco-torch-sampler``, ``ref-ddp-torch-sampler``: the same with another sampler (batches
  drawn from a torch generator): what the data order alone moves.
- ``ref-diloco-reset-inner``: a fresh AdamW every round (the inner optimizer's state).
- ``ref-ddp-with-tests``, ``ref-diloco-with-tests``: the reference on another corpus, every ``*.py``
  under the stdlib with its ``test``/``tests`` folders (lowcomm's corpus leaves them out; both skip
  site-packages): 31.5 M tokens instead of 12.6 M, the last 2% held out.
- ``ref-ddp-interleaved``, ``ref-diloco-interleaved``: replica r owns every 4th block of 4096 tokens
  (blocks r, r + 4, ...) instead of the r-th contiguous quarter: the same disjoint shards, each a
  sample of the whole corpus rather than of a quarter of its sorted paths.
- ``lowcomm-diloco-fp32``, ``lowcomm-diloco``, ``lowcomm-ddp``: the production path in process
  (lowcomm.runtime.in_process: the trainers, the registry's replicas, the sharded reduce's combiner
  calls) with the fp32 codec, the default one (uint8), and ddp.

Every cell scores its final global model on two held-out sets: lowcomm's (16 evenly spaced batches,
what every run reports) and the whole held-out split in non-overlapping windows; a DiLoCo cell also
scores replica 0's live θ after the last (partial) round. A cell whose JSON exists is skipped
(resumable per row); the table OUT/table.md is rewritten after every cell, with the multi-process
grid's cells (experiments/out/algorithms) beside it when their JSON is there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):  # tests/plain_diloco.py: the plain reference
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

VARIANTS = ("ref-ddp", "ref-diloco", "lowcomm-diloco-fp32", "lowcomm-diloco", "lowcomm-ddp",
            "ref-ddp-with-tests", "ref-diloco-with-tests", "ref-ddp-interleaved", "ref-diloco-interleaved",
            "ref-diloco-torch-sampler", "ref-ddp-torch-sampler", "ref-diloco-reset-inner")
DDP_OF = {"ref-diloco": "ref-ddp", "lowcomm-diloco-fp32": "ref-ddp", "lowcomm-diloco": "ref-ddp",
          "ref-diloco-torch-sampler": "ref-ddp-torch-sampler", "ref-diloco-reset-inner": "ref-ddp",
          "grid diloco (processes)": "grid ddp (processes)", "lowcomm-ddp": "ref-ddp",
          "ref-diloco-with-tests": "ref-ddp-with-tests", "ref-diloco-interleaved": "ref-ddp-interleaved"}
GRID = REPO / "experiments" / "out" / "algorithms"


def run_cell(variant: str, seed: int, steps: int) -> dict:
    import torch

    from lowcomm.config import default_config
    from lowcomm.data.corpus import load_corpus
    from lowcomm.data.loader import evaluate, heldout_batches
    from lowcomm.models.gpt import GPT
    from lowcomm.runtime.in_process import run_in_process
    import plain_diloco as plain

    torch.set_num_threads(1)
    config = default_config().override({"run.steps": steps, "run.seed": seed})
    corpus = with_tests_corpus(config.data.holdout_fraction) if "with-tests" in variant else load_corpus(config.data)
    small_set = heldout_batches(corpus.heldout, config.model.context, config.inner.batch_size,
                                config.data.eval_batches)

    def scores(model, prefix=""):
        return {f"{prefix}loss": evaluate(model, small_set),
                f"{prefix}loss_full": plain.heldout_loss(model, corpus.heldout, config.model.context)}

    t0 = time.time()
    out: dict = {"variant": variant, "seed": seed, "steps": steps}
    if variant.startswith("ref-"):
        setup = plain.Setup(steps=steps, seed=seed, sampler="torch" if "torch-sampler" in variant else "numpy",
                            reset_inner="reset-inner" in variant,
                            sharding="interleaved" if "interleaved" in variant else "contiguous")
        make = lambda: GPT(config.model)  # noqa: E731
        if variant.startswith("ref-ddp"):
            out.update(scores(plain.ddp(make, corpus.train, setup)))
        else:
            phi, replicas = plain.diloco(make, corpus.train, setup)
            out.update(scores(phi))
            out.update(scores(replicas[0], "theta_"))
    else:
        algo = "ddp" if variant == "lowcomm-ddp" else "diloco"
        overrides = {"run.algo": algo} | ({"diloco.codec": "fp32"} if variant.endswith("fp32") else {})
        run = run_in_process(config.override(overrides), peers=4)
        with run.replicas[0].global_model() as model:
            out.update(scores(model))
        if algo == "diloco":
            out.update(scores(run.trainers[0].model, "theta_"))
        out["reported_loss"] = run.final_loss
        out["rounds"] = len(run.rounds)
    out["wall_s"] = time.time() - t0
    return out


def with_tests_corpus(holdout_fraction: float):
    """The stdlib's *.py with its test folders (site-/dist-packages skipped), byte-level, cached in OUT/tmp."""
    import os
    import sysconfig
    import types

    import numpy as np

    cache = REPO / "experiments" / "out" / "tmp" / "stdlib-with-tests.u16"
    if not cache.exists():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        found = []
        for directory, subdirs, files in os.walk(stdlib):
            subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
            found += [Path(directory, f).relative_to(stdlib) for f in files if f.endswith(".py")]
        text = b"\n".join((stdlib / rel).read_bytes() for rel in sorted(found, key=lambda p: p.as_posix()))
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        np.frombuffer(text, dtype=np.uint8).astype("<u2").tofile(tmp)
        os.replace(tmp, cache)
    tokens = np.memmap(cache, dtype="<u2", mode="r")
    split = len(tokens) - int(round(len(tokens) * holdout_fraction))
    return types.SimpleNamespace(train=tokens[:split], heldout=tokens[split:])


# ---- the table -----------------------------------------------------------------------------------

def _grid_cells(steps: int) -> dict:
    found = {}
    for algo in ("ddp", "diloco"):
        for path in GRID.glob(f"{algo}-{steps}-p4-s*.json"):
            report = json.loads(path.read_text())
            seed = int(path.stem.rsplit("-s", 1)[1])
            found[(f"grid {algo} (processes)", seed)] = {"loss": report["final_loss"]}
    return found


def _mean_std(values: list[float], fmt: str, pct: bool = False) -> str:
    if not values:
        return "n/a"
    scale, unit = (100.0, "%") if pct else (1.0, "")
    mean = statistics.mean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    sign = "+" if pct and mean >= 0 else ""
    return f"{sign}{mean:{fmt}}{unit} ± {std:{fmt}}{unit}"


def write_table(out: Path, steps: int) -> str:
    cells = {(c["variant"], c["seed"]): c for c in (json.loads(p.read_text()) for p in out.glob("*.json"))
             if c.get("steps") == steps}
    cells |= _grid_cells(steps)
    lines = ["| variant | seeds | loss (16 batches) | gap vs its ddp | loss (whole held-out) | gap (whole held-out) "
             "| live θ gap (16 batches) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    names = list(VARIANTS) + ["grid ddp (processes)", "grid diloco (processes)"]
    for name in names:
        seeds = sorted(s for v, s in cells if v == name)
        if not seeds:
            continue
        base = DDP_OF.get(name)
        row = [cells[(name, s)] for s in seeds]

        def gaps(key: str, row=row, seeds=seeds, base=base) -> list[float]:
            """key's gap to the same seed's ddp (a θ loss against ddp's loss on the same set)."""
            ddp_key = key.removeprefix("theta_")
            return [c[key] / cells[(base, s)][ddp_key] - 1 for c, s in zip(row, seeds)
                    if key in c and (base, s) in cells and ddp_key in cells[(base, s)]]

        full = [c["loss_full"] for c in row if "loss_full" in c]
        lines.append(f"| {name} | {','.join(map(str, seeds))} | {_mean_std([c['loss'] for c in row], '.4f')} | "
                     f"{_mean_std(gaps('loss'), '.2f', True) if base else ''} | {_mean_std(full, '.4f')} | "
                     f"{_mean_std(gaps('loss_full'), '.2f', True) if base and full else ''} | "
                     f"{_mean_std(gaps('theta_loss'), '.2f', True) if any('theta_loss' in c for c in row) else ''} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--cells", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "diloco_gap")
    ap.add_argument("--table-only", action="store_true", help="rewrite OUT/table.md from the cells done")
    ap.add_argument("--cell", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cell:
        variant, seed = args.cell[0], int(args.cell[1])
        result = run_cell(variant, seed, args.steps)
        (args.out / f"{variant}-{args.steps}-s{seed}.json").write_text(json.dumps(result, indent=1))
        return 0
    if args.table_only:
        print(write_table(args.out, args.steps))
        return 0
    todo = [(v, s) for s in args.seeds for v in args.cells
            if not (args.out / f"{v}-{args.steps}-s{s}.json").exists()]
    print(f"{len(todo)} cells to run, {args.jobs} at a time", flush=True)
    t_start, done_s = time.time(), []

    def cell(v: str, s: int) -> tuple[str, int, float]:
        t0 = time.time()
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--out", str(args.out), "--cell", v, str(s)]
        return f"{v} s{s}", subprocess.run(cmd).returncode, time.time() - t0

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for i, future in enumerate(as_completed([pool.submit(cell, v, s) for v, s in todo])):
            name, rc, took = future.result()
            done_s.append(took)
            left = len(todo) - i - 1
            eta = statistics.mean(done_s) * left / args.jobs
            print(f"{name}: {'done' if rc == 0 else f'failed ({rc})'} in {took:.0f} s; {left} left, "
                  f"ETA {eta / 60:.0f} min", flush=True)
            print(write_table(args.out, args.steps), flush=True)
    print(write_table(args.out, args.steps), flush=True)
    print(f"all cells in {(time.time() - t_start) / 60:.0f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
