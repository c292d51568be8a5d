"""DeMo (ALGORITHMS.md §2): the reference optimizer's trajectory, a slow per-block implementation
of the spec, a stored golden trajectory, and the pitfalls (scatter-mean, the doubled lr)."""

from __future__ import annotations


import numpy as np
import pytest
import scipy.fft
import torch
from golden import assert_close, demo_reference, golden, random_inputs, tensor, tolist

from lowcomm.algorithms.demo import (DemoConfig, DemoState, aggregate_update, apply_all, compress_all,
                                     compress_residual)

RTOL, ATOL = 1e-6, 1e-7  # ALGORITHMS.md "Comparing with the reference vectors"


def run_module(params0, grads, config: DemoConfig, replicas: int):
    """R in-process workers; ``grads[s][r]`` is worker r's gradient list at step s. Returns each step's params."""
    codec = config.codec()
    params = [[p.clone() for p in params0] for _ in range(replicas)]
    states = [DemoState.zeros_like(params0) for _ in range(replicas)]
    trajectory = []
    for step_grads in grads:
        gathered = [compress_all(states[r], step_grads[r], config, codec) for r in range(replicas)]
        for r in range(replicas):
            apply_all(params[r], gathered, config, codec)
        for r in range(1, replicas):
            for a, b in zip(params[0], params[r]):
                assert torch.equal(a, b), "workers diverged"
        trajectory.append([p.clone() for p in params[0]])
    return trajectory


# ---------------------------------------------------------------------- the reference optimizer
def test_matches_reference_demo_trajectory():
    ref, fields = demo_reference()
    hyper = ref["hyper"]
    config = DemoConfig(**fields)
    workers = hyper["workers"]
    steps = len(ref["traj"])
    grads = [[[tensor(g) for g in ref["grads"][s * workers + r]] for r in range(workers)] for s in range(steps)]
    trajectory = run_module([tensor(ref["W0"]), tensor(ref["b0"])], grads, config, workers)
    for s, (got, want) in enumerate(zip(trajectory, ref["traj"])):
        for name, param in zip("Wb", got):
            assert_close(param, want[name], rtol=RTOL, atol=ATOL, msg=f"step {s + 1}, {name}")


# ---------------------------------------------------------------------- the slow implementation
def edge(n: int, s: int) -> int:
    return max(d for d in range(1, min(n, s) + 1) if n % d == 0)


def block_slices(shape, chunk):
    """(slices of one block) for every block of the 1-D or 2-D tensor."""
    edges = [edge(n, chunk) for n in shape]
    if len(shape) == 1:
        return [(slice(i, i + edges[0]),) for i in range(0, shape[0], edges[0])]
    return [(slice(i, i + edges[0]), slice(j, j + edges[1]))
            for i in range(0, shape[0], edges[0]) for j in range(0, shape[1], edges[1])]


def slow_topk_coefficients(delta: np.ndarray, chunk: int, k: int) -> dict:
    """{coefficient position: value}: per block, the k largest |DCT coefficients|."""
    kept = {}
    for sl in block_slices(delta.shape, chunk):
        coeffs = scipy.fft.dctn(delta[sl], type=2, norm="ortho")
        flat = coeffs.reshape(-1)
        positions = np.argwhere(np.ones_like(coeffs, dtype=bool))  # row-major, like flat
        for i in np.argsort(-np.abs(flat), kind="stable")[:min(k, flat.size)]:
            kept[tuple(int(sl[d].start + positions[i][d]) for d in range(delta.ndim))] = flat[i]
    return kept


def slow_idct(coeffs: np.ndarray, chunk: int) -> np.ndarray:
    out = np.zeros_like(coeffs)
    for sl in block_slices(coeffs.shape, chunk):
        out[sl] = scipy.fft.idctn(coeffs[sl], type=2, norm="ortho")
    return out


