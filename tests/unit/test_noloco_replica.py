"""The NoLoCo replica (the peer-facing side of algorithms.noloco) on an in-process stand-in for the
pair exchange: its update is noloco.outer_step on (own ∪ arrivals), a missing mate or a round it was
left out of is a group of one, and its state (φ and momentum) round-trips for joiners."""

from __future__ import annotations

import torch
from torch import nn

from lowcomm.algorithms.noloco import NoLoCoConfig, contribution, outer_step
from lowcomm.algorithms.noloco_replica import NoLoCo
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.pair_exchange import ExchangeResult

KEY = GroupKey("replica-test")


class Pairs:
    """Every replica's tensors per round; a result holds the group-mates' that were not dropped."""

    def __init__(self, group: tuple[str, ...], drop: frozenset[str] = frozenset()):
        self.group, self.drop, self.sent = group, drop, {}

    def member(self, me: str) -> "PairsMember":
        return PairsMember(self, me)


class PairsMember:
    def __init__(self, pairs: Pairs, me: str):
        self.pairs, self.me = pairs, me

    def start(self, key, round_, tensors, weight=1.0):
        self.pairs.sent[self.me] = [t.clone() for t in tensors]
        return self

    def result(self, timeout=None) -> ExchangeResult:
        received = {p: self.pairs.sent[p] for p in self.pairs.group
                    if p != self.me and p in self.pairs.sent and p not in self.pairs.drop}
        contributors = [p for p in self.pairs.group if p == self.me or p in received]
        return ExchangeResult(self.me, self.pairs.group, received, contributors, list(self.pairs.group),
                              {"trained_members": len(self.pairs.group)})


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))


def train_a_bit(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)


def test_one_round_is_the_outer_step_on_the_pair_and_theta_becomes_phi():
    config = NoLoCoConfig(outer_lr=0.7, momentum=0.5)
    pairs = Pairs(("a", "b"))
    replicas = {p: NoLoCo(tiny_model(0), config, pairs.member(p), KEY) for p in ("a", "b")}
    replicas["b"].phi[0].add_(1.0)  # the two replicas hold different φ, as NoLoCo's replicas do
    replicas["b"].load_phi_into_model()
    for seed, (p, r) in enumerate(replicas.items()):
        train_a_bit(r.model, seed + 1)
    expected = {}
    contributions = {p: contribution([t.detach() for t in r.model.parameters()], r.phi) for p, r in replicas.items()}
    for p, r in replicas.items():
        phi, m = [t.clone() for t in r.phi], [t.clone() for t in r.momentum]
        outer_step(phi, m, [contributions["a"], contributions["b"]], config)  # group order: a, b
        expected[p] = phi
    handles = {p: r.start_sync(0, 1.0) for p, r in replicas.items()}
    for p, r in replicas.items():
        r.apply(handles[p].result())
        for got, want, live in zip(r.phi, expected[p], r.model.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(live.detach(), got, rtol=0, atol=0)  # θ ← φ
    assert not torch.equal(replicas["a"].phi[0], replicas["b"].phi[0])  # m differs: φ stays per replica
    assert NoLoCo.shared_phi is False


def test_a_missing_mate_and_a_round_left_out_are_both_a_group_of_one():
    config = NoLoCoConfig()
    for left_out in (False, True):
        pairs = Pairs(("a", "b"), drop=frozenset({"b"}))
        replica = NoLoCo(tiny_model(0), config, pairs.member("a"), KEY)
        train_a_bit(replica.model, 7)
        own = contribution([t.detach() for t in replica.model.parameters()], replica.phi)
        phi, m = [t.clone() for t in replica.phi], [t.clone() for t in replica.momentum]
        outer_step(phi, m, [own], config)
        if left_out:
            replica.collective.me = "a"
            result = replica.catch_up(0, manifest=None)
            assert result.info["caught_up"] and result.participants == []
        else:
            result = replica.sync(0, 1.0)
        assert result.contributors == ["a"]
        for got, want in zip(replica.phi, phi):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_carries_phi_and_momentum_to_a_joiner():
    config = NoLoCoConfig()
    pairs = Pairs(("a",))
    donor = NoLoCo(tiny_model(0), config, pairs.member("a"), KEY)
    train_a_bit(donor.model, 3)
    donor.sync(0, 1.0)
    assert any(m.abs().sum() > 0 for m in donor.momentum)
    joiner = NoLoCo(tiny_model(1), config, pairs.member("j"), KEY)
    state = donor.state_tensors()
    assert {k: tuple(v.shape) for k, v in state.items()} == joiner.expected_shapes()
    joiner.load_state_tensors(state)
    assert joiner.phi_hash() == donor.phi_hash()
    for a, b in zip(joiner.momentum, donor.momentum):
        assert torch.equal(a, b)
    for live, phi in zip(joiner.model.parameters(), joiner.phi):
        assert torch.equal(live.detach(), phi)
