"""Each replica owns its schedule (algorithms.base): what lands when, through the loop's two calls only.

The training loop calls ``on_gradients(step)`` after a backward and ``after_inner_step(step)`` after
an optimizer step; the replica starts and lands its rounds there, tells ``SyncHooks.landed`` of each,
asks ``SyncHooks.gate`` before each, and offers the next round for announcing ahead through
``take_ahead()``. Here 2-3 replicas run that loop in threads over a ``collectives.local.LocalGroup``
(NoLoCo over an in-process stand-in for its pair exchange: a LocalGroup returns one aggregate, NoLoCo
needs its group-mates' own tensors). Assertions are on values and landed round numbers, never on
durations.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from threads import in_threads
from torch import nn

from lowcomm.algorithms.base import ReplicaSpec, RoundFailed, SyncHooks
from lowcomm.algorithms.ddp import DataParallel
from lowcomm.algorithms.demo import DemoConfig
from lowcomm.algorithms.demo_replica import Demo
from lowcomm.algorithms.diloco import DiLoCo, DilocoConfig
from lowcomm.algorithms.inner import InnerConfig
from lowcomm.algorithms.noloco import NoLoCoConfig
from lowcomm.algorithms.noloco_replica import NoLoCo
from lowcomm.algorithms.overlapped import Overlapped
from lowcomm.algorithms.registry import algorithm
from lowcomm.algorithms.streaming import StreamingConfig
from lowcomm.algorithms.streaming_replica import StreamingDiLoCo
from lowcomm.collectives.base import Collective, CollectiveError, GroupKey, NotInRound
from lowcomm.collectives.local import LocalGroup, LocalManifest
from lowcomm.collectives.pair_exchange import ExchangeResult
from lowcomm.config import RunConfig

KEY = GroupKey("schedule-test")
WAIT_S = 60.0  # a bound on joins and waits that only a broken test reaches; never asserted
GROUP_S = 30.0  # a LocalGroup round's deadline after its first start (every member starts well before)
SHAPES = [(3, 4), (4,), (2, 3), (5,)]
LR = 0.1


# ---------------------------------------------------------------------- the harness
class Blocks(nn.Module):
    """One parameter per "transformer block" (blocks.i.w), so Streaming DiLoCo strides fragments over them."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Module() for _ in SHAPES)
        for block, shape in zip(self.blocks, SHAPES):
            block.w = nn.Parameter(torch.randn(shape, generator=g))


def grads_for(replica: int, step: int) -> list[torch.Tensor]:
    """A fixed gradient per (replica, step), independent of θ."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


@torch.no_grad()
def inner_step(model: nn.Module, replica: int, step: int) -> None:
    for p, g in zip(model.parameters(), grads_for(replica, step)):
        p.sub_(g, alpha=LR)


def params(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class Landing:
    round: int
    step: object  # the step whose call landed it, or "finish"
    contributors: list[str]
    info: dict


class Track:
    """One replica's SyncHooks: landed rounds, gate calls, and a byte meter that each round sent bumps."""

    def __init__(self, gate=None, total_steps: int = 1 << 62, timeout_s: float = WAIT_S):
        self.step: object = 0
        self.landed: list[Landing] = []
        self.gated: list[int] = []
        self.sent = 0
        self._gate = gate or (lambda round_: True)
        self.total_steps, self.timeout_s = total_steps, timeout_s

    def hooks(self) -> SyncHooks:
        return SyncHooks(gate=self.gate, landed=self.on_landed, meter=lambda: self.sent, timeout_s=self.timeout_s,
                         total_steps=self.total_steps)

    def gate(self, round_: int) -> bool:
        self.gated.append(round_)
        return self._gate(round_)

    def on_landed(self, result) -> None:
        self.landed.append(Landing(result.info["round"], self.step, list(result.contributors), result.info))

    def send(self, round_: int) -> None:  # a collective's before_send: 100 "bytes" per round sent
        self.sent += 100

    def rounds(self) -> list[tuple[int, object]]:
        return [(x.round, x.step) for x in self.landed]


