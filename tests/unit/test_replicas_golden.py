"""The golden fixtures (tests/fixtures/*.json) drive the production replicas, built by the registry.

The algorithm tests pin the pure functions with these fixtures; here the same inputs go through the
classes the runtime runs, on their real network code path minus gRPC: R replicas, each in its own
thread (a LocalGroup round completes when every member started it), connected by a
``collectives.local.LocalGroup`` whose combiner is the registry's (dense fp32 for DiLoCo and Streaming
DiLoCo, with ``diloco.aggregate = "mean"``: the fixtures are plain means; ``SparseBundle`` for
SparseLoCo and DeMo). The inner steps are the fixtures' fixed gradient
sequences (SGD that ignores θ), so Δ = φ − θ is the fixture's pseudo-gradient. NoLoCo runs over the
production ``PairExchange`` on loopback gRPC (a LocalGroup reduces over every member and returns one
aggregate; NoLoCo needs its group-mates' own tensors), with a stand-in for the DHT's agreement.

Every replica gets the same tokens per step, so the token-weighted means are the fixtures' plain
means. Tolerances are the existing golden tests'. The fixtures are read, never regenerated here:
their producers live in the algorithm tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from golden import FIXTURES, assert_close, demo_reference, tensor
from threads import in_threads
from torch import nn

from lowcomm.algorithms.base import ReplicaSpec, SyncHooks
from lowcomm.algorithms.demo import DemoConfig, aggregate_update
from lowcomm.algorithms.demo_replica import Demo
from lowcomm.algorithms.diloco import DiLoCo, DilocoConfig
from lowcomm.algorithms.overlapped import Overlapped
from lowcomm.algorithms.registry import REDUCE, algorithm
from lowcomm.algorithms.sparseloco import SparseLoCoConfig
from lowcomm.algorithms.sparseloco_replica import SparseLoCo
from lowcomm.algorithms.streaming import StreamingConfig
from lowcomm.algorithms.streaming_replica import StreamingDiLoCo
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.combiners import DenseMean, SparseBundle
from lowcomm.collectives.local import LocalGroup
from lowcomm.config import RunConfig

REFERENCE_RTOL, REFERENCE_ATOL = 1e-6, 1e-7  # ALGORITHMS.md "Comparing with the reference vectors"
TOKENS = 256  # every replica's tokens per step: equal weights, so the weighted mean is the plain mean
WAIT_S = 60.0  # a bound on joins and waits that only a broken test reaches; never asserted
GROUP_S = 30.0  # a LocalGroup round's deadline after its first start (all members start well before)


def fixture(name: str) -> dict:
    path = FIXTURES / f"{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: the algorithm tests write it (LOWCOMM_REGEN_FIXTURES=1)")
    return json.loads(path.read_text())


class Blocks(nn.Module):
    """A module whose parameters are the fixture's tensors, one per "transformer block" (blocks.i.w)."""

    def __init__(self, values):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in values)
        for block, v in zip(self.blocks, values):
            block.w = nn.Parameter(tensor(v).clone())


@torch.no_grad()
def sgd_step(model: nn.Module, grads, lr: float) -> None:
    """One inner step on a fixed gradient, as the fixtures' slow implementations take it."""
    for p, g in zip(model.parameters(), grads):
        p.sub_(tensor(g), alpha=lr)


def snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class Landing:
    round: int
    step: int  # the inner step whose ``after_inner_step`` landed it
    phi: list[torch.Tensor]  # φ right when it landed
    info: dict
    contributors: list[str]


class Track:
    """One replica's hooks: every landed round with the step it landed at and φ right then."""

    def __init__(self, total_steps: int = 1 << 62):
        self.replica = None
        self.step = 0
        self.landed: list[Landing] = []
        self.total_steps = total_steps

    def hooks(self) -> SyncHooks:
        return SyncHooks(landed=self.on_landed, timeout_s=WAIT_S, total_steps=self.total_steps)

    def on_landed(self, result) -> None:
        phi = getattr(self.replica, "phi", None)
        phi = self.replica.model.parameters() if phi is None else phi
        self.landed.append(Landing(result.info["round"], self.step, snapshot(phi), result.info,
                                   list(result.contributors)))


def build(name: str, config: RunConfig, models, collectives, key: GroupKey, tracks: list[Track]):
    """The replicas the runtime would build: ``algorithm(name).replica(spec)`` (overlap wrapper included)."""
    replicas = []
    for model, collective, track in zip(models, collectives, tracks):
        track.replica = algorithm(name).replica(ReplicaSpec(model, config, collective, key, tokens_per_step=TOKENS,
                                                            hooks=track.hooks()))
        replicas.append(track.replica)
    return replicas


