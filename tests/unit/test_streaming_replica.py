"""The Streaming DiLoCo replica (algorithms.streaming_replica) on in-process collectives: equal to
DiLoCo with one fragment and no delay, and equal to a slow reference of ALGORITHMS.md §1 with P = 2
fragments and a delay, on fixed gradient sequences (gradients that ignore θ)."""

from __future__ import annotations

import copy

import pytest
import torch
from golden import assert_close, golden, tensor
from torch import nn

from lowcomm.algorithms.diloco import DiLoCo, DilocoConfig
from lowcomm.algorithms.streaming import StreamingConfig
from lowcomm.algorithms.streaming_replica import StreamingDiLoCo
from lowcomm.collectives.base import GroupKey, InProcessGroup, RoundResult
from lowcomm.compress import get_codec
from lowcomm.models.gpt import GPT, ModelConfig

KEY = GroupKey("streaming-test")
OUTER_LR, MOMENTUM, INNER_LR = 0.7, 0.9, 0.1


class Blocks(nn.Module):
    """One parameter per "transformer block": fragment of parameter i is i mod P."""

    def __init__(self, values):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in values)
        for block, v in zip(self.blocks, values):
            block.w = nn.Parameter(v.clone())


def fixed_grads(seed, steps, replicas, shapes):
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randn(*s, generator=g) for s in shapes] for _ in range(replicas)] for _ in range(steps)]


def inner_step(model, grads, lr=INNER_LR):
    """One inner SGD step on a fixed gradient (it ignores θ)."""
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(g, alpha=lr)


def drive_streaming(algos, models, grads, weight=1.0):
    """The peer loop's schedule (runtime.peer._streaming_step) on R replicas; φ and θ after every step."""
    trajectory, open_rounds = [], {}
    for step, step_grads in enumerate(grads, start=1):
        for model, g in zip(models, step_grads):
            inner_step(model, g)
        round_ = algos[0].round_starting(step)
        due = [r for r, _ in open_rounds.items() if algos[0].apply_step(r) <= step]
        for r in due:
            for algo, handle in zip(algos, open_rounds.pop(r)):
                algo.finish_sync(r, handle, 5)
        if round_ is not None:
            open_rounds[round_] = [a.start_sync(round_, weight) for a in algos]
            if algos[0].apply_step(round_) <= step:
                for algo, handle in zip(algos, open_rounds.pop(round_)):
                    algo.finish_sync(round_, handle, 5)
        assert len({a.phi_hash() for a in algos}) == 1, f"step {step}: replicas disagree on φ"
        trajectory.append(([p.detach().clone() for p in algos[0].phi],
                           [[p.detach().clone() for p in m.parameters()] for m in models]))
    return trajectory


def streaming_replicas(models, H, P, tau, alpha, codec=None):
    group = InProcessGroup(len(models), codec=codec)
    diloco = DilocoConfig(inner_steps=H, outer_lr=OUTER_LR, outer_momentum=MOMENTUM)
    config = StreamingConfig(fragments=P, fragment_sync_delay=tau, alpha=alpha)
    return [StreamingDiLoCo(m, diloco, config, group.replica(i), KEY) for i, m in enumerate(models)]