def replicas_of(name: str, config: RunConfig, group, tracks: list[Track], models=None, tokens=None, **spec):
    """The registry's replicas on ``group``'s members, each member's sends metered by its Track.

    ``spec``: more ReplicaSpec fields; a callable is called with the replica's model (an optimizer)."""
    models = models or [Blocks() for _ in tracks]
    out = []
    for r, (model, track) in enumerate(zip(models, tracks)):
        collective = group.member(r)
        collective.before_send = track.send
        extra = {k: v(model) if callable(v) else v for k, v in spec.items()}
        out.append(algorithm(name).replica(ReplicaSpec(model, config, collective, KEY,
                                                       tokens_per_step=(tokens or [1] * len(tracks))[r],
                                                       hooks=track.hooks(), **extra)))
    return out


def loop(replica, r: int, steps: range, track: Track, ahead: dict | None = None) -> list[bool]:
    """The runtime's loop for outer algorithms: a step, then ``after_inner_step``; what it returned per step.

    ``ahead[step]`` gets ``take_ahead()`` right after the step, and checks that a second call gives None."""
    returned = []
    for step in steps:
        inner_step(replica.model, r, step)
        track.step = step
        returned.append(replica.after_inner_step(step))
        if ahead is not None:
            ahead[step] = replica.take_ahead()
            assert replica.take_ahead() is None, f"step {step}: offered twice"
    return returned


