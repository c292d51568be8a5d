"""A stage peer's stage: taking one (φ_0, a download, a rebuild), its snapshot, checkpoints and rollbacks.

A stage's state (φ, the outer optimizer's, the inner AdamW's, its step and lr scale) is served over
GetState under the run id `<run>/stage-<s>`, so a request reaches only replicas of that stage.
When a stage has no replica left, the mover rebuilds it from its neighbours' φ (CheckFree,
pipeline.checkfree) or, with `pipeline.recovery = "checkpoint"`, every stage goes back to the
newest round all stages have a checkpoint of (the restart baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lowcomm.algorithms.base import ReplicaSpec
from lowcomm.algorithms.registry import algorithm
from lowcomm.algorithms.state import optimizer_step
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.pipeline.checkfree import LR_SCALE, rebuild_stage
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import StageModule, initial_stage
from lowcomm.runtime.context import PeerContext
from lowcomm.runtime.membership import Membership
from lowcomm.runtime.stage_checkpoints import StageCheckpoints
from lowcomm.runtime.state_sync import MAX_STATE_BYTES
from lowcomm.runtime.state_transfer import StateError, decode_state, download_state, encode_state
from lowcomm.transport.control import PeerRecord

META = ("meta.step", "meta.lr_scale", "meta.grad_norm")


def stage_run_id(run: str, stage: int) -> str:
    return f"{run}/stage-{stage}"


class StageState:
    def __init__(self, ctx: PeerContext, membership: Membership, server: StageServer, collective: ShardedReduce,
                 checkpoints: StageCheckpoints, stage_records: Callable[[], list[PeerRecord]],
                 round_now: Callable[[], int], position: Callable[[], tuple[int, int]]):
        self.ctx, self.config, self.membership = ctx, ctx.config, membership
        self.server, self.collective, self.checkpoints = server, collective, checkpoints
        self.stage_records, self.round_now, self.position = stage_records, round_now, position
        self.stages = self.config.pipeline.stages
        self.stage = -1
        self.algo = None
        self._lr_scale, self._step = 1.0, 0
        self.rollback_done: tuple[int, int] | None = None  # (at round, to round) of the last rollback applied
        ctx.holder.run_id = stage_run_id(ctx.options.run_name, -1)  # no stage yet

    def _module(self, stage: int) -> StageModule:
        return StageModule(self.config.model, stage, self.stages, self.config.pipeline.replicate_ends)

    def _fresh(self, stage: int) -> StageModule:
        cfg = self.config
        return initial_stage(cfg.model, cfg.run.seed, stage, self.stages, cfg.pipeline.replicate_ends)

    def take(self, stage: int, how: str) -> None:
        """Serve `stage`: 'seed' (φ_0), else its state from a replica there, or a rebuild if none is left."""
        previous, record = self.stage, self.membership.record
        with self.server.lock:
            self.server.ready = False
            self.stage = record.stage = stage
            record.stage_state = "joining"
            self.ctx.holder.run_id = stage_run_id(self.ctx.options.run_name, stage)
        self.membership.publish()
        if how == "seed":
            module = self._fresh(stage)
            self.install(module, self.make_algo(module, stage), stage)
        else:
            module = self._module(stage)
            algo = self.make_algo(module, stage)
            if self.download(stage, module, algo) is None:  # no replica left there
                if self.config.pipeline.recovery == "checkpoint":
                    self._restart_from_checkpoint(stage, module, algo)
                else:
                    self._rebuild(stage, module)
                    algo = self.make_algo(module, stage)  # φ = the rebuilt weights, a fresh outer optimizer
                    self.install(module, algo, stage, lr_scale=self._lr_scale, step=self._step)
        record.stage_state = "online"
        self.membership.publish()
        self.ctx.log.event("stage", stage=stage, previous=previous, how=how)

    def make_algo(self, module: StageModule, stage: int):
        """The run's algorithm (DiLoCo or SparseLoCo, the config checks) for this stage, from the registry."""
        algo = algorithm(self.config.run.algo)
        combiner = algo.combiner(self.config, [tuple(p.shape) for p in module.parameters()])
        if combiner is not None:  # the algorithm's own (sparse payloads of this stage, DiLoCo's robust mean)
            self.collective.combiner, self.collective.codec = combiner, combiner.name
        key = GroupKey(self.ctx.options.run_name, stage=stage)
        return algo.build(ReplicaSpec(module, self.config, self.collective, key))

    def install(self, module: StageModule, algo, stage: int, lr_scale: float = 1.0, step: int = 0,
                adam: dict[str, torch.Tensor] | None = None, grad_norm: float = 0.0) -> None:
        with self.server.lock:
            self.server.load(module, stage, lr_scale, step)
            if adam is not None:
                _load_adam(self.server.optimizer, module, adam, step)
            self.server.grad_norm = grad_norm
            self.algo = algo
            self.server.phi = self.phi_dict()
            self.server.ready = True
        self.publish_snapshot()

    def phi_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in zip(self.algo.names, self.algo.phi)}

    def _expected(self, module: StageModule, algo) -> dict[str, tuple[int, ...]]:
        shapes = dict(algo.expected_shapes())
        for name, p in module.named_parameters():
            shapes[f"adam.exp_avg.{name}"] = shapes[f"adam.exp_avg_sq.{name}"] = tuple(p.shape)
        shapes.update({name: (1,) for name in META})
        return shapes

    def publish_snapshot(self) -> None:
        tensors = dict(self.algo.state_tensors())
        state = self.server.optimizer.state
        for name, p in self.server.module.named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                tensors[f"adam.{moment}.{name}"] = state.get(p, {}).get(moment, torch.zeros_like(p)).detach()
        tensors.update({"meta.step": torch.tensor([float(self.server.step)]),
                        "meta.lr_scale": torch.tensor([float(self.server.lr_scale)]),
                        "meta.grad_norm": torch.tensor([float(self.server.grad_norm)])})
        round_, tokens = self.position()
        self.ctx.holder.publish(encode_state(tensors, round_, tokens, self.config.config_hash(), self.algo.phi_hash()))

    def _fetch(self, stage: int, module: StageModule, algo) -> tuple[dict, str] | None:
        """(the validated state of `stage`, its source) from a live replica there; None if none answers."""
        ctx = self.ctx
        for r in sorted((r for r in self.stage_records() if r.stage == stage and r.stage_state == "online"
                         and r.peer_id != ctx.me), key=lambda r: -r.round):
            try:
                state = download_state(ctx.channels, ctx.traffic, r.endpoint, stage_run_id(ctx.options.run_name, stage),
                                       ctx.me, 0, wait_s=0.0, timeout=60.0, max_bytes=MAX_STATE_BYTES)
                if state.config_hash != self.config.config_hash():
                    raise StateError(f"state is for config {state.config_hash}")
                return decode_state(state.data, self._expected(module, algo)), r.peer_id
            except StateError as e:
                ctx.log.event("state_error", source=r.peer_id, stage=stage, error=str(e)[:200])
        return None

    def download(self, stage: int, module: StageModule, algo) -> str | None:
        got = self._fetch(stage, module, algo)
        if got is None:
            return None
        tensors, source = got
        self._load(stage, module, algo, tensors)
        self.ctx.log.event("state_received", source=source, stage=stage, phi_hash=algo.phi_hash())
        return source

    def _load(self, stage: int, module: StageModule, algo, tensors: dict[str, torch.Tensor]) -> None:
        algo.load_state_tensors(tensors)  # φ and the outer optimizer; θ ← φ
        self.install(module, algo, stage, lr_scale=float(tensors["meta.lr_scale"][0]),
                     step=int(tensors["meta.step"][0]), adam=tensors, grad_norm=float(tensors["meta.grad_norm"][0]))

    # ---- the restart baseline: every stage back to the last consistent checkpoint -------------

    def _restart_from_checkpoint(self, stage: int, module: StageModule, algo) -> None:
        """The lost stage comes back from the newest round every stage has a checkpoint of, and this
        peer asks every other peer (its record's `rollback`) to load that round too, two rounds ahead,
        so the replicas of each stage switch at the same round boundary."""
        round_ = self.checkpoints.consistent_round()
        tensors = self._read_checkpoint(stage, round_, module, algo) if round_ is not None else None
        if tensors is None:  # nothing to restart from: the stage starts over from φ_0
            fresh = self._fresh(stage)
            self.install(fresh, self.make_algo(fresh, stage), stage)
            self.ctx.log.event("recover", stage=stage, method="restart from φ_0 (no checkpoint)", sources=[])
            return
        self.checkpoints.pin(round_)
        self._load(stage, module, algo, tensors)
        record = self.membership.record
        record.rollback_to, record.rollback_at = round_, self.round_now() + 2
        self.rollback_done = (record.rollback_at, round_)
        self.ctx.log.event("recover", stage=stage, method="checkpoint", round=round_, sources=[],
                           rollback_at=record.rollback_at)

    def _read_checkpoint(self, stage: int, round_: int, module: StageModule, algo) -> dict | None:
        path = self.checkpoints.path(stage, round_)
        try:
            return decode_state(path.read_bytes(), self._expected(module, algo))
        except (OSError, StateError) as e:
            self.ctx.log.event("state_error", source=str(path), stage=stage, error=str(e)[:200])
            return None

    def maybe_roll_back(self, round_: int) -> None:
        """Before round `round_`: load this stage's checkpoint of the rollback a restart asked for."""
        asked = max(((r.rollback_at, r.rollback_to) for r in self.ctx.control.live_peers().values()
                     if r.rollback_to >= 0 and self.ctx.admission.admits(r.peer_id)), default=None)
        if asked is None or asked == self.rollback_done or round_ < asked[0] or not self.server.ready:
            return
        at, to = asked
        module = self._module(self.stage)
        algo = self.make_algo(module, self.stage)
        tensors = self._read_checkpoint(self.stage, to, module, algo)
        self.rollback_done = asked
        if tensors is None:
            return
        self._load(self.stage, module, algo, tensors)
        self.ctx.log.event("rollback", stage=self.stage, round=to, at=at, late=round_ > at)

    # ---- CheckFree ---------------------------------------------------------------------------

    def _rebuild(self, stage: int, module: StageModule) -> None:
        """No replica of `stage` is left: CheckFree(+) from its neighbours' φ."""
        self._lr_scale, self._step = 1.0, 0
        expected = {n: tuple(p.shape) for n, p in module.named_parameters()}
        fresh = self._fresh(stage)
        deadline = time.monotonic() + self.config.pipeline.stage_wait_s
        while not self.ctx.stop.is_set():
            neighbours, sources, steps = {}, [], []
            for side in (stage - 1, stage + 1):
                got = self._neighbour(side) if 0 <= side < self.stages else None
                if got is not None:
                    neighbours[side] = got[0]
                    sources.append(got[1])
                    steps.append(got[2])
            try:
                weights, method = rebuild_stage(stage, self.stages, expected, neighbours,
                                                dict(fresh.named_parameters()))
            except ValueError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"stage {stage} lost every replica and cannot be rebuilt: {e}") from None
                self.ctx.stop.wait(self.config.sync.heartbeat_s)
                continue
            with torch.no_grad():
                module.load_state_dict(weights)
            self._lr_scale, self._step = LR_SCALE, max(steps, default=0)
            self.ctx.log.event("recover", stage=stage, method=method, sources=sources,
                               norms={str(s): neighbours[s][1] for s in neighbours})
            return

    def _neighbour(self, side: int) -> tuple[tuple[dict, float], str, int] | None:
        """((φ of stage `side` by stage-local name, its replicas' mean gradient norm), source, its step)."""
        module = self._module(side)
        got = self._fetch(side, module, self.make_algo(module, side))
        if got is None:
            return None
        tensors, source = got
        norms = [r.grad_norm for r in self.stage_records() if r.stage == side and r.stage_state == "online"]
        norm = sum(norms) / len(norms) if norms else float(tensors["meta.grad_norm"][0])
        phi = {name[len("phi."):]: t for name, t in tensors.items() if name.startswith("phi.")}
        return (phi, norm), source, int(tensors["meta.step"][0])


def _load_adam(optimizer: torch.optim.Optimizer, module: StageModule, tensors: dict[str, torch.Tensor],
               step: int) -> None:
    """The inner AdamW's moments from a replica's state (its step count sets the bias correction)."""
    for name, p in module.named_parameters():
        optimizer.state[p] = {"step": optimizer_step(optimizer, p, step),
                              "exp_avg": tensors[f"adam.exp_avg.{name}"].to(p.device, copy=True),
                              "exp_avg_sq": tensors[f"adam.exp_avg_sq.{name}"].to(p.device, copy=True)}