def slow_demo(params0, grads, cfg: dict) -> list:
    """ALGORITHMS.md §2 line by line, in numpy float32, one dict per worker for the scatter-mean."""
    lr, beta, k, chunk, wd, sign = (cfg[key] for key in ("lr", "beta", "topk", "chunk", "weight_decay", "sign"))
    band = cfg.get("zero_band", 0.0)
    replicas = len(grads[0])
    params = [[np.array(p, dtype=np.float32) for p in params0] for _ in range(replicas)]
    deltas = [[np.zeros_like(p) for p in params[0]] for _ in range(replicas)]
    trajectory = []
    for step in grads:
        sent = [[None] * len(params0) for _ in range(replicas)]
        for r in range(replicas):
            for i, g in enumerate(step[r]):
                params[r][i] = params[r][i] * np.float32(1 - lr * wd)
                deltas[r][i] = np.float32(beta) * deltas[r][i] + np.float32(lr) * np.asarray(g, np.float32)
                kept = slow_topk_coefficients(deltas[r][i], chunk, k)
                transmitted = np.zeros_like(deltas[r][i])
                for pos, value in kept.items():
                    transmitted[pos] = value  # in sign mode, the unquantized selected component
                deltas[r][i] = deltas[r][i] - slow_idct(transmitted, chunk)
                sent[r][i] = {pos: (np.sign(v) if sign else v) for pos, v in kept.items()}
        for i in range(len(params0)):
            sums, counts = {}, {}
            for r in range(replicas):
                for pos, value in sent[r][i].items():
                    sums[pos] = sums.get(pos, 0.0) + float(value)
                    counts[pos] = counts.get(pos, 0) + 1
            coeffs = np.zeros_like(params[0][i])
            for pos in sums:
                coeffs[pos] = sums[pos] / counts[pos]  # mean over the workers that sent it
            update = slow_idct(coeffs, chunk)
            update[np.abs(update) <= band * np.abs(coeffs).max()] = 0.0
            update = np.sign(update)
            for r in range(replicas):
                params[r][i] = params[r][i] - np.float32(lr) * update
        trajectory.append([p.copy() for p in params[0]])
    return trajectory


# In sign mode the averaged coefficients are multiples of 1/R, so U is often exactly zero in exact
# arithmetic and its float sign is noise (test_sign_mode_hits_exact_zeros...): that case runs with
# a zero band, the same in the module and the slow implementation.
GOLDEN_CASES = {
    "demo_float": (dict(lr=0.01, beta=0.9, topk=3, chunk=5, weight_decay=0.1, sign=False), [(12, 10), (10,)], 3),
    "demo_sign": (dict(lr=0.01, beta=0.95, topk=4, chunk=4, weight_decay=0.0, sign=True, zero_band=1e-5),
                  [(16, 8), (8,)], 7),
}
REPLICAS, STEPS = 3, 4


def produce_golden(cfg: dict, shapes, seed: int) -> dict:
    params0 = [random_inputs(seed + i, shape) for i, shape in enumerate(shapes)]
    grads = [[[random_inputs(1000 * seed + 100 * s + 10 * r + i, shape) for i, shape in enumerate(shapes)]
              for r in range(REPLICAS)] for s in range(STEPS)]
    trajectory = slow_demo(params0, grads, cfg)
    return {"config": cfg, "params0": params0, "grads": grads,
            "trajectory": [[tolist(p) for p in step] for step in trajectory]}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_trajectory_against_slow_spec_implementation(name):
    fixture = golden(f"algorithms_{name}", lambda: produce_golden(*GOLDEN_CASES[name]))
    cfg = fixture["config"]
    config = DemoConfig(**cfg)
    grads = [[[tensor(g) for g in worker] for worker in step] for step in fixture["grads"]]
    got = run_module([tensor(p) for p in fixture["params0"]], grads, config, len(fixture["grads"][0]))
    slow = slow_demo(fixture["params0"], fixture["grads"], cfg)
    for s, (mine, theirs, stored) in enumerate(zip(got, slow, fixture["trajectory"])):
        for i in range(len(mine)):
            assert_close(mine[i], theirs[i], msg=f"step {s + 1}, param {i}: module vs slow spec")
            assert_close(mine[i], stored[i], msg=f"step {s + 1}, param {i}: module vs stored fixture")


