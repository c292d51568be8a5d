"""The one-step-delay overlap on the replica the peer runs (algorithms.overlapped.Overlapped).

With a fixed gradient sequence (inner steps that ignore θ), ALGORITHMS.md §1 says the overlapped
φ sequence is plain DiLoCo's, one round late: after sync(t) an overlapped replica holds φ_{t−1},
and after drain() the final φ. A replica that enters from a download catches the round in flight
up from its manifest.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lowcomm.algorithms.base import RoundFailed, SyncHooks
from lowcomm.algorithms.diloco import DiLoCo, DilocoConfig
from lowcomm.algorithms.overlap import start_rule
from lowcomm.algorithms.overlapped import Overlapped, _Applied
from lowcomm.collectives.base import CollectiveError, GroupKey, InProcessGroup, NotInRound, RoundResult

KEY = GroupKey("overlapped-test")
REPLICAS, ROUNDS, H, LR = 3, 5, 4, 0.05


def fixed_grads(seed: int = 0) -> list:
    """grads[r][t][h]: one tensor per parameter, for replica r, round t, inner step h."""
    g = torch.Generator().manual_seed(seed)
    shapes = [tuple(p.shape) for p in make_model().parameters()]
    return [[[[torch.randn(s, generator=g) for s in shapes] for _ in range(H)] for _ in range(ROUNDS)]
            for _ in range(REPLICAS)]


def make_model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


@torch.no_grad()
def inner_steps(model: nn.Module, grads) -> None:
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.sub_(LR * g)


def replicas(overlap: bool, update: str = "delayed", apply: str = "boundary"):
    group = InProcessGroup(REPLICAS)
    out = []
    for r in range(REPLICAS):
        model = make_model()
        replica = DiLoCo(model, DilocoConfig(outer_lr=0.7, outer_momentum=0.9), group.replica(r), KEY)
        out.append(Overlapped(replica, manifest_of=lambda round_: None, update=update, apply=apply)
                   if overlap else replica)
    return out


def phis(replica) -> list[torch.Tensor]:
    return [p.detach().clone() for p in replica.phi]


def run(overlap: bool, grads, update: str = "delayed") -> tuple[list, list]:
    """φ after every round's sync on replica 0 (and every replica's final φ)."""
    reps, history = replicas(overlap, update), []
    for t in range(ROUNDS):
        for r, rep in enumerate(reps):
            inner_steps(rep.model, grads[r][t])
        if overlap:
            results = [rep.sync(t, 1.0, timeout=10) for rep in reps]  # the in-process group needs all to start
            assert all((res is None) == (t == 0) for res in results)
            if t > 0:
                assert {res.info["round"] for res in results} == {t - 1}
        else:
            handles = [rep.start_sync(t, 1.0) for rep in reps]
            for rep, h in zip(reps, handles):
                rep.apply(h.result(10))
        history.append(phis(reps[0]))
    if overlap:
        finals = [rep.drain(10) for rep in reps]
        assert {res.info["round"] for res in finals} == {ROUNDS - 1}
        history.append(phis(reps[0]))
    return history, [[p.detach().clone() for p in rep.model.parameters()] for rep in reps]


def close(a, b) -> bool:
    return all(torch.allclose(x, y, atol=1e-6, rtol=0) for x, y in zip(a, b))


@pytest.mark.parametrize("update", ["delayed", "momentum", "eager", "projected"])
def test_overlap_reproduces_plain_diloco_phi_one_round_late(update):
    grads = fixed_grads()
    plain, plain_models = run(False, grads)
    lagged, lagged_models = run(True, grads, update)
    assert close(lagged[0], phis(replicas(False)[0]))  # nothing applied after the first round: φ_0
    for t in range(ROUNDS):
        assert close(lagged[t + 1], plain[t]), f"φ after round {t} differs"
    for a, b in zip(plain_models, lagged_models):  # after drain, θ = φ on every replica, as plain DiLoCo's
        assert close(a, b)


def test_overlap_keeps_own_progress_on_top_of_phi():
    """s_{t+1} = φ_{t−1} − Δ_t: after sync(t) θ is φ plus exactly this replica's round-t progress."""
    grads = fixed_grads(1)
    reps = replicas(True)
    for r, rep in enumerate(reps):
        inner_steps(rep.model, grads[r][0])
    before = [[p.detach().clone() for p in rep.model.parameters()] for rep in reps]
    for rep in reps:
        rep.sync(0, 1.0, timeout=10)
    for r, rep in enumerate(reps):
        theta = [p.detach() for p in rep.model.parameters()]
        assert close(theta, before[r])  # φ_0 − Δ_0 = θ at the end of round 0: nothing landed yet
    with reps[0].global_model():
        assert close([p.detach() for p in reps[0].model.parameters()], reps[0].phi)
    assert close([p.detach() for p in reps[0].model.parameters()], before[0])  # put back


