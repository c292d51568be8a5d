"""DeMo one step late (demo.overlap): with gradients that do not depend on the parameters, the late
replica's parameters after step t are the plain replica's after step t − 1 (each U applied once, one
step later), except at the end of a membership epoch and of the run, where nothing stays in flight;
two late replicas on one collective stay identical."""

from __future__ import annotations

import threading

import torch
from torch import nn

from lowcomm.algorithms.base import SyncHooks
from lowcomm.algorithms.demo import DemoConfig
from lowcomm.algorithms.demo_replica import Demo, combiner
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import LocalGroup

KEY = GroupKey("run")
STEPS, EPOCH = 7, 3
CONFIG = DemoConfig(lr=0.01, beta=0.9, topk=4, chunk=4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


def grads(replica: int, step: int, params) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


def trajectories(overlap: bool, replicas: int = 2) -> list[list[list[torch.Tensor]]]:
    """Per replica, its parameters after each step (after finish() for the last)."""
    modules = [model() for _ in range(replicas)]
    shapes = [tuple(p.shape) for p in modules[0].parameters()]
    group = LocalGroup(replicas, combiner=combiner(CONFIG, shapes), timeout_s=30.0)
    demos = [Demo(m, CONFIG, group.member(i), KEY, hooks=SyncHooks(total_steps=STEPS), overlap=overlap,
                  epoch_steps=EPOCH) for i, m in enumerate(modules)]
    out = [[] for _ in range(replicas)]
    for step in range(STEPS):
        for i, (m, demo) in enumerate(zip(modules, demos)):
            for p, g in zip(m.parameters(), grads(i, step, list(m.parameters()))):
                p.grad = g
        # every replica sends before any waits (the late replicas wait on the previous step's round)
        threads = [threading.Thread(target=demo.on_gradients, args=(step,)) for demo in demos]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, m in enumerate(modules):
            out[i].append([p.detach().clone() for p in m.parameters()])
    assert not any(demo.in_flight() for demo in demos)
    return out


def equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_step_late_is_the_plain_trajectory_one_step_behind_but_at_epoch_ends():
    plain, late = trajectories(False), trajectories(True)
    assert equal(late[0][-1], late[1][-1]) and equal(plain[0][-1], plain[1][-1])  # replicas identical
    for step in range(STEPS):
        ends = (step + 1) % EPOCH == 0 or step + 1 == STEPS
        want = plain[0][step] if ends else (plain[0][step - 1] if step else [p for p in model().parameters()])
        assert equal(late[0][step], want), step
    assert not equal(late[0][1], plain[0][1])  # it does lag: the test can tell the two apart
