"""DiLoCo variants (ALGORITHMS.md §1): the one-step-delay overlap (DiLoCo and SparseLoCo) and Streaming
DiLoCo's fragment schedule, on fixed gradient sequences against slow implementations of the spec."""

from __future__ import annotations

import pytest
import torch
from golden import assert_close, golden, random_inputs, tensor, tolist
from torch import nn

from lowcomm.algorithms import sparseloco, streaming
from lowcomm.algorithms.diloco import DiLoCo, DilocoConfig
from lowcomm.algorithms.overlap import OneStepDelay, next_start, progress
from lowcomm.collectives.base import GroupKey, InProcessGroup
from lowcomm.models.gpt import GPT, ModelConfig

KEY = GroupKey("overlap-test")
OUTER_LR, MOMENTUM, INNER_LR = 0.7, 0.9, 0.1


def sgd_steps(params, grads, lr=INNER_LR):
    """Inner steps on a fixed gradient sequence (it ignores θ, so the overlap cannot change Δ)."""
    params = [p.detach().clone() for p in params]
    for step in grads:
        for p, g in zip(params, step):
            p.sub_(g, alpha=lr)
    return params


def slow_diloco(phi0, grads, rounds_of=None):
    """Plain DiLoCo with the Nesterov outer step written out; ``grads[t][r][h]``. φ after each round."""
    phi = [p.clone() for p in phi0]
    buf = None
    out = []
    for round_grads in grads:
        deltas = [[p - t for p, t in zip(phi, sgd_steps(phi, replica))] for replica in round_grads]
        mean = [sum(d[k] for d in deltas) / len(deltas) for k in range(len(phi))]
        buf = [m.clone() for m in mean] if buf is None else [MOMENTUM * b + m for b, m in zip(buf, mean)]
        phi = [p - OUTER_LR * (m + MOMENTUM * b) for p, m, b in zip(phi, mean, buf)]
        out.append([p.clone() for p in phi])
    return out


def make_grads(seed, rounds, replicas, steps, shapes):
    return [[[[random_inputs(seed + 1000 * t + 100 * r + 10 * h + i, s) for i, s in enumerate(shapes)]
              for h in range(steps)] for r in range(replicas)] for t in range(rounds)]


def as_tensors(grads):
    return [[[[tensor(g) for g in step] for step in replica] for replica in rnd] for rnd in grads]


# ---------------------------------------------------------------------- one-step-delay overlap
def tiny_model():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def set_params(model, values):
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def run_diloco(grads, overlap: bool):
    """R DiLoCo replicas (the existing class) on the in-process collective; φ after each outer step."""
    replicas = len(grads[0])
    group = InProcessGroup(replicas)
    models = [tiny_model() for _ in range(replicas)]
    algos = [DiLoCo(m, DilocoConfig(outer_lr=OUTER_LR, outer_momentum=MOMENTUM), group.replica(i), KEY)
             for i, m in enumerate(models)]
    delays = [OneStepDelay() for _ in range(replicas)]
    phis = []

    def finish(algo):
        def wait_and_step(handle):
            algo.apply(handle.result(5))
            return algo.phi
        return wait_and_step

    for t, round_grads in enumerate(grads):
        handles = []
        for r, (model, algo) in enumerate(zip(models, algos)):
            start = [p.detach().clone() for p in model.parameters()]
            end = sgd_steps(start, round_grads[r])
            if not overlap:
                set_params(model, end)
                handles.append(algo.start_sync(t, weight=1.0))
                continue
            launch = lambda delta, t=t, algo=algo: algo.collective.start(KEY, t, flat(delta), 1.0)  # noqa: E731
            set_params(model, delays[r].round(start, end, algo.phi, launch, finish(algo)))
        for algo, handle in zip(algos, handles):
            algo.apply(handle.result(5))
        if not overlap or t > 0:
            phis.append([p.detach().clone() for p in algos[0].phi])
        assert len({a.phi_hash() for a in algos}) == 1
    if overlap:
        for model, algo, delay in zip(models, algos, delays):
            set_params(model, delay.drain(algo.phi, finish(algo)))
        phis.append([p.detach().clone() for p in algos[0].phi])
    return phis