def diloco_config(H: int, **extra) -> RunConfig:
    return RunConfig(diloco=DilocoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9, codec="fp32", **extra))


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- DiLoCo
def test_diloco_lands_round_r_after_step_r_plus_1_times_h_and_offers_the_next_round_once():
    H, rounds, count = 3, 4, 3
    tracks = [Track() for _ in range(count)]
    reps = replicas_of("diloco", diloco_config(H), LocalGroup(count, timeout_s=GROUP_S), tracks, tokens=[64] * count)
    assert all(type(rep) is DiLoCo for rep in reps)
    aheads = [{} for _ in range(count)]
    returned = in_threads(lambda r: loop(reps[r], r, range(1, rounds * H + 1), tracks[r], aheads[r]), count)
    everyone = ["peer-0", "peer-1", "peer-2"]
    for r, track in enumerate(tracks):
        assert all(returned[r])
        assert track.rounds() == [(t, (t + 1) * H) for t in range(rounds)]
        assert track.gated == list(range(rounds))
        assert all(x.contributors == everyone and x.info["weight"] == 64 * H and x.info["bytes"] == 100
                   for x in track.landed)
        assert aheads[r] == {step: step // H if step % H == 0 else None for step in range(1, rounds * H + 1)}
        assert reps[r].round == rounds and not reps[r].in_flight() and reps[r].finish() is False
        assert same(reps[r].model.parameters(), reps[r].phi)  # θ ← φ after every round
    assert len({rep.phi_hash() for rep in reps}) == 1
    assert not same(reps[0].phi, Blocks().parameters())  # it did move


def refuse_once(refused_round: int):
    """A gate that refuses ``refused_round`` the first time it is asked (the peer replaced its state)."""
    asked = set()

    def gate(round_: int) -> bool:
        first = round_ not in asked
        asked.add(round_)
        return not (round_ == refused_round and first)

    return gate


def test_the_gate_returning_false_skips_the_round_and_returns_false():
    """The peer replaced its state (drift, a test hook): the round does not run, the next call retries it."""
    H, count = 2, 2
    tracks = [Track(gate=refuse_once(1)) for _ in range(count)]
    sent_rounds = [[] for _ in range(count)]
    reps = replicas_of("diloco", diloco_config(H), LocalGroup(count, timeout_s=GROUP_S), tracks)
    for r, rep in enumerate(reps):
        rep.collective.before_send = sent_rounds[r].append

    def run(r):
        rep, out = reps[r], []
        for step in range(1, 7):
            inner_step(rep.model, r, step)
            tracks[r].step = step
            theta, phi = params(rep.model.parameters()), params(rep.phi)
            out.append(rep.after_inner_step(step))
            if step == 4:  # refused: nothing moved; round 1 is still the next one, still to announce
                assert same(rep.model.parameters(), theta) and same(rep.phi, phi)
                assert rep.round == 1 and rep.take_ahead() == 1
        return out

    returned = in_threads(run, count)
    for r in range(count):
        assert returned[r] == [True, True, True, False, True, True]
        assert tracks[r].gated == [0, 1, 1]
        assert tracks[r].rounds() == [(0, 2), (1, 6)]
        assert sent_rounds[r] == [0, 1]  # nothing was sent for the refused attempt
    assert reps[0].phi_hash() == reps[1].phi_hash()


def test_a_member_left_out_of_a_round_catches_up_on_the_same_phi():
    H, count = 2, 3
    group = LocalGroup(count, timeout_s=GROUP_S, membership={1: ["peer-0", "peer-1"]})
    tracks = [Track() for _ in range(count)]
    reps = replicas_of("diloco", diloco_config(H), group, tracks)
    hashes = [[] for _ in range(count)]

    def run(r):
        for step in range(1, 3 * H + 1):
            inner_step(reps[r].model, r, step)
            tracks[r].step = step
            assert reps[r].after_inner_step(step)
            if step % H == 0:
                hashes[r].append(reps[r].phi_hash())

    in_threads(run, count)
    assert hashes[0] == hashes[1] == hashes[2] and len(set(hashes[0])) == 3
    for r, track in enumerate(tracks):
        assert track.rounds() == [(0, 2), (1, 4), (2, 6)]
        caught_up = [bool(x.info.get("caught_up")) for x in track.landed]
        assert caught_up == ([False, True, False] if r == 2 else [False, False, False])
        assert track.landed[1].contributors == ["peer-0", "peer-1"]
        assert track.landed[2].contributors == ["peer-0", "peer-1", "peer-2"]
        assert same(reps[r].model.parameters(), reps[r].phi)
    assert tracks[2].sent == 200  # it sent nothing for the round it was left out of


def test_a_failing_round_raises_round_failed_and_keeps_the_state():
    H = 2
    track = Track()
    [rep] = replicas_of("diloco", diloco_config(H), LocalGroup(1, timeout_s=GROUP_S), [track])

    def crash(round_):
        if round_ == 1:
            raise CollectiveError("injected: the round's owner is gone")

    rep.collective.before_send = crash
    assert loop(rep, 0, range(1, 4), track) == [True, True, True]
    inner_step(rep.model, 0, 4)
    theta, phi = params(rep.model.parameters()), params(rep.phi)
    with pytest.raises(RoundFailed, match="injected") as failed:
        rep.after_inner_step(4)
    assert failed.value.round == 1 and rep.round == 1
    assert track.rounds() == [(0, 2)]
    assert same(rep.model.parameters(), theta) and same(rep.phi, phi)


def test_a_round_left_out_whose_catch_up_fails_raises_round_failed():
    group = LocalGroup(2, timeout_s=GROUP_S, membership={0: ["peer-0"]})
    track = Track()
    rep = DiLoCo(Blocks(), DilocoConfig(inner_steps=1), group.member(1), KEY, hooks=track.hooks())

    def unavailable(key, round_, numel, manifest):
        assert isinstance(manifest, LocalManifest) and manifest.members == ["peer-0"]
        raise CollectiveError("no member answered")

    rep.collective.catch_up = unavailable
    inner_step(rep.model, 1, 1)
    with pytest.raises(RoundFailed, match="catching up failed: no member answered") as failed:
        rep.after_inner_step(1)
    assert failed.value.round == 0 and rep.round == 0 and track.landed == []


# ---------------------------------------------------------------------- Streaming DiLoCo
def test_streaming_lands_fragment_rounds_at_their_apply_steps_and_offers_ahead_only_when_idle():
    H, P, tau, steps, count = 4, 2, 1, 10, 2
    config = RunConfig(diloco=DilocoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9),
                       streaming=StreamingConfig(fragments=P, fragment_sync_delay=tau, codec="fp32"))
    tracks = [Track(total_steps=steps) for _ in range(count)]
    group = LocalGroup(count, codec=algorithm("streaming-diloco").codec(config), timeout_s=GROUP_S)
    reps = replicas_of("streaming-diloco", config, group, tracks)
    assert all(isinstance(rep, StreamingDiLoCo) for rep in reps)
    aheads = [{} for _ in range(count)]
    in_threads(lambda r: loop(reps[r], r, range(1, steps + 1), tracks[r], aheads[r]), count)
    # rounds start after steps 2, 4, 6, 8, 10 (fragments 1, 0, 1, 0, 1) and land τ = 1 step later;
    # the round begun at the run's last step (10) lands at once
    for r, track in enumerate(tracks):
        assert track.rounds() == [(0, 3), (1, 5), (2, 7), (3, 9), (4, 10)]
        assert [x.info["record"]["fragment"] for x in track.landed] == [1, 0, 1, 0, 1]
        assert all(isinstance(x.info["record"]["blocked_s"], float) for x in track.landed)
        assert [x.info["weight"] for x in track.landed] == [2, 2, 2, 2, 2]  # the H/P steps since the last start
        assert aheads[r] == {1: 0, 2: None, 3: 1, 4: None, 5: 2, 6: None, 7: 3, 8: None, 9: 4, 10: 5}
        assert reps[r].round == 5 and reps[r].open is None
    assert reps[0].phi_hash() == reps[1].phi_hash()


