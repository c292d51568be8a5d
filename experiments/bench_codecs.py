"""Step 2's measurement: what every codec costs, beside a plain copy of the same tensor.

    python experiments/bench_codecs.py [--sizes 1 16 64] [--out experiments/out/codecs] [--threads 1]

Table 1, per codec and tensor size (M float32 elements, 2-D square-ish): compression ratio
(float32 bytes / encoded bytes), encode and decode throughput in GB/s of float32 input, and
`dst.copy_(src)` throughput of the same tensor in the same process (the one-pass-over-memory
limit of BENCHMARKS.md).

Table 2, the target of BENCHMARKS.md: on the reference model (0.87M parameters, one tensor per
parameter), the codec time of one sync against the compute time of the round it belongs to
(H = 30 inner steps for DiLoCo-style codecs; one step for DeMo's dct-topk, which syncs every
step). One sync = encode every parameter once, plus receiving N−1 = 3 peers' payloads: for the
dense codecs 3 decodes (the all-gather worst case), for the sparse codecs what DeMo and
SparseLoCo do: 3 `decode_sparse`, one `scatter_mean` and one `inverse`. Measured with the same trainer a peer runs, one torch thread like a peer.

Each row is saved to results.json as it finishes and skipped on a rerun, so a killed run resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from lowcomm.compress import SparseCodec, get_codec, scatter_mean

CODECS: dict[str, tuple[str, dict]] = {
    "dense fp32": ("dense", {}),
    "dense bf16": ("dense", {"dtype": "bfloat16"}),
    "uint8": ("uint8", {}),
    "fp8": ("fp8", {}),
    "q2": ("q2", {}),
    "topk k64/4096 q2": ("topk", {"k": 64}),
    "dct-topk k32 fp32": ("dct-topk", {"k": 32}),
    "dct-topk k32 sign": ("dct-topk", {"k": 32, "sign": True}),
}
PER_STEP_CODECS = {"dct-topk k32 fp32", "dct-topk k32 sign"}  # DeMo syncs every optimizer step
SHAPES = {1: (1024, 1024), 16: (4096, 4096), 64: (8192, 8192)}
ROUND_STEPS = 30
GATHER_PEERS = 3


def best_time(fn, budget_s: float = 3.0, max_reps: int = 5) -> float:
    """Minimum wall time of ``fn`` over a few repetitions (the least-disturbed run on a shared machine)."""
    t0 = time.perf_counter()
    fn()
    best = time.perf_counter() - t0
    reps = min(max_reps, max(0, int(budget_s / max(best, 1e-9))))
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def throughput_row(label: str, size_m: int) -> dict:
    name, params = CODECS[label]
    codec = get_codec(name, **params)
    torch.manual_seed(0)
    x = torch.randn(SHAPES[size_m])
    nbytes = 4 * x.numel()
    dst = torch.empty_like(x)
    copy_s = best_time(lambda: dst.copy_(x))
    blob = codec.encode(x)
    encode_s = best_time(lambda: codec.encode(x))
    decode_s = best_time(lambda: codec.decode(blob))
    return {"codec": label, "size_m": size_m, "shape": list(x.shape), "encoded_bytes": len(blob),
            "ratio": nbytes / len(blob), "encode_s": encode_s, "decode_s": decode_s, "copy_s": copy_s,
            "encode_gbs": nbytes / encode_s / 1e9, "decode_gbs": nbytes / decode_s / 1e9,
            "copy_gbs": 2 * nbytes / copy_s / 1e9}


def measure_step_s() -> tuple[float, list[torch.Tensor]]:
    from lowcomm.config import default_config
    from lowcomm.runtime.trainer import LocalTrainer

    trainer = LocalTrainer(default_config(), 0, 4, torch.device("cpu"))
    for step in range(5):  # warm-up
        trainer.forward_backward()
        trainer.optimizer_step(step)
    t0 = time.perf_counter()
    for step in range(ROUND_STEPS):
        trainer.forward_backward()
        trainer.optimizer_step(step)
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return (time.perf_counter() - t0) / ROUND_STEPS, params


def model_row(label: str, params: list[torch.Tensor], step_s: float) -> dict:
    name, kwargs = CODECS[label]
    codec = get_codec(name, **kwargs)
    torch.manual_seed(0)
    deltas = [torch.randn_like(p) * 1e-3 for p in params]
    blobs = [codec.encode(d) for d in deltas]
    encode_s = best_time(lambda: [codec.encode(d) for d in deltas])
    if isinstance(codec, SparseCodec):
        # How DeMo and SparseLoCo aggregate: the peers' sparse payloads are scatter-meaned in the
        # codec's domain, then transformed back once.
        def aggregate() -> None:
            for blob in blobs:
                contributions = [codec.decode_sparse(blob)[:2] for _ in range(GATHER_PEERS)]
                codec.inverse(scatter_mean(contributions, codec.decode_sparse(blob)[2]))
        decode_s = best_time(aggregate)
        sync_s = encode_s + decode_s
    else:
        decode_s = best_time(lambda: [codec.decode(b) for b in blobs])
        sync_s = encode_s + GATHER_PEERS * decode_s
    steps = 1 if label in PER_STEP_CODECS else ROUND_STEPS
    dense = sum(4 * d.numel() for d in deltas)
    return {"codec": label, "tensors": len(deltas), "params": sum(d.numel() for d in deltas),
            "ratio": dense / sum(len(b) for b in blobs), "encode_s": encode_s, "decode_s": decode_s,
            "codec_s_per_sync": sync_s, "round_steps": steps, "round_compute_s": steps * step_s,
            "fraction_of_compute": sync_s / (steps * step_s)}


def write_tables(out: Path, results: dict) -> None:
    lines = ["| codec | elements | ratio | encode GB/s | decode GB/s | copy GB/s | encode ÷ copy time |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(k for k in results if k.startswith("tp/")):
        r = results[key]
        lines.append(f"| {r['codec']} | {r['size_m']}M | {r['ratio']:.1f}x | {r['encode_gbs']:.2f} | "
                     f"{r['decode_gbs']:.2f} | {r['copy_gbs']:.2f} | {r['encode_s'] / r['copy_s']:.0f} |")
    model = [results[k] for k in sorted(results) if k.startswith("model/")]
    if model:
        step = results.get("step_s")
        lines += ["", f"Reference model ({model[0]['params']:,} parameters in {model[0]['tensors']} tensors), "
                  f"one training step = {step * 1000:.1f} ms here:", "",
                  "| codec | ratio | encode ms | decode ms | codec ms per sync | round | share of round compute | ≤ 5%? |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in model:
            ok = "yes" if r["fraction_of_compute"] <= 0.05 else "no"
            lines.append(f"| {r['codec']} | {r['ratio']:.1f}x | {r['encode_s'] * 1e3:.1f} | {r['decode_s'] * 1e3:.1f} | "
                         f"{r['codec_s_per_sync'] * 1e3:.1f} | {r['round_steps']} steps | "
                         f"{r['fraction_of_compute']:.1%} | {ok} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], choices=sorted(SHAPES))
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a peer uses 1)")
    parser.add_argument("--out", type=Path, default=Path("experiments/out/codecs"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}

    def save() -> None:
        path.write_text(json.dumps(results, indent=1))
        write_tables(args.out, results)

    if "step_s" not in results:
        print("measuring the reference model's training step...", flush=True)
        results["step_s"], _ = measure_step_s()
        save()
    _, params = measure_step_s() if any(f"model/{c}" not in results for c in args.codecs) else (None, [])
    cells = [("model", c, 0) for c in args.codecs] + [("tp", c, s) for s in args.sizes for c in args.codecs]
    todo = [cell for cell in cells if _key(cell) not in results]
    started = time.time()
    for i, cell in enumerate(todo):
        kind, label, size = cell
        results[_key(cell)] = model_row(label, params, results["step_s"]) if kind == "model" else throughput_row(label, size)
        save()
        eta = (time.time() - started) / (i + 1) * (len(todo) - i - 1)
        print(f"[{i + 1}/{len(todo)}] {kind} {label} {size or ''}: done; ETA {math.ceil(eta / 60)} min", flush=True)
    print((args.out / "table.md").read_text())


def _key(cell: tuple[str, str, int]) -> str:
    kind, label, size = cell
    return f"model/{label}" if kind == "model" else f"tp/{size:03d}/{label}"


if __name__ == "__main__":
    sys.exit(main())