def test_progress_and_next_start_follow_the_recurrence():
    s, e, phi = [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, 2.5])], [torch.tensor([0.0, 1.0])]
    delta = progress(s, e)
    assert delta[0].tolist() == [0.5, -0.5]  # Δ = s − e, DiLoCo's sign
    assert next_start(phi, delta)[0].tolist() == [-0.5, 1.5]  # s' = φ − Δ


def produce_overlap_golden() -> dict:
    phi0 = [p.detach() for p in tiny_model().parameters()]
    grads = make_grads(5, 5, 3, 3, [tuple(p.shape) for p in phi0])
    return {"phi0": [tolist(p) for p in phi0], "grads": grads,
            "trajectory": [[tolist(p) for p in phi] for phi in slow_diloco(phi0, as_tensors(grads))]}


def test_diloco_with_overlap_produces_plain_diloco_phi_sequence():
    fixture = golden("algorithms_diloco_overlap", produce_overlap_golden)
    for p, stored in zip(tiny_model().parameters(), fixture["phi0"]):
        assert_close(p, stored, rtol=0, atol=0)  # the fixture starts where the test's model does
    grads = as_tensors(fixture["grads"])
    plain = run_diloco(grads, overlap=False)
    overlapped = run_diloco(grads, overlap=True)
    slow = slow_diloco([p.detach() for p in tiny_model().parameters()], grads)
    assert len(plain) == len(overlapped) == len(slow) == len(grads)
    for t, (a, b, c, stored) in enumerate(zip(plain, overlapped, slow, fixture["trajectory"])):
        for k in range(len(a)):
            assert_close(b[k], a[k].numpy(), msg=f"round {t + 1}: overlap vs plain DiLoCo")
            assert_close(a[k], c[k].numpy(), msg=f"round {t + 1}: plain DiLoCo vs slow spec")
            assert_close(b[k], stored[k], msg=f"round {t + 1}: overlap vs stored fixture")


def run_sparseloco(phi0, grads, config, overlap: bool):
    replicas = len(grads[0])
    phis = [[p.clone() for p in phi0] for _ in range(replicas)]
    starts = [[p.clone() for p in phi0] for _ in range(replicas)]
    states = [sparseloco.SparseLoCoState.zeros_like(phi0) for _ in range(replicas)]
    delays = [OneStepDelay() for _ in range(replicas)]
    gathered: dict[int, list] = {}
    out = []

    def finish(r):
        def apply(t):  # the handle is the round: its payloads are all in by now (in-process all-gather)
            sparseloco.apply_all(phis[r], gathered[t], config)
            return phis[r]
        return apply

    for t, round_grads in enumerate(grads):
        for r in range(replicas):
            end = sgd_steps(starts[r], round_grads[r])

            def launch(delta, r=r, t=t):
                gathered.setdefault(t, []).append(sparseloco.compress_all(states[r], delta, config))
                return t
            if overlap:
                starts[r] = delays[r].round(starts[r], end, phis[r], launch, finish(r))
            else:
                launch(progress(starts[r], end))
        if not overlap:
            for r in range(replicas):
                finish(r)(t)
                starts[r] = [p.clone() for p in phis[r]]
        if not overlap or t > 0:
            out.append([p.clone() for p in phis[0]])
    if overlap:
        for r in range(replicas):
            delays[r].drain(phis[r], finish(r))
        out.append([p.clone() for p in phis[0]])
    return out


def test_sparseloco_with_overlap_produces_the_same_phi_sequence():
    shapes = [(8, 8), (8,)]
    config = sparseloco.SparseLoCoConfig(topk=4, chunk=4)
    phi0 = [tensor(random_inputs(i, s)) for i, s in enumerate(shapes)]
    grads = as_tensors(make_grads(9, 4, 3, 2, shapes))
    plain = run_sparseloco(phi0, grads, config, overlap=False)
    overlapped = run_sparseloco(phi0, grads, config, overlap=True)
    assert len(plain) == len(overlapped) == len(grads)
    for t, (a, b) in enumerate(zip(plain, overlapped)):
        for k in range(len(a)):
            assert_close(b[k], a[k].numpy(), msg=f"round {t + 1}, param {k}")


