"""The codec work of one DeMo step for one of 4 peers, through the collective's combiner, on one thread.

    python experiments/demo_step_codec.py [--runs 5] [--steps 10] [--out experiments/out/demo_step_codec]

The reference model's 53 tensors, 4 peers' residuals in one process (random gradients, seed 0), the
default `[demo]` config. A step per peer is what a training peer's CPU does besides its forward and
backward: ``compress_all`` (δ update, block DCT, top-k, payloads, error feedback), as the owner of one
of 4 shards ``SparseBundle.accept`` of the 4 members' parts (their validation), and as a member
``SparseBundle.finish`` of all 4 shards (decode every member's part, scatter-mean, inverse DCT), which
gives the aggregate: its own shard's bundle as it closed it, the 3 others as the other owners wrote
them. Each run times ``--steps`` steps after 2 warm-up steps; the table has every run's
mean ms per step and the sha256 of the last aggregate (equal across revisions when they compute the
same bytes). Compare revisions by running this file of one tree against another's package:
``PYTHONPATH=/path/to/worktree python experiments/demo_step_codec.py --out ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

import torch

from lowcomm.algorithms.demo import DemoConfig, DemoState, compress_all
from lowcomm.algorithms.demo_replica import combiner
from lowcomm.config import default_config
from lowcomm.models.factory import build_model

PEERS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("experiments/out/demo_step_codec"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = list(build_model(default_config().model, seed=0).parameters())
    config = DemoConfig()
    shapes = [tuple(p.shape) for p in params]
    codec, bundle, others = config.codec(), combiner(config, shapes), combiner(config, shapes)
    generator = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=generator) * 0.01 for p in params] for _ in range(PEERS)]
    states = [DemoState.zeros_like([p.detach() for p in params]) for _ in range(PEERS)]
    bounds = bundle.shard_bounds(PEERS, sum(p.numel() for p in params))

    def step() -> tuple[float, float, float, torch.Tensor]:
        t0 = time.perf_counter()
        payloads = [compress_all(states[w], grads[w], config, codec) for w in range(PEERS)]
        compressed = time.perf_counter()
        parts = [[bundle.encode(payloads[w], b) for b in bounds] for w in range(PEERS)]
        received = [others.close({f"p{w}": ((parts[w][j], None), 1.0) for w in range(PEERS)}, b)
                    for j, b in enumerate(bounds) if j > 0]  # the other owners' bundles (not timed)
        t1 = time.perf_counter()
        accepted = {f"p{w}": (bundle.accept(parts[w][0], bounds[0]), 1.0) for w in range(PEERS)}
        t2 = time.perf_counter()
        own = bundle.close(accepted, bounds[0])  # this peer owns shard 0
        shards = [bundle.finish(blob, b) for blob, b in zip([own] + received, bounds)]
        t3 = time.perf_counter()
        return (compressed - t0) / PEERS, t2 - t1, t3 - t2, torch.cat(shards)

    rows = []
    for run in range(args.runs):
        for _ in range(2):
            step()
        sums = [0.0, 0.0, 0.0]
        for _ in range(args.steps):
            *times, aggregate = step()
            sums = [s + t for s, t in zip(sums, times)]
        compress, accept, finish = (1000 * s / args.steps for s in sums)
        digest = hashlib.sha256(aggregate.numpy().tobytes()).hexdigest()[:16]
        rows.append((compress, accept, finish, compress + accept + finish, digest))
        print(f"run {run + 1}/{args.runs}: {rows[-1][3]:.1f} ms per step", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["| run | compress ms | owner accept ms | member finish ms | total ms | aggregate sha256 |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {i + 1} | {c:.1f} | {a:.1f} | {f:.1f} | {t:.1f} | {d} |" for i, (c, a, f, t, d) in enumerate(rows)]
    totals = [r[3] for r in rows]
    lines.append(f"\nmedian total {statistics.median(totals):.1f} ms, least {min(totals):.1f} ms "
                 f"({args.runs} runs of {args.steps} steps; {len(params)} tensors)")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