def local_group(name: str, config: RunConfig, shapes, replicas: int) -> LocalGroup:
    """The in-process group with what the runtime gives the sharded reduce: the codec and the combiner."""
    algo = algorithm(name)
    assert algo.exchange == REDUCE
    return LocalGroup(replicas, combiner=algo.combiner(config, shapes), codec=algo.codec(config), timeout_s=GROUP_S)


def drive_rounds(replicas, models, grads, inner_lr: float, tracks: list[Track], finish: bool = False) -> None:
    """The training loop (base.Replica's contract) on ``grads[t][r][h]``: step, then ``after_inner_step``;
    with ``finish``, ``finish()`` after the last step (the step it runs under is "finish")."""

    def train(r):
        step = 0
        for round_grads in grads:
            for g in round_grads[r]:
                sgd_step(models[r], g, inner_lr)
                step += 1
                tracks[r].step = step
                assert replicas[r].after_inner_step(step) is True
        if finish:
            tracks[r].step = "finish"
            assert replicas[r].finish() is True

    in_threads(train, len(replicas))


def assert_landed_trajectory(tracks: list[Track], trajectory, landing_steps, steps: int) -> None:
    """Every replica landed rounds 0, 1, … at ``landing_steps`` from every member, weighted by its tokens,
    bit-identical across replicas, with the fixture's φ. Rounds that land in one call are told after all
    of them applied (the overlap's last two at the final step): each sees the φ of the last one."""
    everyone = sorted(f"peer-{r}" for r in range(len(tracks)))
    for r, track in enumerate(tracks):
        assert [(x.round, x.step) for x in track.landed] == list(enumerate(landing_steps)), f"replica {r}"
        for x in track.landed:
            assert x.contributors == everyone and x.info["weight"] == TOKENS * steps
            assert not x.info.get("caught_up") and not x.info.get("record", {}).get("caught_up")
            last = max(y.round for y in track.landed if y.step == x.step)
            for k, (got, want) in enumerate(zip(x.phi, trajectory[last])):
                assert_close(got, want, msg=f"replica {r}, round {x.round} (φ after round {last}), param {k}")
                assert torch.equal(got, tracks[0].landed[x.round].phi[k]), f"replica {r} differs from replica 0"


def landing_steps(rounds: int, steps: int, ending: str) -> list:
    """Plain: round t after step (t+1)·H. Overlap: after (t+2)·H, the last at the final step or at finish()."""
    if ending == "plain":
        return [(t + 1) * steps for t in range(rounds)]
    return [(t + 2) * steps for t in range(rounds - 1)] + [rounds * steps if ending == "final-step" else "finish"]


ENDINGS = ["plain", "final-step", "finish"]  # no overlap; the overlap ending at the run's last step, or at finish()


# ---------------------------------------------------------------------- DiLoCo and its overlap
@pytest.mark.parametrize("ending", ENDINGS)
def test_diloco_replicas_reproduce_the_golden_phi_sequence(ending):
    """algorithms_diloco_overlap.json is plain DiLoCo's φ per round; with fixed gradients the overlap's
    φ sequence is the same, each round landing one round later."""
    data = fixture("algorithms_diloco_overlap")
    rounds, replicas, steps = len(data["grads"]), len(data["grads"][0]), len(data["grads"][0][0])
    overlap = ending != "plain"
    config = RunConfig(diloco=DilocoConfig(inner_steps=steps, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                                           codec="fp32", overlap=overlap, aggregate="mean"))
    models = [Blocks(data["phi0"]) for _ in range(replicas)]
    group = local_group("diloco", config, [tuple(p.shape) for p in models[0].parameters()], replicas)
    assert isinstance(group.combiner, DenseMean) and group.combiner.name == "fp32"
    tracks = [Track(total_steps=rounds * steps if ending != "finish" else 1 << 62) for _ in range(replicas)]
    reps = build("diloco", config, models, [group.member(r) for r in range(replicas)], GroupKey("golden-diloco"),
                 tracks)
    assert all(isinstance(rep.inner if overlap else rep, DiLoCo) for rep in reps)
    assert all(isinstance(rep, Overlapped) == overlap for rep in reps)
    drive_rounds(reps, models, data["grads"], 0.1, tracks, finish=ending == "finish")
    assert_landed_trajectory(tracks, data["trajectory"], landing_steps(rounds, steps, ending), steps)
    for model, rep in zip(models, reps):  # the end of training: θ = φ on every replica, nothing in flight
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), rep.phi))
        assert not rep.in_flight() and rep.finish() is False