# ---------------------------------------------------------------------- Streaming DiLoCo
def test_each_fragment_syncs_once_per_cycle_at_its_offset():
    H, P, tau = 6, 3, 2
    starts = {step: streaming.syncs_starting(step, H, P) for step in range(0, 19)}
    assert {s: f for s, f in starts.items() if f} == {2: [1], 4: [2], 6: [0], 8: [1], 10: [2], 12: [0],
                                                     14: [1], 16: [2], 18: [0]}
    for step in range(1, 19):
        assert streaming.syncs_applying(step, H, P, tau) == starts.get(step - tau, [])
    assert [streaming.sync_offset(p, H, P) for p in range(P)] == [0, 2, 4]


@pytest.mark.parametrize("H, P, tau", [(4, 5, 0), (4, 0, 0), (4, 2, 4), (4, 2, -1)])
def test_impossible_schedules_are_refused(H, P, tau):
    with pytest.raises(ValueError, match="fragment"):
        streaming.check_schedule(H, P, tau)
    streaming.check_schedule(4, 2, 3)


def test_fragments_are_strided_over_transformer_blocks():
    names = [name for name, _ in GPT(ModelConfig(n_layers=4)).named_parameters()]
    assignment = streaming.strided_fragments(names, 2)
    for name, fragment in zip(names, assignment):
        if name.startswith("blocks."):
            assert fragment == int(name.split(".")[1]) % 2, name
        elif name.startswith("embed."):
            assert fragment == 0, name
        else:
            assert fragment == 1, name  # the head joins the last fragment
    assert sorted(streaming.members(assignment, 0) + streaming.members(assignment, 1)) == list(range(len(names)))


def test_merge_is_lerp_from_phi_towards_theta():
    phi, theta = [torch.tensor([0.0, 2.0])], [torch.tensor([1.0, 4.0])]
    assert streaming.merge(phi, theta, 0.0)[0].tolist() == [0.0, 2.0]
    assert streaming.merge(phi, theta, 0.25)[0].tolist() == [0.25, 2.5]
    assert streaming.merge(phi, theta, 1.0)[0].tolist() == [1.0, 4.0]