# ---------------------------------------------------------------------- the one-step-delay overlap
def run_plain_diloco(H: int, rounds: int, count: int) -> list[torch.Tensor]:
    """Plain DiLoCo's φ after ``rounds`` rounds on the same gradients (the overlap's φ with fixed gradients)."""
    tracks = [Track() for _ in range(count)]
    reps = replicas_of("diloco", diloco_config(H), LocalGroup(count, timeout_s=GROUP_S), tracks)
    in_threads(lambda r: loop(reps[r], r, range(1, rounds * H + 1), tracks[r]), count)
    return params(reps[0].phi)


def test_overlapped_lands_round_t_minus_1_at_sync_t_and_the_last_at_the_final_step():
    H, rounds, count = 2, 3, 2
    tracks = [Track(total_steps=rounds * H) for _ in range(count)]
    reps = replicas_of("diloco", diloco_config(H, overlap=True), LocalGroup(count, timeout_s=GROUP_S), tracks)
    assert all(isinstance(rep, Overlapped) for rep in reps)
    aheads = [{} for _ in range(count)]
    in_threads(lambda r: loop(reps[r], r, range(1, rounds * H + 1), tracks[r], aheads[r]), count)
    plain = run_plain_diloco(H, rounds, count)
    for r, track in enumerate(tracks):
        assert track.rounds() == [(0, 4), (1, 6), (2, 6)]
        # a landed round's bytes are what was sent since the previous landing (its reduce ran in the
        # background, so how the sends split between rounds 0 and 1 depends on timing): all of it in the end
        assert sum(x.info["bytes"] for x in track.landed) == 300
        assert [x.info["record"]["caught_up"] for x in track.landed] == [False] * 3
        assert aheads[r] == {1: None, 2: 1, 3: None, 4: 2, 5: None, 6: 3}
        assert not reps[r].in_flight() and reps[r].finish() is False
        assert same(reps[r].model.parameters(), reps[r].phi)
        torch.testing.assert_close(params(reps[r].phi), plain, rtol=1e-5, atol=1e-6)


