"""DeMo one step late (demo.overlap): with gradients that do not depend on the parameters, the late
replica's parameters after step t are the plain replica's after step t − 1 (each U applied once, one
step later), except at the end of a membership epoch and of the run, where nothing stays in flight;
two late replicas on one collective stay identical. The eager update (the default) has the late
replica's φ, and its model runs ahead of φ by its own update while a step travels."""

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


def trajectories(overlap: str, replicas: int = 2, shared: bool = False) -> list[list[list[torch.Tensor]]]:
    """Per replica, its model's parameters after each step (after finish() for the last); with ``shared``,
    what its φ is then (``state_tensors``)."""
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
        for i, (m, demo) in enumerate(zip(modules, demos)):
            out[i].append([t.clone() for t in demo.state_tensors().values()] if shared
                          else [p.detach().clone() for p in m.parameters()])
    assert not any(demo.in_flight() for demo in demos)
    return out


def equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_step_late_is_the_plain_trajectory_one_step_behind_but_at_epoch_ends():
    plain, late = trajectories(""), trajectories("late")
    assert equal(late[0][-1], late[1][-1]) and equal(plain[0][-1], plain[1][-1])  # replicas identical
    for step in range(STEPS):
        ends = (step + 1) % EPOCH == 0 or step + 1 == STEPS
        want = plain[0][step] if ends else (plain[0][step - 1] if step else [p for p in model().parameters()])
        assert equal(late[0][step], want), step
    assert not equal(late[0][1], plain[0][1])  # it does lag: the test can tell the two apart


def test_eager_keeps_the_late_phi_and_runs_its_model_ahead_by_its_own_update():
    late, eager_phi, eager_model = trajectories("late"), trajectories("eager", shared=True), trajectories("eager")
    for step in range(STEPS):
        assert equal(eager_phi[0][step], late[0][step]), step  # φ: every U once, one step later
        assert equal(eager_phi[0][step], eager_phi[1][step]), step  # the replicas' φ are identical
        ends = (step + 1) % EPOCH == 0 or step + 1 == STEPS
        ahead = [m - p for m, p in zip(eager_model[0][step], eager_phi[0][step])]
        if ends:
            assert all(not d.any() for d in ahead), step  # nothing in flight: the model is φ
        else:  # −η·sign(own part): every coordinate the own payload moved is one η away
            assert all(torch.allclose(d.abs()[d != 0], torch.tensor(CONFIG.lr)) for d in ahead), step
            assert any(d.any() for d in ahead), step
            assert not equal(eager_model[0][step], eager_model[1][step])  # each runs ahead by its own


def test_eager_replica_answers_with_phi_while_a_step_travels():
    torch.manual_seed(0)
    m = model()
    group = LocalGroup(1, combiner=combiner(CONFIG, [tuple(p.shape) for p in m.parameters()]), timeout_s=30.0)
    demo = Demo(m, CONFIG, group.member(0), KEY, hooks=SyncHooks(total_steps=STEPS), overlap="eager", epoch_steps=0)
    for p, g in zip(m.parameters(), grads(0, 0, list(m.parameters()))):
        p.grad = g
    phi = [p.detach().clone() for p in m.parameters()]
    demo.on_gradients(0)
    assert demo.in_flight() and not equal(list(m.parameters()), phi)  # ahead
    assert equal(list(demo.state_tensors().values()), phi)
    with demo.global_model() as global_model:
        assert equal(list(global_model.parameters()), phi)
    assert not equal(list(m.parameters()), phi)  # ahead again after the evaluation
    demo.load_state_tensors({k: t + 1 for k, t in demo.state_tensors().items()})
    assert equal(list(demo.state_tensors().values()), [t + 1 for t in phi])


def test_alone_the_eager_model_is_the_plain_trajectory():
    """With one replica its own update is the whole U: the model runs ahead onto the plain trajectory."""
    plain, eager = trajectories("", replicas=1), trajectories("eager", replicas=1)
    for step in range(STEPS):
        assert equal(eager[0][step], plain[0][step]), step