@pytest.mark.parametrize("update", ["momentum", "eager"])
def test_each_rule_starts_the_next_round_where_algorithms_overlap_says(update):
    """Written out by hand, Nesterov SGD (b_t = μ·b_{t−1} + g, step η(g + μ·b_t)) from φ_{t−1}:
    momentum, s_{t+1} = φ_{t−1} − ημ²·b_{t−1} − Δ_t; eager, s_{t+1} = φ_{t−1} − η(Δ_t + μ(μ·b_{t−1} + Δ_t)).
    φ itself moves with the agreed means only, one round late, whatever the rule."""
    grads, lr, mu = fixed_grads(2), 0.7, 0.9
    reps = replicas(True, update)
    phi, buf, mean_before = phis(reps[0]), None, None
    for t in range(3):
        starts = [[p.detach().clone() for p in rep.model.parameters()] for rep in reps]
        for r, rep in enumerate(reps):
            inner_steps(rep.model, grads[r][t])
        deltas = [[s - p.detach() for s, p in zip(starts[r], rep.model.parameters())] for r, rep in enumerate(reps)]
        for rep in reps:
            rep.sync(t, 1.0, timeout=10)
        if mean_before is not None:  # round t − 1 landed: φ_{t−1} = the outer step on its mean
            buf = [m.clone() for m in mean_before] if buf is None else [mu * b + m for b, m in zip(buf, mean_before)]
            phi = [p - lr * (m + mu * b) for p, m, b in zip(phi, mean_before, buf)]
        assert close(phis(reps[0]), phi)
        for r, rep in enumerate(reps):
            held = buf if buf is not None else [torch.zeros_like(p) for p in phi]
            if update == "momentum":
                expected = [p - lr * mu * mu * b - d for p, b, d in zip(phi, held, deltas[r])]
            else:
                expected = [p - lr * (d + mu * (mu * b + d)) for p, b, d in zip(phi, held, deltas[r])]
            assert close([p.detach() for p in rep.model.parameters()], expected), f"round {t}, replica {r}"
        mean_before = [sum(d[k] for d in deltas) / REPLICAS for k in range(len(phi))]