def test_overlapped_finish_lands_the_pending_round_when_steps_are_not_a_multiple_of_h():
    H, count, steps = 2, 2, 5
    tracks = [Track(total_steps=steps) for _ in range(count)]
    reps = replicas_of("diloco", diloco_config(H, overlap=True), LocalGroup(count, timeout_s=GROUP_S), tracks)

    def run(r):
        loop(reps[r], r, range(1, steps + 1), tracks[r])
        assert tracks[r].rounds() == [(0, 4)] and reps[r].in_flight()
        tracks[r].step = "finish"
        return reps[r].finish()

    assert in_threads(run, count) == [True, True]
    plain = run_plain_diloco(H, 2, count)  # the 5th step's progress is not in any round
    for r, track in enumerate(tracks):
        assert track.rounds() == [(0, 4), (1, "finish")]
        assert not reps[r].in_flight() and reps[r].finish() is False
        assert same(reps[r].model.parameters(), reps[r].phi)  # θ ← φ: the final evaluation's model
        torch.testing.assert_close(params(reps[r].phi), plain, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- per-step replicas: ddp and DeMo
def set_grads(model: nn.Module, r: int, step: int) -> list[torch.Tensor]:
    grads = grads_for(r, step)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    return grads


def test_ddp_syncs_in_on_gradients_and_the_caller_steps_the_optimizer():
    count, steps, tokens = 2, 3, [1, 3]
    config = RunConfig()
    tracks = [Track() for _ in range(count)]
    reps = replicas_of("ddp", config, LocalGroup(count, timeout_s=GROUP_S), tracks, tokens=tokens,
                       optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert all(isinstance(rep, DataParallel) for rep in reps)
    assert reps[0].per_step and reps[0].steps_inner_optimizer and not reps[0].catches_up

    def run(r):
        rep = reps[r]
        for step in range(steps):
            grads = set_grads(rep.model, r, step)
            before = params(rep.model.parameters())
            tracks[r].step = step
            assert rep.on_gradients(step) is True
            assert same(rep.model.parameters(), before)  # the replica only averaged the gradients
            seen[r].append(([p.grad.clone() for p in rep.model.parameters()], grads))
            rep.optimizer.step()
            assert rep.after_inner_step(step + 1) is True and rep.take_ahead() is None
        return len(tracks[r].landed)

    seen = [[] for _ in range(count)]  # per replica and step: (the averaged gradient, its own)
    assert in_threads(run, count) == [steps, steps]
    for r, track in enumerate(tracks):
        assert track.rounds() == [(s, s) for s in range(steps)]  # the round is the step, landed in on_gradients
        assert all(x.info["weight"] == tokens[r] for x in track.landed)
        for step in range(steps):
            averaged = seen[r][step][0]
            own = [seen[q][step][1] for q in range(count)]
            for k, g in enumerate(averaged):
                expected = (own[0][k] * tokens[0] + own[1][k] * tokens[1]) / sum(tokens)  # token-weighted
                torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-7)
                assert torch.equal(g, seen[0][step][0][k])
    assert reps[0].phi_hash() == reps[1].phi_hash()


def test_ddp_left_out_of_a_step_fails_the_round_it_cannot_catch_up():
    group = LocalGroup(2, timeout_s=GROUP_S, membership={0: ["peer-0"]})
    track = Track()
    model = Blocks()
    rep = DataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1), group.member(1), KEY, hooks=track.hooks())
    set_grads(model, 1, 0)
    with pytest.raises(RoundFailed, match="not a member") as failed:
        rep.on_gradients(0)
    assert failed.value.round == 0 and track.landed == []


def test_demo_syncs_in_on_gradients_and_replaces_the_inner_optimizer_step():
    count, steps = 2, 3
    inner = InnerConfig()
    config = RunConfig(inner=inner, demo=DemoConfig(lr=0.02, beta=0.9, topk=2, chunk=4))
    tracks = [Track(gate=lambda step: step != 1) for _ in range(count)]  # step 1: the peer replaced its state
    sent = [[] for _ in range(count)]
    group = LocalGroup(count, combiner=algorithm("demo").combiner(config, SHAPES), timeout_s=GROUP_S)
    reps = replicas_of("demo", config, group, tracks, lr_at=lambda model: (lambda step: inner.lr * (step + 1) / 4))
    for r, rep in enumerate(reps):
        rep.collective.before_send = sent[r].append
    assert all(isinstance(rep, Demo) for rep in reps)
    assert reps[0].per_step and not reps[0].steps_inner_optimizer and not reps[0].catches_up
    moves = [[] for _ in range(count)]

    def run(r):
        rep, returned = reps[r], []
        for step in range(steps):
            set_grads(rep.model, r, step)
            before = params(rep.model.parameters())
            tracks[r].step = step
            returned.append(rep.on_gradients(step))
            moves[r].append([p.detach() - b for p, b in zip(rep.model.parameters(), before)])
            assert rep.after_inner_step(step + 1) is True and rep.take_ahead() is None
        return returned

    assert in_threads(run, count) == [[True, False, True]] * count
    for r, track in enumerate(tracks):
        assert track.rounds() == [(0, 0), (2, 2)] and track.gated == [0, 1, 2]
        assert sent[r] == [0, 2]
        assert all(bool((m == 0).all()) for m in moves[r][1])  # the refused step moved nothing
        for step in (0, 2):  # the sign step: a coordinate moves by 0 or η_step, DeMo's lr on the run's warm-up
            eta = config.demo.lr * (step + 1) / 4
            for m in moves[r][step]:
                torch.testing.assert_close(m.abs()[m != 0], torch.full_like(m[m != 0], eta), rtol=1e-4, atol=0)
            assert any(bool((m != 0).any()) for m in moves[r][step])
    assert same(reps[0].model.parameters(), reps[1].model.parameters())