# ---------------------------------------------------------------------- SparseLoCo and its overlap
@pytest.mark.parametrize("ending", ENDINGS)
def test_sparseloco_replicas_reproduce_the_golden_trajectory(ending):
    """algorithms_sparseloco.json through SparseLoCo replicas on the registry's SparseBundle combiner;
    the overlap (error feedback on Δ_t unchanged) lands the same φ one round later."""
    data = fixture("algorithms_sparseloco")
    cfg = data["config"]
    rounds, replicas, steps = len(data["grads"]), len(data["grads"][0]), len(data["grads"][0][0])
    overlap = ending != "plain"
    config = RunConfig(sparseloco=SparseLoCoConfig(inner_steps=steps, outer_lr=cfg["outer_lr"], beta=cfg["beta"],
                                                   topk=cfg["topk"], chunk=cfg["chunk"], overlap=overlap))
    models = [Blocks(data["phi0"]) for _ in range(replicas)]
    group = local_group("sparseloco", config, [tuple(p.shape) for p in models[0].parameters()], replicas)
    assert isinstance(group.combiner, SparseBundle)
    tracks = [Track(total_steps=rounds * steps if ending != "finish" else 1 << 62) for _ in range(replicas)]
    reps = build("sparseloco", config, models, [group.member(r) for r in range(replicas)],
                 GroupKey("golden-sparseloco"), tracks)
    assert all(isinstance(rep.inner if overlap else rep, SparseLoCo) for rep in reps)
    drive_rounds(reps, models, data["grads"], data["inner_lr"], tracks, finish=ending == "finish")
    assert_landed_trajectory(tracks, data["trajectory"], landing_steps(rounds, steps, ending), steps)
    for model, rep in zip(models, reps):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), rep.phi))
        assert not rep.in_flight()


# ---------------------------------------------------------------------- DeMo
def drive_demo(reps, grads) -> list[list[list[torch.Tensor]]]:
    """``grads[s][r]`` as p.grad, then every replica's ``sync(step)`` in its own thread; params per step."""
    trajectories = [[] for _ in reps]

    def train(r):
        for s, step_grads in enumerate(grads):
            for p, g in zip(reps[r].model.parameters(), step_grads[r]):
                p.grad = g.clone()
            result = reps[r].sync(s, float(TOKENS), WAIT_S)
            assert result.contributors == sorted(f"peer-{i}" for i in range(len(reps)))
            trajectories[r].append(snapshot(reps[r].model.parameters()))

    in_threads(train, len(reps))
    return trajectories


def demo_replicas(config: RunConfig, params0, replicas: int, key: str):
    models = [Blocks(params0) for _ in range(replicas)]
    group = local_group("demo", config, [tuple(p.shape) for p in models[0].parameters()], replicas)
    assert isinstance(group.combiner, SparseBundle)
    reps = build("demo", config, models, [group.member(r) for r in range(replicas)], GroupKey(key),
                 [Track() for _ in range(replicas)])
    assert all(isinstance(rep, Demo) for rep in reps)
    return reps


@pytest.mark.parametrize("name", ["demo_float", "demo_sign"])
def test_demo_replicas_reproduce_the_golden_trajectory(name):
    """algorithms_demo_*.json through DeMo replicas (the sign case with the fixture's zero band)."""
    data = fixture(f"algorithms_{name}")
    config = RunConfig(demo=DemoConfig(**data["config"]))
    replicas = len(data["grads"][0])
    reps = demo_replicas(config, data["params0"], replicas, f"golden-{name}")
    grads = [[[tensor(g) for g in worker] for worker in step] for step in data["grads"]]
    trajectories = drive_demo(reps, grads)
    for r, trajectory in enumerate(trajectories):
        assert len(trajectory) == len(data["trajectory"])
        for s, (got, stored) in enumerate(zip(trajectory, data["trajectory"])):
            for k in range(len(got)):
                assert_close(got[k], stored[k], msg=f"replica {r}, step {s + 1}, param {k}")
                assert torch.equal(got[k], trajectories[0][s][k]), f"replica {r} differs from replica 0"


