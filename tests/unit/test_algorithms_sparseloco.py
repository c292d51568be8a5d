"""SparseLoCo (ALGORITHMS.md §3): Templar's clipped aggregate, a slow per-block implementation of the
spec, a stored golden trajectory, the dense 1-D rule and the scatter-mean pitfall."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from golden import assert_close, golden, random_inputs, tensor, tolist

from lowcomm.algorithms.payloads import PayloadShapeError
from lowcomm.algorithms.sparseloco import (SparseLoCoConfig, SparseLoCoState, aggregate, apply_all, compress_all,
                                           compress_pseudo_gradient)
from lowcomm.compress import get_codec

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "vectors"
RTOL, ATOL = 1e-6, 1e-7  # ALGORITHMS.md "Comparing with the reference vectors"


def inner_sgd(phi, grads, lr):
    """H steps of SGD on a fixed gradient sequence: θ = φ − lr·Σ g, step by step."""
    theta = [p.clone() for p in phi]
    for step in grads:
        for t, g in zip(theta, step):
            t.sub_(g, alpha=lr)
    return theta


def run_module(phi0, grads, config: SparseLoCoConfig, inner_lr: float):
    """R in-process replicas; ``grads[t][r][h]`` is replica r's gradient list at inner step h of round t."""
    replicas = len(grads[0])
    phis = [[p.clone() for p in phi0] for _ in range(replicas)]
    states = [SparseLoCoState.zeros_like(phi0) for _ in range(replicas)]
    trajectory = []
    for round_grads in grads:
        gathered = []
        for r in range(replicas):
            theta = inner_sgd(phis[r], round_grads[r], inner_lr)
            gathered.append(compress_all(states[r], [p - t for p, t in zip(phis[r], theta)], config))
        for r in range(replicas):
            apply_all(phis[r], gathered, config)
            assert all(torch.equal(a, b) for a, b in zip(phis[0], phis[r])), "replicas diverged"
        trajectory.append([p.clone() for p in phis[0]])
    return trajectory


# ---------------------------------------------------------------------- Templar's compressor
def load_reference() -> dict:
    path = VECTORS / "sparseloco_reference.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: the shared/ folder must sit beside the checkout (see README)")
    return json.loads(path.read_text())


def test_module_reproduces_templar_reconstructions_and_clipped_aggregate():
    ref = load_reference()
    codec = get_codec("topk", chunk=ref["target_chunk"], k=ref["k"], values="q2")  # b too, as Templar chunks it
    payloads: dict[str, list[bytes]] = {}
    shapes = {}
    for peer in ref["peers"]:
        x = tensor(peer["input"])
        error = torch.zeros_like(x)
        payloads.setdefault(peer["param"], []).append(compress_pseudo_gradient(error, x, 0.95, codec))
        shapes[peer["param"]] = tuple(x.shape)
        # the residual keeps exactly what the receivers will not see
        assert_close(error, (x - tensor(peer["reconstruction"])).numpy(), rtol=RTOL, atol=ATOL)
    for param, blobs in payloads.items():
        got = aggregate(blobs, codec, shapes[param], clip=True)
        assert_close(got, ref[f"aggregate_{param}"], rtol=RTOL, atol=ATOL, msg=param)


# ---------------------------------------------------------------------- the slow implementation
def edge(n: int, s: int) -> int:
    return max(d for d in range(1, min(n, s) + 1) if n % d == 0)