@pytest.mark.parametrize("apply", ["boundary", "arrival"])
def test_the_projected_rule_starts_at_the_share_of_the_own_step_the_landed_rounds_carried(apply):
    """projected: s_{t+1} = P₀ + â·D with P₀ = φ_{t−1} − ημ²·b_{t−1} and D = −η(1+μ)·Δ_t
    (Nesterov SGD written out); â starts at 0.5 and, once round t lands on φ_t, moves 0.2 of the way to
    a* = ⟨φ_t − P₀, D⟩ / ⟨D, D⟩, per replica. On arrival it lands before the next round's inner steps,
    and θ starts them from φ_t."""
    grads, lr, mu = fixed_grads(5), 0.7, 0.9
    reps = replicas(True, "projected", apply=apply)
    phi, buf, mean_before = phis(reps[0]), None, None
    shares, made = [0.5] * REPLICAS, [None] * REPLICAS
    for t in range(4):
        starts = [theta(rep) for rep in reps]
        for r, rep in enumerate(reps):
            inner_steps(rep.model, grads[r][t])
        deltas = [[s - p.detach() for s, p in zip(starts[r], rep.model.parameters())] for r, rep in enumerate(reps)]
        for rep in reps:
            rep.sync(t, 1.0, timeout=10)
        if mean_before is not None:  # round t − 1 landed: φ_{t−1}, and each replica's â follows it
            buf = [m.clone() for m in mean_before] if buf is None else [mu * b + m for b, m in zip(buf, mean_before)]
            phi = [p - lr * (m + mu * b) for p, m, b in zip(phi, mean_before, buf)]
            for r, (base, step) in enumerate(made):
                measured = (sum(float(((p - b) * d).sum()) for p, b, d in zip(phi, base, step))
                            / sum(float((d * d).sum()) for d in step))
                shares[r] += 0.2 * (min(max(measured, 0.0), 2.0) - shares[r])
        assert close(phis(reps[0]), phi)
        held = buf if buf is not None else [torch.zeros_like(p) for p in phi]
        for r, rep in enumerate(reps):
            base = [p - lr * mu * mu * b for p, b in zip(phi, held)]
            step = [-lr * (1 + mu) * d for d in deltas[r]]
            made[r] = (base, step)
            expected = [b + shares[r] * d for b, d in zip(base, step)]
            assert close(theta(rep), expected), f"round {t}, replica {r}"
        mean_before = [sum(d[k] for d in deltas) / REPLICAS for k in range(len(phi))]
        if apply == "arrival" and t < 3:  # the next round's first inner step finds round t arrived
            assert all(rep.apply_arrived() for rep in reps)
    assert len({round(s, 9) for s in shares}) == REPLICAS and all(abs(s - 0.5) > 1e-3 for s in shares)


def test_the_projected_share_ignores_a_void_start_and_stays_in_bounds():
    """``forget`` (a downloaded state) drops the start made; D = 0 measures nothing; a* beyond [0, 2]
    counts as its bound. preview(φ, g) = φ − g here, so D = −Δ and a* is how much of −Δ φ moved."""
    rule = start_rule("projected", lambda phi, g: [p - x for p, x in zip(phi, g)])
    phi, delta = [torch.zeros(3)], [torch.ones(3)]
    assert close(rule(phi, delta), [torch.full((3,), -0.5)])
    rule.observe([torch.full((3,), -0.8)])  # a* = 0.8
    assert rule.share == pytest.approx(0.5 + 0.2 * 0.3)
    rule.observe([torch.full((3,), -5.0)])  # nothing made since: nothing measured
    assert rule.share == pytest.approx(0.56)
    rule(phi, delta)
    rule.forget()
    rule.observe([torch.full((3,), -5.0)])
    assert rule.share == pytest.approx(0.56)
    rule(phi, delta)
    rule.observe([torch.full((3,), -9.0)])  # a* = 9: counts as 2
    assert rule.share == pytest.approx(0.56 + 0.2 * (2.0 - 0.56))
    share = rule.share
    rule(phi, [torch.zeros(3)])
    rule.observe([torch.full((3,), -1.0)])  # D = 0
    assert rule.share == share


def theta(replica) -> list[torch.Tensor]:
    return [p.detach().clone() for p in replica.model.parameters()]