# ---------------------------------------------------------------------- NoLoCo
class Pairs:
    """An in-process stand-in for PairExchange: one group of every member that is in the round.

    A member's result holds its mates' tensors once all of them started the round; a member outside
    ``membership[round]`` gets NotInRound with the round's manifest, as PairExchange's agreement says.
    """

    def __init__(self, ids: list[str], membership: dict[int, list[str]] | None = None):
        self.ids, self.membership = ids, membership or {}
        self.sent: dict[tuple[int, str], list[torch.Tensor]] = {}
        self.cond = threading.Condition()

    def member(self, r: int) -> "PairMember":
        return PairMember(self, self.ids[r])

    def members(self, round_: int) -> list[str]:
        return sorted(self.membership.get(round_, self.ids))


class PairMember(Collective):
    def __init__(self, pairs: Pairs, me: str):
        self.pairs, self.me = pairs, me

    def start(self, key, round_, tensors, weight=1.0):
        pairs = self.pairs
        group = pairs.members(round_)
        if self.me in group:
            if self.before_send is not None:
                self.before_send(round_)
            with pairs.cond:
                pairs.sent[(round_, self.me)] = [t.detach().clone() for t in tensors]
                pairs.cond.notify_all()
        return PairHandle(self, round_, tuple(group))

    def catch_up(self, key, round_, numel, manifest):
        raise CollectiveError("a pair exchange has no round result to catch up on")


class PairHandle:
    def __init__(self, member: PairMember, round_: int, group: tuple[str, ...]):
        self.member, self.round, self.group = member, round_, group

    def done(self) -> bool:
        return True

    def result(self, timeout=None) -> ExchangeResult:
        me, pairs = self.member.me, self.member.pairs
        if me not in self.group:
            raise NotInRound(f"round {self.round}: {me} is not a member", LocalManifest(self.round, list(self.group)))
        with pairs.cond:
            assert pairs.cond.wait_for(lambda: all((self.round, p) in pairs.sent for p in self.group), timeout)
            received = {p: pairs.sent[(self.round, p)] for p in self.group if p != me}
        return ExchangeResult(me, self.group, received, list(self.group), list(self.group),
                              {"trained_members": len(self.group), "record": {"group": list(self.group)}})


def test_noloco_keeps_its_own_phi_never_offers_ahead_and_catches_up_alone():
    H, rounds, count = 2, 3, 2
    config = RunConfig(noloco=NoLoCoConfig(inner_steps=H, codec="fp32"))
    pairs = Pairs(["peer-0", "peer-1"], membership={1: ["peer-0"]})
    tracks = [Track() for _ in range(count)]
    models = [Blocks(seed=r) for r in range(count)]  # NoLoCo's replicas need not start from one φ
    reps = replicas_of("noloco", config, pairs, tracks, models=models)
    assert all(isinstance(rep, NoLoCo) for rep in reps)
    assert NoLoCo.shared_phi is False and reps[0].shared_phi is False
    aheads = [{} for _ in range(count)]
    in_threads(lambda r: loop(reps[r], r, range(1, rounds * H + 1), tracks[r], aheads[r]), count)
    for r, track in enumerate(tracks):
        assert track.rounds() == [(t, (t + 1) * H) for t in range(rounds)]
        assert all(value is None for value in aheads[r].values())  # no global round to announce ahead
        assert same(reps[r].model.parameters(), reps[r].phi)
    # round 1 ran without peer-1: peer-0 averaged alone, peer-1 took it as a group of one
    assert [x.contributors for x in tracks[0].landed] == [["peer-0", "peer-1"], ["peer-0"], ["peer-0", "peer-1"]]
    assert [bool(x.info.get("caught_up")) for x in tracks[1].landed] == [False, True, False]
    assert tracks[1].landed[1].contributors == ["peer-1"]
    assert tracks[1].sent == 200
    assert reps[0].phi_hash() != reps[1].phi_hash()  # each replica owns its φ