def run_streaming(phi0, grads, assignment, H, P, tau, alpha):
    """The module's schedule driving R replicas; ``grads[step][r]``; one shared φ (identical on all)."""
    phi = [nn.Parameter(p.clone()) for p in phi0]
    outer = torch.optim.SGD(phi, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    thetas = [[p.clone() for p in phi0] for _ in grads[0]]
    in_flight = {}
    out = []
    for step, step_grads in enumerate(grads, start=1):
        thetas = [sgd_steps(theta, [g]) for theta, g in zip(thetas, step_grads)]
        for p in streaming.syncs_starting(step, H, P):
            idx = streaming.members(assignment, p)
            in_flight[p] = [sum(phi[k].detach() - theta[k] for theta in thetas) / len(thetas) for k in idx]
        for p in streaming.syncs_applying(step, H, P, tau):
            idx = streaming.members(assignment, p)
            for k, mean in zip(idx, in_flight.pop(p)):
                phi[k].grad = mean
            outer.step()
            outer.zero_grad(set_to_none=True)
            for theta in thetas:
                merged = streaming.merge([phi[k] for k in idx], [theta[k] for k in idx], alpha)
                for k, m in zip(idx, merged):
                    theta[k] = m
        out.append([p.detach().clone() for p in phi])
    return out


def slow_streaming(phi0, grads, assignment, H, P, tau, alpha):
    """The schedule from an explicit event list: fragment p starts at p·⌊H/P⌋ + kH (≥ 1), applies τ later."""
    steps = len(grads)
    starts = {p: [o for o in range(p * (H // P), steps + 1, H) if o >= 1] for p in range(P)}
    phi = [p.clone() for p in phi0]
    buf = [None] * len(phi)
    thetas = [[p.clone() for p in phi0] for _ in grads[0]]
    in_flight = {}
    out = []
    for step in range(1, steps + 1):
        for theta, g in zip(thetas, grads[step - 1]):
            for k in range(len(theta)):
                theta[k] = theta[k] - INNER_LR * g[k]
        for p in range(P):
            idx = [k for k in range(len(phi)) if assignment[k] == p]
            if step in starts[p]:
                in_flight[p] = {k: torch.stack([phi[k] - theta[k] for theta in thetas]).mean(0) for k in idx}
            if step - tau in starts[p]:
                for k, g in in_flight.pop(p).items():
                    buf[k] = g.clone() if buf[k] is None else MOMENTUM * buf[k] + g
                    phi[k] = phi[k] - OUTER_LR * (g + MOMENTUM * buf[k])
                    for theta in thetas:
                        theta[k] = phi[k] + alpha * (theta[k] - phi[k])
        out.append([p.clone() for p in phi])
    return out


STREAMING = dict(H=4, P=2, tau=1, alpha=0.5, assignment=[0, 1, 0, 1])


def produce_streaming_golden(steps=13, replicas=2) -> dict:
    shapes = [(3, 4), (4,), (2, 3), (5,)]
    phi0 = [random_inputs(50 + i, s) for i, s in enumerate(shapes)]
    grads = [[[random_inputs(7000 + 100 * t + 10 * r + i, s) for i, s in enumerate(shapes)] for r in range(replicas)]
             for t in range(steps)]
    trajectory = slow_streaming(*streaming_args({**STREAMING, "phi0": phi0, "grads": grads}))
    return {**STREAMING, "phi0": phi0, "grads": grads, "trajectory": [[tolist(p) for p in phi] for phi in trajectory]}


def streaming_args(fixture: dict) -> tuple:
    return ([tensor(p) for p in fixture["phi0"]], [[[tensor(g) for g in r] for r in t] for t in fixture["grads"]],
            fixture["assignment"], fixture["H"], fixture["P"], fixture["tau"], fixture["alpha"])


def test_streaming_golden_trajectory_against_slow_schedule():
    fixture = golden("algorithms_streaming", produce_streaming_golden)
    args = streaming_args(fixture)
    got, slow = run_streaming(*args), slow_streaming(*args)
    for step, (a, b, stored) in enumerate(zip(got, slow, fixture["trajectory"]), start=1):
        for k in range(len(a)):
            assert_close(a[k], b[k].numpy(), msg=f"step {step}, param {k}: module schedule vs slow")
            assert_close(a[k], stored[k], msg=f"step {step}, param {k}: module schedule vs fixture")
    # fragment 1 starts at step 2 and lands at step 3; fragment 0 starts at step 4 and lands at step 5
    assert torch.equal(got[1][1], tensor(fixture["phi0"][1])) and not torch.equal(got[2][1], got[1][1])
    assert torch.equal(got[3][0], tensor(fixture["phi0"][0])) and not torch.equal(got[4][0], got[3][0])


def test_one_fragment_without_delay_or_mixing_is_plain_diloco():
    shapes = [(3, 4), (4,)]
    H, rounds = 3, 4
    phi0 = [tensor(random_inputs(60 + i, s)) for i, s in enumerate(shapes)]
    per_round = as_tensors(make_grads(11, rounds, 2, H, shapes))  # [t][r][h]
    per_step = [[per_round[t][r][h] for r in range(2)] for t in range(rounds) for h in range(H)]
    got = run_streaming(phi0, per_step, [0, 0], H, 1, 0, 0.0)
    for t, expected in enumerate(slow_diloco(phi0, per_round)):
        for k in range(len(expected)):
            assert_close(got[(t + 1) * H - 1][k], expected[k].numpy(), msg=f"round {t + 1}")