@pytest.mark.parametrize("update", ["delayed", "momentum", "eager", "projected"])
def test_an_aggregate_applied_on_arrival_puts_theta_where_plain_diloco_has_it(update):
    """apply = "arrival": once round t's aggregate has come (here: as soon as every replica launched
    it), the next inner step's check steps φ and moves θ by φ_t − s_{t+1}. With gradients that ignore
    θ, θ is then exactly plain DiLoCo's at the same step, whatever the start rule; the round lands
    (its result returned) at the boundary as before, and φ is not stepped twice."""
    grads = fixed_grads(3)
    plain, arriving = replicas(False), replicas(True, update, apply="arrival")
    for t in range(ROUNDS):
        for h in range(H):
            for r in range(REPLICAS):
                inner_steps(plain[r].model, [grads[r][t][h]])
                inner_steps(arriving[r].model, [grads[r][t][h]])
            if h == 0 and t > 0:
                assert all(rep.apply_arrived() for rep in arriving)
                assert not any(rep.apply_arrived() for rep in arriving)  # applied once
                for p, a in zip(plain, arriving):
                    assert close(theta(a), theta(p)), f"round {t}: θ after the aggregate arrived"
                    assert close(a.phi, p.phi)
        handles = [rep.start_sync(t, 1.0) for rep in plain]
        for rep, handle in zip(plain, handles):
            rep.apply(handle.result(10))
        results = [rep.sync(t, 1.0, timeout=10) for rep in arriving]
        assert all((res is None) == (t == 0) for res in results)
        if t > 0:
            assert {res.info["round"] for res in results} == {t - 1}
            assert close(phis(arriving[0]), phis_before)  # φ_{t−1}, stepped once, on arrival
        phis_before = phis(plain[0])
    for rep in arriving:
        assert rep.drain(10).info["round"] == ROUNDS - 1
    for p, a in zip(plain, arriving):  # after drain: θ = φ = plain DiLoCo's
        assert close(theta(a), theta(p)) and close(a.phi, p.phi)


