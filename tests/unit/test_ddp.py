"""The data-parallel baseline (algorithms.ddp) over the in-process collective.

Replicas with different gradients end every step with the token-weighted mean gradient and, after
the optimizer step, identical parameters; the state a joiner downloads (parameters and AdamW state)
round-trips exactly and matches ``expected_shapes``.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from lowcomm.algorithms.ddp import DataParallel
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import LocalGroup

KEY = GroupKey("ddp-test")


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def backward(model: nn.Module, seed: int) -> list[torch.Tensor]:
    """One local gradient on this replica's own batch; returns a copy of it."""
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def replicas(count: int, group: LocalGroup) -> list[DataParallel]:
    base = tiny_model()
    out = []
    for i in range(count):
        model = copy.deepcopy(base)
        out.append(DataParallel(model, optimizer_for(model), group.member(i), KEY))
    return out


def sync_all(dps: list[DataParallel], round_: int, weights: list[float]):
    """Every replica syncs at once (each in its own thread, as peers would)."""
    results = [None] * len(dps)

    def run(i):
        results[i] = dps[i].sync(round_, weights[i], timeout=30)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(dps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_replicas_apply_the_weighted_mean_gradient_and_stay_identical():
    dps = replicas(3, LocalGroup(3, timeout_s=10))
    weights = [512.0, 1024.0, 2048.0]
    for step in range(4):
        grads = [backward(dp.model, seed=10 * step + i) for i, dp in enumerate(dps)]
        results = sync_all(dps, step, weights)
        assert all(r.contributors == ["peer-0", "peer-1", "peer-2"] for r in results)
        for k, params in enumerate(zip(*(dp.model.parameters() for dp in dps))):
            mean = sum(g[k] * w for g, w in zip(grads, weights)) / sum(weights)
            for p in params:
                torch.testing.assert_close(p.grad, mean, rtol=1e-6, atol=1e-7)
                assert torch.equal(p.grad, params[0].grad)
        for dp in dps:
            dp.optimizer.step()
        for params in zip(*(dp.model.parameters() for dp in dps)):
            assert all(torch.equal(p, params[0]) for p in params)
        assert len({dp.phi_hash() for dp in dps}) == 1
    assert not torch.equal(next(dps[0].model.parameters()), next(tiny_model().parameters()))  # it did train


def test_state_round_trip_carries_parameters_and_adam_state():
    dp = replicas(1, LocalGroup(1))[0]
    for step in range(3):
        backward(dp.model, seed=step)
        dp.sync(step, 1.0, timeout=30)
        dp.optimizer.step()
    state = copy.deepcopy(dp.state_tensors())
    assert dp.expected_shapes() == {name: tuple(t.shape) for name, t in state.items()}
    assert any(name.startswith("adam.exp_avg_sq.") and t.abs().sum() > 0 for name, t in state.items())

    joiner_model = tiny_model(seed=7)
    joiner = DataParallel(joiner_model, optimizer_for(joiner_model), LocalGroup(1).member(0), KEY)
    assert joiner.state_tensors()[next(n for n in state if n.startswith("adam.step."))].item() == 0.0
    joiner.load_state_tensors(state)
    for name, t in joiner.state_tensors().items():
        assert torch.equal(t, state[name]), name
    assert joiner.phi_hash() == dp.phi_hash()
    for replica in (dp, joiner):  # the same next step lands on the same parameters: the Adam state came along
        backward(replica.model, seed=99)
        replica.sync(3, 1.0, timeout=30)
        replica.optimizer.step()
    assert joiner.phi_hash() == dp.phi_hash()

    fresh_model = tiny_model(seed=3)  # a state at step 0 (nothing trained yet) leaves the optimizer empty
    fresh = DataParallel(fresh_model, optimizer_for(fresh_model), LocalGroup(1).member(0), KEY)
    fresh.load_state_tensors(fresh.state_tensors())
    assert len(fresh.optimizer.state) == 0
