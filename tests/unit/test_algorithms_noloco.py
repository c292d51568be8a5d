"""NoLoCo (ALGORITHMS.md §4): hash-order pairing, the outer update against a slow implementation and a
stored golden trajectory, and the fallback for a partner that did not deliver."""

from __future__ import annotations

import hashlib
import random

import torch
from golden import assert_close, golden, random_inputs, tensor, tolist

from lowcomm.algorithms.noloco import (NoLoCoConfig, contribution, delivered, group_of, groups, outer_step,
                                       pairing_order)

RUN = "golden-run"


def inner_sgd(theta, grads, lr):
    theta = [t.clone() for t in theta]
    for step in grads:
        for t, g in zip(theta, step):
            t.sub_(g, alpha=lr)
    return theta


def run_module(phi0, grads, config: NoLoCoConfig, inner_lr: float, drop=frozenset()):
    """``grads[t][r][h]``: replica r's gradients at inner step h of round t. ``drop`` holds
    (round, sender, receiver) messages that miss the deadline. Returns every replica's φ per round."""
    members = [f"peer-{r}" for r in range(len(grads[0]))]
    phis = {peer: [tensor(p) for p in phi0] for peer in members}
    thetas = {peer: [p.clone() for p in phis[peer]] for peer in members}
    momenta = {peer: [torch.zeros_like(p) for p in phis[peer]] for peer in members}
    trajectory = []
    for t, round_grads in enumerate(grads):
        sent = {}
        for r, peer in enumerate(members):
            thetas[peer] = inner_sgd(thetas[peer], [[tensor(g) for g in step] for step in round_grads[r]], inner_lr)
            sent[peer] = contribution(thetas[peer], phis[peer])
        mine = group_of(RUN, t, members, config.group_size)
        for peer in members:
            received = {other: sent[other] for other in mine[peer] if (t, other, peer) not in drop}
            arrivals = delivered(mine[peer], peer, received, sent[peer])
            thetas[peer] = outer_step(phis[peer], momenta[peer], arrivals, config)
        trajectory.append([[p.clone() for p in phis[peer]] for peer in members])
    return trajectory