def test_each_landed_round_records_the_inner_steps_run_before_its_aggregate_came():
    """Driven by ``after_inner_step``: every replica launches round t at its boundary, so the aggregate
    is there at the next round's first step (1); the last round, drained at the run's end with no
    step after it, records none."""
    reps, landed = lead_replicas(1.0), []
    for rep in reps:
        rep.hooks.landed = landed.append
    grads = fixed_grads(6)
    for step in range(1, 3 * H + 1):
        for r, rep in enumerate(reps):
            inner_steps(rep.model, [grads[r][(step - 1) // H][(step - 1) % H]])
            assert rep.after_inner_step(step)
    landed += [rep.drain(10) for rep in reps]  # the run's end, once every replica launched the last round
    by_round = {}
    for result in landed:
        by_round.setdefault(result.info["round"], set()).add(result.info.get("record", {}).get("arrived_after_steps"))
    assert by_round == {0: {1}, 1: {1}, 2: {None}}


def lead_replicas(lead: float) -> list[Overlapped]:
    group = InProcessGroup(REPLICAS)
    return [Overlapped(DiLoCo(make_model(), DilocoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9),
                              group.replica(r), KEY, hooks=SyncHooks(timeout_s=10)),
                       manifest_of=lambda round_: None, update="momentum", apply="arrival", lead=lead)
            for r in range(REPLICAS)]


class _Watched:
    """A round's handle that says when a replica starts waiting on it."""

    def __init__(self, handle):
        self.handle, self.waiting = handle, threading.Event()

    def result(self, timeout=None):
        if timeout:
            self.waiting.set()
        return self.handle.result(timeout)

    def done(self):
        return self.handle.done()


def test_a_replica_waits_for_the_previous_round_at_the_end_of_its_lead():
    """lead = 0.5 of H = 4: a replica whose round 0 has not come (the last replica has not launched it)
    runs round 1's first 2 inner steps, then waits there; once the round comes it is applied at
    that step, not the next one."""
    reps, grads = lead_replicas(0.5), fixed_grads(7)
    assert reps[0].lead_steps == 2
    for step in range(1, H + 1):
        for r, rep in enumerate(reps[:-1]):
            inner_steps(rep.model, [grads[r][0][step - 1]])
            assert rep.after_inner_step(step)
    watched = _Watched(reps[0].pending[1])
    reps[0].pending = (0, watched)
    landed = []
    reps[0].hooks.landed = landed.append

    def run_lead():
        for step in range(H + 1, H + 3):
            inner_steps(reps[0].model, [grads[0][1][step - H - 1]])
            reps[0].after_inner_step(step)

    lead = threading.Thread(target=run_lead, daemon=True)
    lead.start()
    assert watched.waiting.wait(10), "the replica did not wait at the end of its lead"
    assert lead.is_alive()
    for step in range(1, H + 1):  # the last replica's round 0, then its launch
        inner_steps(reps[-1].model, [grads[-1][0][step - 1]])
        assert reps[-1].after_inner_step(step)
    lead.join(10)
    assert not lead.is_alive()
    assert isinstance(reps[0].pending[1], _Applied)
    assert reps[0].pending[1].landed.info["record"]["arrived_after_steps"] == 2


def test_a_round_that_does_not_come_within_the_lead_fails_as_at_the_boundary():
    reps = lead_replicas(0.25)
    reps[0].pending = (3, _Never())
    with pytest.raises(RoundFailed):
        reps[0].after_inner_step(1)


def test_a_replica_behind_has_no_lead():
    """From a state download (a joiner, a resync) until a round it took part in lands, a replica waits
    only at the boundary: here the round that never comes does not stop its steps within the round."""
    reps = lead_replicas(0.25)
    reps[0].load_state_tensors(reps[0].state_tensors())
    reps[0].pending = (3, _Never())
    assert all(reps[0].after_inner_step(step) for step in range(1, H))


def test_a_replica_that_took_part_in_a_round_again_has_its_lead():
    """Every replica starts from a download (behind: no lead); once a round it took part in lands (at
    the boundary after it), a round that does not come stops it at the end of its lead again."""
    reps, grads = lead_replicas(0.25), fixed_grads(8)
    for rep in reps:
        rep.load_state_tensors(rep.state_tensors())
    for step in range(1, 2 * H + 1):
        for r, rep in enumerate(reps):
            inner_steps(rep.model, [grads[r][(step - 1) // H][(step - 1) % H]])
            assert rep.after_inner_step(step)
    reps[0].pending = (1, _Never())
    with pytest.raises(RoundFailed):
        reps[0].after_inner_step(2 * H + 1)
    assert reps[0].pending is None  # the failed round is dropped: the run's end does not wait for it again


@pytest.mark.parametrize("manifest", ["the-manifest", None])
def test_a_round_left_out_goes_on_at_the_lead_only_with_a_manifest_to_catch_it_up(manifest):
    reps = lead_replicas(0.25)
    late = _LeftOut(manifest)
    reps[0].pending = (3, late)
    if manifest is None:
        with pytest.raises(RoundFailed):
            reps[0].after_inner_step(1)
        assert reps[0].pending is None
    else:
        assert all(reps[0].after_inner_step(step) for step in range(1, H))  # caught up at the boundary
        assert reps[0].pending == (3, late)


def test_the_lead_is_the_least_whole_number_of_steps_not_below_its_share():
    assert [lead_replicas(lead)[0].lead_steps for lead in (0.1, 0.25, 0.3, 0.5, 0.75, 1.0)] == [1, 1, 2, 2, 3, 4]


class _LeftOut:
    def __init__(self, manifest):
        self.manifest = manifest

    def result(self, timeout=None):
        raise NotInRound("left out", manifest=self.manifest)

    def done(self):
        return True


class _Never:
    def result(self, timeout=None):
        raise TimeoutError("the round did not come")

    def done(self):
        return False


def test_an_aggregate_not_yet_arrived_waits_for_the_boundary():
    """apply = "arrival" with a round still in flight (a replica has not launched it): nothing moves."""
    reps = replicas(True, "momentum", apply="arrival")
    grads = fixed_grads(4)
    for r, rep in enumerate(reps):
        inner_steps(rep.model, grads[r][0])
    for rep in reps[:-1]:
        rep.sync(0, 1.0, timeout=10)
    before = [theta(rep) for rep in reps[:-1]]
    assert not any(rep.apply_arrived() for rep in reps[:-1])
    assert all(close(theta(rep), b) for rep, b in zip(reps[:-1], before))


def test_a_late_replica_applies_the_members_aggregate():
    """NotInRound on the pending round: the aggregate is fetched from the members and applied."""
    model = make_model()
    group = InProcessGroup(1)
    inner = DiLoCo(model, DilocoConfig(outer_lr=1.0, outer_momentum=0.0, nesterov=False), group.replica(0), KEY)
    fetched = []
    aggregate = torch.full((sum(p.numel() for p in inner.phi),), 0.5)

    def fetch_round(round_, manifest):
        fetched.append((round_, manifest))
        return RoundResult(aggregate.clone(), ["someone"], ["someone"], {"leader": "someone"})

    inner.fetch_round = fetch_round
    replica = Overlapped(inner, manifest_of=lambda round_: None)
    phi0 = phis(replica)
    replica.pending = (3, _LeftOut("the-manifest"))
    result = replica.drain(timeout=1)
    assert fetched == [(3, "the-manifest")]
    assert result.info["caught_up"] and result.info["round"] == 3
    assert close(phis(replica), [p - 0.5 for p in phi0])  # plain SGD lr 1: φ − aggregate


def test_an_entering_replica_fetches_the_round_in_flight():
    """enter(r) after a download: round r − 1's aggregate is fetched from its manifest at once, in the
    background (the members forget it two rounds later), and lands at the first sync."""
    model = make_model()
    inner = DiLoCo(model, DilocoConfig(outer_lr=1.0, outer_momentum=0.0, nesterov=False),
                   InProcessGroup(1).replica(0), KEY)
    asked, fetched = [], threading.Event()

    def fetch_round(round_, manifest):
        asked.append((round_, manifest))
        fetched.set()
        return RoundResult(torch.zeros(sum(p.numel() for p in inner.phi)), ["a"])

    inner.fetch_round = fetch_round
    manifests = {4: "manifest-4"}
    replica = Overlapped(inner, manifest_of=manifests.get)
    replica.load_state_tensors(inner.state_tensors())
    assert replica.enter(5, wait_s=1.0)
    assert fetched.wait(10)  # before any sync
    manifests.clear()  # expired from the DHT by the first sync: it was read at entry
    result = replica.sync(5, 1.0, timeout=5)
    assert asked == [(4, "manifest-4")] and result.info["round"] == 4
    assert replica.pending[0] == 5


def test_a_failed_fetch_of_the_round_in_flight_fails_the_first_sync():
    """The background fetch's error (every member forgot the round) is raised where the round lands:
    the first sync, which the schedule turns into RoundFailed (a resync)."""
    inner = DiLoCo(make_model(), DilocoConfig(), InProcessGroup(1).replica(0), KEY)

    def fetch_round(round_, manifest):
        raise CollectiveError(f"round {round_}: catching up, no member returned shards [0]")

    inner.fetch_round = fetch_round
    replica = Overlapped(inner, manifest_of={4: "manifest-4"}.get)
    replica.load_state_tensors(inner.state_tensors())
    assert replica.enter(5, wait_s=1.0)
    with pytest.raises(CollectiveError, match="round 4: catching up"):
        replica.sync(5, 1.0, timeout=5)
    assert replica.pending[0] == 5  # the round begun is the one in flight


def test_entering_without_the_rounds_manifest_drops_it():
    """A state resumed from a checkpoint: the round in flight ran in another swarm; nothing pends."""
    inner = DiLoCo(make_model(), DilocoConfig(), InProcessGroup(1).replica(0), KEY)
    replica = Overlapped(inner, manifest_of=lambda round_: None)
    assert not replica.enter(3, wait_s=0.2)
    assert replica.pending is None