# ---------------------------------------------------------------------- pitfalls
def test_scatter_mean_divides_by_the_workers_that_sent_a_coefficient():
    config = DemoConfig(lr=1.0, beta=0.0, topk=1, chunk=4)
    codec = config.codec()
    # Worker 0's residual is one DCT basis vector, worker 1's another: each sends one coefficient.
    basis = torch.eye(4)
    a = codec.inverse(basis[0] * 3.0)
    b = codec.inverse(basis[2] * -5.0)
    payloads = [compress_residual(torch.zeros(4), g, config, codec) for g in (a, b)]
    coeffs = codec.transform(aggregate_update(payloads, codec, (4,)))
    torch.testing.assert_close(coeffs, torch.tensor([3.0, 0.0, -5.0, 0.0]), rtol=0, atol=1e-6)  # not /2


def test_lr_is_applied_twice_inside_the_residual_and_on_the_sign_step():
    g = tensor(random_inputs(11, (8, 8)))
    moves, residuals = {}, {}
    for lr in (0.5, 0.25):
        config = DemoConfig(lr=lr, beta=0.999, topk=4, chunk=8)
        codec = config.codec()
        param, state = torch.zeros(8, 8), DemoState.zeros_like([torch.zeros(8, 8)])
        apply_all([param], [compress_all(state, [g], config, codec)], config, codec)
        moves[lr], residuals[lr] = param, state.deltas[0]
    # the sign step moves every coordinate by exactly lr ...
    assert set(moves[0.5].abs().unique().tolist()) == {0.5}
    torch.testing.assert_close(moves[0.25], moves[0.5] / 2, rtol=0, atol=0)
    # ... and the residual δ = η·g − transmitted scales with lr too
    torch.testing.assert_close(residuals[0.25], residuals[0.5] / 2, rtol=1e-6, atol=1e-7)
    assert residuals[0.5].abs().max() > 0


def test_sign_mode_subtracts_the_unquantized_component_and_sends_signs():
    config = DemoConfig(lr=0.1, beta=0.0, topk=2, chunk=4, sign=True)
    codec = config.codec()
    g = tensor(random_inputs(5, (4, 4)))
    delta = torch.zeros(4, 4)
    payload = compress_residual(delta, g, config, codec)
    _, values, _ = codec.decode_sparse(payload)
    assert set(values.abs().tolist()) == {1.0}
    full = codec.transform(config.lr * g).reshape(-1)
    expected = torch.zeros(16)
    top = full.abs().topk(2).indices
    expected[top] = full[top]  # exact coefficients, not their signs
    removed = codec.transform(config.lr * g - delta).reshape(-1)
    torch.testing.assert_close(removed, expected, rtol=1e-5, atol=1e-6)


def test_sign_mode_hits_exact_zeros_that_the_zero_band_snaps():
    # Mean ±1 coefficients of one 4x4 block (seen in the sign-mode golden run) whose inverse DCT
    # has two exact zeros; in float32 they come out as 0 or ±1e-8 depending on the kernel.
    coeffs = torch.tensor([[1.0, 1, -1, 1], [0, 0, -1, 0], [1, 0, -1, 0], [0, 0, 1, 0]])
    exact_zero = torch.from_numpy(np.abs(slow_idct(coeffs.double().numpy(), 4)) < 1e-12)
    assert int(exact_zero.sum()) == 2
    codec = DemoConfig(lr=1.0, topk=16, chunk=4).codec()  # k = the whole block: sends every coefficient
    payload = codec.encode(codec.inverse(coeffs))
    banded = aggregate_update([payload], codec, (4, 4), zero_band=1e-5)
    assert torch.equal(banded == 0, exact_zero)
    plain = aggregate_update([payload], codec, (4, 4))
    torch.testing.assert_close(banded, plain.masked_fill(exact_zero, 0.0), rtol=0, atol=0)