# ---------------------------------------------------------------------- the slow implementation
def slow_groups(run, round_, members, size):
    key = {peer: hashlib.sha256(f"{run}\0{round_}\0{peer}".encode()).digest() for peer in members}
    pi = sorted(members, key=lambda peer: key[peer])
    n = max(1, len(pi) // size)
    out = [[pi[j + i * n] for i in range(size) if j + i * n < len(pi)] for j in range(n)]
    out[0] += pi[n * size:]
    return out


def slow_noloco(phi0, grads, cfg: dict, inner_lr: float) -> list:
    alpha, beta, gamma, size = cfg["alpha"], cfg["beta"], cfg["gamma"], cfg["group_size"]
    members = [f"peer-{r}" for r in range(len(grads[0]))]
    phi = {peer: [tensor(p) for p in phi0] for peer in members}
    theta = {peer: [p.clone() for p in phi[peer]] for peer in members}
    m = {peer: [torch.zeros_like(p) for p in phi[peer]] for peer in members}
    trajectory = []
    for t, round_grads in enumerate(grads):
        for r, peer in enumerate(members):
            theta[peer] = inner_sgd(theta[peer], [[tensor(g) for g in step] for step in round_grads[r]], inner_lr)
        new_phi = {}
        for group in slow_groups(RUN, t, members, size):
            for peer in group:
                new_phi[peer] = []
                for k in range(len(phi0)):
                    g_bar = torch.stack([theta[j][k] - phi[j][k] for j in group]).mean(0)  # progress: θ − φ
                    phi_bar = torch.stack([phi[j][k] for j in group]).mean(0)
                    m[peer][k] = beta * m[peer][k] + alpha * g_bar + gamma * (phi_bar - phi[peer][k])
                    new_phi[peer].append(phi[peer][k] + m[peer][k])
        phi = new_phi
        theta = {peer: [p.clone() for p in phi[peer]] for peer in members}
        trajectory.append([[p.clone() for p in phi[peer]] for peer in members])
    return trajectory


CONFIG = dict(alpha=0.7, beta=0.5, gamma=0.7, group_size=2)
SHAPES = [(4, 3), (5,)]
REPLICAS, ROUNDS, INNER_STEPS, INNER_LR = 5, 4, 2, 0.1  # 5: an odd member joins group 0


def produce_golden() -> dict:
    phi0 = [random_inputs(i, shape) for i, shape in enumerate(SHAPES)]
    grads = [[[[random_inputs(1000 * t + 100 * r + 10 * h + i, shape) for i, shape in enumerate(SHAPES)]
               for h in range(INNER_STEPS)] for r in range(REPLICAS)] for t in range(ROUNDS)]
    trajectory = slow_noloco(phi0, grads, CONFIG, INNER_LR)
    return {"config": CONFIG, "inner_lr": INNER_LR, "run": RUN, "phi0": phi0, "grads": grads,
            "trajectory": [[[tolist(p) for p in peer] for peer in step] for step in trajectory]}


def test_golden_trajectory_against_slow_spec_implementation():
    fixture = golden("algorithms_noloco", produce_golden)
    cfg = fixture["config"]
    config = NoLoCoConfig(group_size=cfg["group_size"], outer_lr=cfg["alpha"], momentum=cfg["beta"])
    assert config.gamma == cfg["gamma"]
    got = run_module(fixture["phi0"], fixture["grads"], config, fixture["inner_lr"])
    slow = slow_noloco(fixture["phi0"], fixture["grads"], cfg, fixture["inner_lr"])
    for t, (mine, theirs, stored) in enumerate(zip(got, slow, fixture["trajectory"])):
        for r in range(len(mine)):
            for k in range(len(mine[r])):
                assert_close(mine[r][k], theirs[r][k], msg=f"round {t + 1}, replica {r}, param {k}: module vs slow")
                assert_close(mine[r][k], stored[r][k], msg=f"round {t + 1}, replica {r}, param {k}: module vs fixture")
    # pairs really mix: replicas differ, and not every pair stays together
    assert not torch.equal(mine[0][0], mine[1][0])


# ---------------------------------------------------------------------- pairing
MEMBERS = [f"peer-{i}" for i in range(8)]


def test_pairing_is_identical_on_every_member_whatever_its_member_order():
    expected = group_of("run", 12, MEMBERS)
    for seed in range(5):
        shuffled = MEMBERS[:]
        random.Random(seed).shuffle(shuffled)
        assert group_of("run", 12, shuffled) == expected
    assert slow_groups("run", 12, MEMBERS, 2) == [list(g) for g in groups("run", 12, MEMBERS)]


def test_different_rounds_and_runs_give_different_pairings():
    pairings = {tuple(sorted(groups("run", t, MEMBERS))) for t in range(20)}
    assert len(pairings) >= 15
    assert groups("run", 0, MEMBERS) != groups("run", 1, MEMBERS)
    assert groups("run", 0, MEMBERS) != groups("other-run", 0, MEMBERS)


def test_groups_cover_every_member_once_and_the_odd_member_joins_group_0():
    for count in range(1, 10):
        members = MEMBERS[:count] + [f"late-{i}" for i in range(max(0, count - 8))]
        for size in (1, 2, 3):
            out = groups("run", 3, members, size)
            assert sorted(p for g in out for p in g) == sorted(members)
            n = max(1, count // size)
            assert len(out) == n
            assert all(len(g) == min(size, count) for g in out[1:])
            assert len(out[0]) == min(size, count) + (count - n * size if count >= size else 0)
    pi = pairing_order("run", 3, MEMBERS[:5])
    assert groups("run", 3, MEMBERS[:5]) == [(pi[0], pi[2], pi[4]), (pi[1], pi[3])]


# ---------------------------------------------------------------------- late or gone partners
def test_a_partner_that_missed_the_deadline_leaves_a_group_of_one():
    config = NoLoCoConfig()
    phi = [torch.tensor([1.0, 2.0])]
    own = contribution([torch.tensor([1.5, 1.0])], phi)
    partner = contribution([torch.tensor([0.0, 0.0])], [torch.tensor([4.0, 4.0])])
    group = ("me", "partner")
    assert delivered(group, "me", {}, own) == [own]
    assert delivered(group, "me", {"partner": partner}, own) == [own, partner]
    assert delivered(("partner", "me"), "me", {"partner": partner}, own) == [partner, own]  # group order

    momentum = [torch.tensor([0.2, 0.2])]
    theta = outer_step(phi, momentum, delivered(group, "me", {}, own), config)
    # ḡ = own progress (0.5, −1), φ̄ − φ = 0: m = 0.5·0.2 + 0.7·ḡ
    expected_m = torch.tensor([0.1 + 0.35, 0.1 - 0.7])
    torch.testing.assert_close(momentum[0], expected_m)
    torch.testing.assert_close(phi[0], torch.tensor([1.0, 2.0]) + expected_m)
    torch.testing.assert_close(theta[0], phi[0])


def test_dropped_messages_change_only_the_receivers_that_missed_them():
    fixture = golden("algorithms_noloco", produce_golden)
    config = NoLoCoConfig(group_size=2, outer_lr=0.7, momentum=0.5)
    members = [f"peer-{r}" for r in range(REPLICAS)]
    pair = next(g for g in groups(RUN, 0, members) if len(g) == 2)
    sender, receiver = pair
    full = run_module(fixture["phi0"], fixture["grads"][:1], config, fixture["inner_lr"])
    lossy = run_module(fixture["phi0"], fixture["grads"][:1], config, fixture["inner_lr"], drop={(0, sender, receiver)})
    for r, peer in enumerate(members):
        same = all(torch.equal(a, b) for a, b in zip(full[0][r], lossy[0][r]))
        assert same == (peer != receiver), peer