def slow_top_k_positions(e: torch.Tensor, k: int, chunk: int) -> list[tuple[int, int]]:
    """Per c1×c2 block, the k positions of the largest |e| (k even and ≤ the block in these tests)."""
    c1, c2 = edge(e.shape[0], chunk), edge(e.shape[1], chunk)
    kept = []
    for i in range(0, e.shape[0], c1):
        for j in range(0, e.shape[1], c2):
            block = e[i:i + c1, j:j + c2].reshape(-1)
            order = sorted(range(block.numel()), key=lambda n: -abs(float(block[n])))
            kept += [(i + n // c2, j + n % c2) for n in order[:k]]
    return kept


def slow_q2(v: torch.Tensor) -> torch.Tensor:
    """The 2-bit quantizer of ALGORITHMS.md §3 (bins 4, range 6), returning the dequantized values."""
    bins, rng = 4, 6.0
    shift = v.mean()
    sigma = (v - shift).norm() / math.sqrt(v.numel() - 1)
    scale = rng * sigma / bins
    if not math.isfinite(float(scale)) or float(scale) == 0.0:
        scale = torch.tensor(1.0)
    q = torch.clamp(torch.round((v - shift) / scale + bins / 2), 0, bins - 1)
    lookup = [float((v - shift)[q == b].mean()) if bool((q == b).any()) else 0.0 for b in range(bins)]
    return torch.tensor([lookup[int(c)] for c in q], dtype=torch.float32) + shift


def slow_sparseloco(phi0, grads, cfg: dict, inner_lr: float) -> list:
    beta, k, chunk, outer_lr = cfg["beta"], cfg["topk"], cfg["chunk"], cfg["outer_lr"]
    replicas = len(grads[0])
    phi = [tensor(p) for p in phi0]
    errors = [[torch.zeros_like(p) for p in phi] for _ in range(replicas)]
    trajectory = []
    for round_grads in grads:
        sent = [[None] * len(phi) for _ in range(replicas)]  # {coordinate: dequantized value}
        for r in range(replicas):
            theta = inner_sgd(phi, [[tensor(g) for g in step] for step in round_grads[r]], inner_lr)
            for i, (p, t) in enumerate(zip(phi, theta)):
                errors[r][i] = beta * errors[r][i] + (p - t)
                e = errors[r][i]
                if e.dim() == 1:  # lowcomm: 1-D tensors travel dense float32
                    sent[r][i] = {(n,): float(e[n]) for n in range(e.numel())}
                else:
                    positions = slow_top_k_positions(e, k, chunk)
                    values = slow_q2(torch.stack([e[pos] for pos in positions]))
                    sent[r][i] = {pos: float(v) for pos, v in zip(positions, values)}
                for pos, value in sent[r][i].items():
                    e[pos] = e[pos] - torch.tensor(value, dtype=torch.float32)
        for i in range(len(phi)):
            norms = [math.sqrt(sum(v * v for v in sent[r][i].values())) for r in range(replicas)]
            median = sorted(norms)[(replicas - 1) // 2]  # lower middle
            sums, counts = {}, {}
            for r in range(replicas):
                factor = min(1.0, median / (norms[r] + 1e-8))
                for pos, value in sent[r][i].items():
                    sums[pos] = sums.get(pos, 0.0) + value * factor
                    counts[pos] = counts.get(pos, 0) + 1
            agg = torch.zeros_like(phi[i])
            for pos in sums:
                agg[pos] = sums[pos] / counts[pos]
            phi[i] = phi[i] - outer_lr * agg
        trajectory.append([p.clone() for p in phi])
    return trajectory


CONFIG = dict(beta=0.95, topk=4, chunk=4, outer_lr=1.0)
SHAPES = [(8, 12), (6, 10), (6,)]
REPLICAS, ROUNDS, INNER_STEPS, INNER_LR = 3, 4, 2, 0.1


def produce_golden() -> dict:
    phi0 = [random_inputs(i, shape) for i, shape in enumerate(SHAPES)]
    grads = [[[[random_inputs(1000 * t + 100 * r + 10 * h + i, shape) for i, shape in enumerate(SHAPES)]
               for h in range(INNER_STEPS)] for r in range(REPLICAS)] for t in range(ROUNDS)]
    trajectory = slow_sparseloco(phi0, grads, CONFIG, INNER_LR)
    return {"config": CONFIG, "inner_lr": INNER_LR, "phi0": phi0, "grads": grads,
            "trajectory": [[tolist(p) for p in step] for step in trajectory]}


def test_golden_trajectory_against_slow_spec_implementation():
    fixture = golden("algorithms_sparseloco", produce_golden)
    cfg, inner_lr = fixture["config"], fixture["inner_lr"]
    config = SparseLoCoConfig(beta=cfg["beta"], topk=cfg["topk"], chunk=cfg["chunk"], outer_lr=cfg["outer_lr"])
    grads = [[[[tensor(g) for g in step] for step in replica] for replica in rnd] for rnd in fixture["grads"]]
    got = run_module([tensor(p) for p in fixture["phi0"]], grads, config, inner_lr)
    slow = slow_sparseloco(fixture["phi0"], fixture["grads"], cfg, inner_lr)
    for t, (mine, theirs, stored) in enumerate(zip(got, slow, fixture["trajectory"])):
        for i in range(len(mine)):
            assert_close(mine[i], theirs[i], msg=f"round {t + 1}, param {i}: module vs slow spec")
            assert_close(mine[i], stored[i], msg=f"round {t + 1}, param {i}: module vs stored fixture")


# ---------------------------------------------------------------------- rules and pitfalls
def test_scatter_mean_divides_by_the_peers_that_sent_a_coordinate_not_by_r():
    codec = get_codec("topk", chunk=4, k=2, values="float32")
    a = torch.tensor([[5.0, 4.0, 0.0, 0.0, 3.0, 2.0, 0.0, 0.0]])
    b = torch.tensor([[0.0, 0.0, 7.0, 6.0, 0.0, 0.0, 1.0, 1.0]])
    c = torch.tensor([[9.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # overlaps a at 0 and 1
    blobs = [compress_pseudo_gradient(torch.zeros(1, 8), x, 0.0, codec) for x in (a, b)]
    torch.testing.assert_close(aggregate(blobs, codec, (1, 8), clip=False), torch.tensor([[5.0, 4, 7, 6, 3, 2, 1, 1]]))
    three = blobs + [compress_pseudo_gradient(torch.zeros(1, 8), c, 0.0, codec)]
    got = aggregate(three, codec, (1, 8), clip=False)
    # c also sends two zeros of its second chunk (which ones is arbitrary): only the first chunk is checked
    assert got[0, :2].tolist() == [7.0, 2.5]
    assert got[0, 2:4].tolist() == [7.0, 6.0]


def test_one_d_tensors_travel_dense_and_their_residual_empties():
    config = SparseLoCoConfig()
    assert config.codec_for((6,)).name == "dense" and config.codec_for((4, 4)).name == "topk"
    state = SparseLoCoState.zeros_like([torch.zeros(6)])
    state.errors[0].fill_(0.5)
    delta = tensor(random_inputs(2, (6,)))
    [payload] = compress_all(state, [delta], config)
    sent = config.codec_for((6,)).decode(payload)
    assert torch.equal(sent, 0.95 * torch.full((6,), 0.5) + delta)  # e ← βe + Δ, every element exact
    assert torch.equal(state.errors[0], torch.zeros(6))


def test_median_clip_scales_only_peers_above_the_lower_median():
    codec = get_codec("dense", dtype="float32")
    xs = [torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8]), torch.tensor([6.0, 8.0]), torch.tensor([0.0, 2.0])]
    blobs = [codec.encode(x) for x in xs]
    # norms 5, 1, 10, 2: torch's median of an even count is the lower middle, 2
    factors = [min(1.0, 2.0 / (float(x.norm()) + 1e-8)) for x in xs]
    expected = sum(x * f for x, f in zip(xs, factors)) / 4
    torch.testing.assert_close(aggregate(blobs, codec, (2,), clip=True), expected)
    torch.testing.assert_close(aggregate(blobs, codec, (2,), clip=False), sum(xs) / 4)


def test_a_payload_for_another_shape_is_refused():
    codec = get_codec("topk", chunk=4, k=2)
    blob = codec.encode(torch.ones(4, 8))
    with pytest.raises(PayloadShapeError, match=r"\(4, 8\), expected \(8, 4\)"):
        aggregate([blob], codec, (8, 4))