def test_demo_replicas_reproduce_the_reference_demo_trajectory():
    """shared/vectors/demo_reference.json (bloc97/DeMo's own optimizer, two workers) through DeMo replicas."""
    ref, fields = demo_reference()
    hyper = ref["hyper"]
    config = RunConfig(demo=DemoConfig(**fields))
    workers, steps = hyper["workers"], len(ref["traj"])
    reps = demo_replicas(config, [ref["W0"], ref["b0"]], workers, "golden-demo-reference")
    grads = [[[tensor(g) for g in ref["grads"][s * workers + r]] for r in range(workers)] for s in range(steps)]
    trajectories = drive_demo(reps, grads)
    for r, trajectory in enumerate(trajectories):
        for s, (got, want) in enumerate(zip(trajectory, ref["traj"])):
            for name, param in zip("Wb", got):
                assert_close(param, want[name], rtol=REFERENCE_RTOL, atol=REFERENCE_ATOL,
                             msg=f"worker {r}, step {s + 1}, {name}")


def test_demo_replicas_apply_the_zero_band_on_the_network_path():
    """The config's zero band reaches the combiner: mean ±1 coefficients whose inverse DCT has two exact
    zeros (test_algorithms_demo's case; in float32 they may come out as ±1e-8) leave those coordinates
    alone, as demo.aggregate_update with the band says; the band-less update is the pure one too."""
    coeffs = torch.tensor([[1.0, 1, -1, 1], [0, 0, -1, 0], [1, 0, -1, 0], [0, 0, 1, 0]])
    for band in (1e-5, 0.0):
        config = RunConfig(demo=DemoConfig(lr=0.5, beta=0.0, topk=16, chunk=4, zero_band=band))  # k: the whole block
        codec = config.demo.codec()
        grad = codec.inverse(coeffs) / config.demo.lr  # δ = η·g: the coefficients themselves are sent
        reps = demo_replicas(config, [torch.zeros(4, 4).tolist()], 2, f"zero-band-{band}")
        [after] = drive_demo(reps, [[[grad], [grad]]])[0]
        update = aggregate_update([codec.encode(grad * config.demo.lr)], codec, (4, 4), band)
        assert torch.equal(after[0], -config.demo.lr * update.sign())
        if band:
            exact_zero = torch.tensor([[False] * 4, [True, False, False, False], [False, False, False, True],
                                       [False] * 4])
            assert torch.equal(after[0] == 0, exact_zero)


# ---------------------------------------------------------------------- Streaming DiLoCo
def test_streaming_replicas_reproduce_the_golden_schedule_trajectory():
    """algorithms_streaming.json (φ after every inner step, P = 2, τ = 1, α = 0.5) through
    StreamingDiLoCo replicas driven by ``after_inner_step`` alone, ending at the run's last step."""
    data = fixture("algorithms_streaming")
    H, P, tau, alpha = data["H"], data["P"], data["tau"], data["alpha"]
    steps, replicas = len(data["grads"]), len(data["grads"][0])
    config = RunConfig(diloco=DilocoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                                           codec="fp32", aggregate="mean"),
                       streaming=StreamingConfig(fragments=P, fragment_sync_delay=tau, alpha=alpha, codec="fp32"))
    models = [Blocks(data["phi0"]) for _ in range(replicas)]
    group = local_group("streaming-diloco", config, [tuple(p.shape) for p in models[0].parameters()], replicas)
    tracks = [Track(total_steps=steps) for _ in range(replicas)]
    reps = build("streaming-diloco", config, models, [group.member(r) for r in range(replicas)],
                 GroupKey("golden-streaming"), tracks)
    assert all(isinstance(rep, StreamingDiLoCo) for rep in reps)
    assert [next(p for p, idx in enumerate(reps[0].members) if k in idx) for k in range(len(data["phi0"]))] == \
        data["assignment"]  # the module's strided fragments are the fixture's
    trajectories = [[] for _ in range(replicas)]

    def train(r):
        for step, step_grads in enumerate(data["grads"], start=1):
            sgd_step(models[r], step_grads[r], 0.1)
            tracks[r].step = step
            assert reps[r].after_inner_step(step) is True
            trajectories[r].append(snapshot(reps[r].phi))

    in_threads(train, replicas)
    for r, trajectory in enumerate(trajectories):
        for step, (got, stored) in enumerate(zip(trajectory, data["trajectory"]), start=1):
            for k in range(len(got)):
                assert_close(got[k], stored[k], msg=f"replica {r}, step {step}, param {k}")
                assert torch.equal(got[k], trajectories[0][step - 1][k])
        # round n starts at its start step and lands τ steps later, one fragment at a time
        landed = [(x.round, x.step, x.info["record"]["fragment"]) for x in tracks[r].landed]
        expected = [(n, reps[r].apply_step(n), reps[r].fragment_of(n))
                    for n in range(6) if reps[r].apply_step(n) <= steps]
        assert landed == expected, f"replica {r}"
        assert not reps[r].in_flight() and reps[r].open is None