def slow_reference(phi0, grads, assignment, H, P, tau, alpha):
    """ALGORITHMS.md §1 written out: fragment p starts at p·⌊H/P⌋ + kH (≥ 1) on Δ_p = φ_p − θ_p, and τ
    steps later φ_p takes a Nesterov step on the mean Δ_p and every θ_p ← φ_p + α(θ_p − φ_p)."""
    steps, replicas = len(grads), len(grads[0])
    starts = {p: {t for t in range(p * (H // P), steps + 1, H) if t >= 1} for p in range(P)}
    phi = [p.clone() for p in phi0]
    momentum = [torch.zeros_like(p) for p in phi0]
    thetas = [[p.clone() for p in phi0] for _ in range(replicas)]
    in_flight, out = {}, []
    for step in range(1, steps + 1):
        for theta, g in zip(thetas, grads[step - 1]):
            for k in range(len(theta)):
                theta[k] = theta[k] - INNER_LR * g[k]
        for p in range(P):
            mine = [k for k in range(len(phi)) if assignment[k] == p]
            if step - tau in starts[p]:
                for k, mean in in_flight.pop(p).items():
                    momentum[k] = MOMENTUM * momentum[k] + mean
                    phi[k] = phi[k] - OUTER_LR * (mean + MOMENTUM * momentum[k])
                    for theta in thetas:
                        theta[k] = phi[k] + alpha * (theta[k] - phi[k])
            if step in starts[p]:
                in_flight[p] = {k: sum(phi[k] - theta[k] for theta in thetas) / replicas for k in mine}
        out.append(([p.clone() for p in phi], [[t.clone() for t in theta] for theta in thetas]))
    return out


@pytest.mark.parametrize("codec", [None, "uint8"])
def test_one_fragment_without_delay_or_mixing_is_diloco(codec):
    """P = 1, τ = 0, α = 0 on a GPT: the same φ, momentum and θ as DiLoCo, bit for bit, every step."""
    H, rounds, replicas = 4, 3, 2
    torch.manual_seed(0)
    first = GPT(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, context=8))
    a_models = [copy.deepcopy(first) for _ in range(replicas)]
    b_models = [copy.deepcopy(first) for _ in range(replicas)]
    shapes = [tuple(p.shape) for p in first.parameters()]
    grads = fixed_grads(1, H * rounds, replicas, shapes)
    group = InProcessGroup(replicas, codec=get_codec(codec) if codec else None)
    diloco = [DiLoCo(m, DilocoConfig(inner_steps=H, outer_lr=OUTER_LR, outer_momentum=MOMENTUM), group.replica(i),
                     KEY) for i, m in enumerate(a_models)]
    streaming = streaming_replicas(b_models, H, 1, 0, 0.0, get_codec(codec) if codec else None)
    got = drive_streaming(streaming, b_models, grads)
    for step, step_grads in enumerate(grads, start=1):
        for model, g in zip(a_models, step_grads):
            inner_step(model, g)
        if step % H == 0:
            handles = [d.start_sync(step // H - 1, 1.0) for d in diloco]
            for d, h in zip(diloco, handles):
                d.apply(h.result(5))
        phi, thetas = got[step - 1]
        assert all(torch.equal(a, b) for a, b in zip(phi, diloco[0].phi)), f"step {step}: φ"
        for theta, model in zip(thetas, a_models):
            assert all(torch.equal(a, b) for a, b in zip(theta, model.parameters())), f"step {step}: θ"
    for name, value in diloco[0].state_tensors().items():
        assert torch.equal(value, streaming[0].state_tensors()[name]), name


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_two_fragments_with_delay_follow_the_slow_reference(alpha):
    H, P, tau, replicas, steps = 6, 2, 2, 3, 26
    g = torch.Generator().manual_seed(3)
    shapes = [(3, 4), (4,), (2, 3), (5,), (2, 2)]
    phi0 = [torch.randn(*s, generator=g) for s in shapes]
    models = [Blocks(phi0) for _ in range(replicas)]
    grads = fixed_grads(7, steps, replicas, shapes)
    got = drive_streaming(streaming_replicas(models, H, P, tau, alpha), models, grads)
    slow = slow_reference(phi0, grads, [k % P for k in range(len(shapes))], H, P, tau, alpha)
    for step, ((phi, thetas), (slow_phi, slow_thetas)) in enumerate(zip(got, slow), start=1):
        for k in range(len(phi)):
            assert_close(phi[k], slow_phi[k].numpy(), msg=f"step {step}, φ[{k}]")
            for r in range(replicas):
                assert_close(thetas[r][k], slow_thetas[r][k].numpy(), msg=f"step {step}, replica {r}, θ[{k}]")
    # fragment 1 (odd parameters) starts at step 3 and lands at 5; fragment 0 starts at 6 and lands at 8
    assert torch.equal(got[3][0][1], phi0[1]) and not torch.equal(got[4][0][1], phi0[1])
    assert torch.equal(got[6][0][0], phi0[0]) and not torch.equal(got[7][0][0], phi0[0])


def test_replica_reproduces_the_stored_schedule_fixture():
    """tests/fixtures/algorithms_streaming.json (the pure schedule's golden trajectory) from the replica."""
    fixture = golden("algorithms_streaming", lambda: pytest.fail("the schedule test owns this fixture"))
    assert fixture["assignment"] == [0, 1, 0, 1]
    phi0 = [tensor(p) for p in fixture["phi0"]]
    grads = [[[tensor(g) for g in r] for r in t] for t in fixture["grads"]]
    models = [Blocks(phi0) for _ in grads[0]]
    algos = streaming_replicas(models, fixture["H"], fixture["P"], fixture["tau"], fixture["alpha"])
    for step, ((phi, _), stored) in enumerate(zip(drive_streaming(algos, models, grads), fixture["trajectory"]), 1):
        for k in range(len(phi)):
            assert_close(phi[k], stored[k], msg=f"step {step}, param {k}")


def test_rounds_map_to_fragments_and_steps():
    models = [Blocks([torch.zeros(2) for _ in range(4)])]
    algo = streaming_replicas(models, 10, 3, 2, 0.0)[0]
    starts = [algo.start_step(n) for n in range(7)]
    assert starts == [3, 6, 10, 13, 16, 20, 23]
    assert [algo.fragment_of(n) for n in range(7)] == [1, 2, 0, 1, 2, 0, 1]
    assert [algo.round_starting(s) for s in starts] == list(range(7))
    assert algo.round_starting(4) is None and algo.apply_step(2) == 12
    assert [algo.fragment_numel(p) for p in range(3)] == [4, 2, 2]  # blocks 0 and 3 share fragment 0


class RecordingCollective:
    def __init__(self):
        self.calls = []

    def start(self, key, round_, payload, weight=1.0, donate=False):
        self.calls.append(("start", round_, payload.numel()))
        raise AssertionError("not used")

    def catch_up(self, key, round_, numel, manifest):
        self.calls.append(("catch_up", round_, numel))
        return RoundResult(torch.ones(numel), ["other"], ["other"])


def test_catch_up_fetches_and_applies_only_the_rounds_fragment():
    values = [torch.zeros(3), torch.zeros(5), torch.zeros(2)]
    model = Blocks(values)
    collective = RecordingCollective()
    algo = StreamingDiLoCo(model, DilocoConfig(inner_steps=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
                           StreamingConfig(fragments=2, fragment_sync_delay=1), collective, KEY)
    algo.catch_up(0, manifest=object())  # round 0 is fragment 1: parameter 1 only
    assert collective.calls == [("catch_up", 0, 5)]
    assert [p.tolist() for p in algo.phi] == [[0.0] * 3, [-1.0] * 5, [0.0] * 2]
    assert [p.tolist() for p in model.parameters()] == [[0.0] * 3, [-1.0] * 5, [0.0] * 2]
    with pytest.raises(TypeError, match="finish_sync"):
        algo.apply(RoundResult(torch.ones(10), []))


def test_global_model_swaps_phi_in_and_restores_theta():
    model = Blocks([torch.zeros(2), torch.zeros(2)])
    algo = streaming_replicas([model], 4, 2, 0, 0.0)[0]
    inner_step(model, [torch.ones(2), torch.ones(2)])
    theta = [p.detach().clone() for p in model.parameters()]
    with algo.global_model() as m:
        assert all(torch.equal(p, torch.zeros(2)) for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), theta))


@pytest.mark.parametrize("P, tau, match", [(3, 0, "hold no parameter"), (2, 2, "one fragment sync in flight")])
def test_impossible_setups_are_refused(P, tau, match):
    model = Blocks([torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match=match):
        streaming_replicas([model], 4, P, tau, 0.0)
