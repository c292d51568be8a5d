"""A peer of a pipelined run: it serves one stage, drives its own microbatches, and moves or rebuilds stages.

    join:    transport as any peer → pick a stage (simulate's --stage, else the stage that needs a
             newcomer most) → its state from a replica there, or φ_0 at the start of the run, or a
             rebuild when the stage has no replica left (CheckFree, or the stage checkpoint)
    serve:   StageForward / StageBackward (pipeline.server), each backward one inner step
    drive:   a thread pushes run.steps microbatches of this peer's data through all stages (pipeline.driver)
    rounds:  every pipeline.round_s seconds of DHT time since the run's epoch, the stage's replicas
             sync with the run's algorithm (DiLoCo or SparseLoCo) under the stage's group key, each
             weighted by the tokens of its inner steps in the round; calls wait meanwhile
    after a round: the evaluator (the lowest live peer id) scores the stages' φ through the
             pipeline; every peer checks for an empty stage and, every rebalance_every_rounds rounds
             (or at the `rebalance@R` test hook), whether it is the planned mover (pipeline.rebalance)
    end:     once every driver is done, the round two rounds after the last one finished is the
             final round for everyone; the evaluator scores the final model and the peers leave

A stage's state (φ, the outer optimizer's, the inner AdamW's, its step and lr scale) is served over
GetState under the run id `<run>/stage-<s>`, so a request reaches only replicas of that stage.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.algorithms.sparseloco_replica import SparseLoCo
from lowcomm.algorithms.sparseloco_replica import combiner as sparseloco_combiner
from lowcomm.collectives.base import CollectiveError, GroupKey, NotInRound
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.data.corpus import load_corpus
from lowcomm.data.loader import TokenShard, heldout_batches
from lowcomm.pipeline.checkfree import LR_SCALE, rebuild_stage
from lowcomm.pipeline.driver import Driver, StageEntry, StageUnavailable
from lowcomm.pipeline.rebalance import Placement, joiner_stage, plan_move
from lowcomm.pipeline.routing import StageRouter
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import StageModule, initial_stage
from lowcomm.runtime.peer import MAX_STATE_BYTES, Peer
from lowcomm.runtime.stage_checkpoints import StageCheckpoints
from lowcomm.runtime.state_transfer import StateError, decode_state, download_state, encode_state
from lowcomm.runtime.trainer import pick_device
from lowcomm.transport.control import PeerRecord

logger = logging.getLogger(__name__)
FINAL_MARGIN_ROUNDS = 2  # the final round comes this many rounds after the last driver finished
META = ("meta.step", "meta.lr_scale", "meta.grad_norm")


def stage_run_id(run: str, stage: int) -> str:
    return f"{run}/stage-{stage}"


class StagePeer(Peer):
    """Continues a `Peer` whose transport is open and whose run config turned out to be pipelined."""

    @classmethod
    def from_peer(cls, peer: Peer) -> "StagePeer":
        stage_peer = cls.__new__(cls)
        stage_peer.__dict__.update(peer.__dict__)  # identity, DHT, gRPC server, log, stop event: all kept
        stage_peer._init_stage_fields()
        return stage_peer

    def _init_stage_fields(self) -> None:
        self.initial_stage, self.slowdown = self.options.stage, self.options.slowdown
        self.stage = -1
        self.driver_steps = 0
        self.done_at = 0.0
        self.final_round: int | None = None
        self._rebalance_hook_fired = False
        self.rounds_done = 0
        self._evaluation: threading.Thread | None = None
        self._final_scored = False
        self._empty_streak = 0  # consecutive checks that found a stage with no replica
        self._rollback_done: tuple[int, int] | None = None  # (at round, to round) of the last rollback applied
        run_dir = self.options.run_dir or Path(".")
        self.checkpoints = StageCheckpoints(run_dir / "stage-checkpoints", self.config.pipeline.stages)

    # ---- join -------------------------------------------------------------------------------

    def _connect(self) -> None:
        o = self.options
        self.holder.run_id = stage_run_id(o.run_name, -1)  # no stage yet
        cfg = self.config
        self.stages = cfg.pipeline.stages
        self.tokens_per_step = cfg.inner.batch_size * cfg.model.context
        shard = o.data_shard if o.data_shard is not None else int(self.me, 16) % o.num_shards
        corpus = load_corpus(cfg.data)
        self.shard = TokenShard(corpus.train, shard, o.num_shards, cfg.model.context, cfg.inner.batch_size,
                                cfg.run.seed)
        self.eval_batches = heldout_batches(corpus.heldout, cfg.model.context, cfg.inner.batch_size,
                                            cfg.data.eval_batches)
        agreement = ManifestAgreement(self.control, cfg.sync, self.endpoint, self.client_mode, on_event=self.log.event,
                                      due_in_group=_replica_of_group)
        codec = cfg.diloco.codec
        self.collective = ShardedReduce(self.me, self.service, self.channels, self.traffic, agreement, cfg.sync,
                                        codec, 1, on_event=self.log.event)
        self.device = pick_device(o.device)
        self.server = StageServer(cfg, initial_stage(cfg.model, cfg.run.seed, 0, self.stages,
                                                     cfg.pipeline.replicate_ends), 0, self.slowdown, self.device)
        self.service.stage_handler = self.server
        self.record = PeerRecord(self.me, self.endpoint, "parked" if o.start_file is not None else "joining",
                                 self.device.type, client_mode=self.client_mode)
        self.router = StageRouter(random.Random(f"{cfg.run.seed}-{self.me}"))
        self.driver = Driver(o.run_name, self.me, self.stages, cfg.pipeline.replicate_ends, self.router,
                             self.channels, self.traffic, self._directory, lambda: self.server, cfg.pipeline.hop_timeout_s,
                             cfg.pipeline.stage_wait_s, cfg.sync.heartbeat_s, self.log.event, self.stop_requested)
        self.log.event("start", endpoint=self.endpoint, client_mode=self.client_mode, algo=cfg.run.algo,
                       device=self.device.type, config_hash=cfg.config_hash(), data_shard=shard, stages=self.stages,
                       slowdown=self.slowdown, link=str(o.link) if o.link is not None else None)

    def compute_seconds(self) -> float:
        server = getattr(self, "server", None)
        return server.compute_s if server is not None else 0.0

    def _publish_record(self) -> None:
        try:
            self.record.throughput = self.server.throughput
            self.record.grad_norm = self.server.grad_norm
            self.record.step, self.record.done_at = self.driver_steps, self.done_at
            self.control.publish_peer(self.record, self.config.sync.record_ttl_s)
        except Exception as e:  # a heartbeat must never kill training
            logger.warning("heartbeat failed: %s", e)

    # ---- the view of the pipeline -----------------------------------------------------------

    def _stage_records(self) -> list[PeerRecord]:
        return [r for r in self.control.live_peers().values()
                if 0 <= r.stage < self.stages and r.state in ("training", "joining")]

    def _directory(self) -> dict[int, dict[str, StageEntry]]:
        """Online replicas per stage, for the driver (this peer's own stage from its live state)."""
        now, ttl = get_dht_time(), self.config.sync.record_ttl_s
        out: dict[int, dict[str, StageEntry]] = {}
        for r in self._stage_records():
            if r.stage_state == "online" and r.peer_id != self.me:
                expires_at = time.monotonic() + max(0.0, r.heartbeat + ttl - now)
                out.setdefault(r.stage, {})[r.peer_id] = StageEntry(r.endpoint, r.throughput, expires_at)
        if self.server.ready:
            out.setdefault(self.stage, {})[self.me] = StageEntry(self.endpoint, self.server.throughput,
                                                                 time.monotonic() + ttl)
        return out

    def _placements(self) -> list[Placement]:
        """Who serves what, as the DHT records say (this peer's own record too, so every peer plans from the
        same numbers); a newcomer's unknown throughput is taken as the median of the known ones."""
        records = {r.peer_id: r for r in self._stage_records()}
        known = sorted(r.throughput for r in records.values() if r.throughput > 0)
        default = known[len(known) // 2] if known else 1.0
        out = [Placement(r.peer_id, r.stage, r.throughput or default) for r in records.values() if r.peer_id != self.me]
        if self.stage >= 0:
            mine = records.get(self.me)
            throughput = mine.throughput if mine is not None and mine.stage == self.stage else self.server.throughput
            out.append(Placement(self.me, self.stage, throughput or default))
        return out

    # ---- taking a stage ---------------------------------------------------------------------

    def _take_stage(self, stage: int, how: str) -> None:
        """Serve `stage`: 'seed' (φ_0), else its state from a replica there, or a rebuild if none is left."""
        cfg, previous = self.config, self.stage
        with self.server.lock:
            self.server.ready = False
            self.stage = self.record.stage = stage
            self.record.stage_state = "joining"
            self.holder.run_id = stage_run_id(self.options.run_name, stage)
        self._publish_record()
        if how == "seed":
            module = initial_stage(cfg.model, cfg.run.seed, stage, self.stages, cfg.pipeline.replicate_ends)
            self._install(module, self._make_algo(module, stage), stage)
        else:
            module = StageModule(cfg.model, stage, self.stages, cfg.pipeline.replicate_ends)
            algo = self._make_algo(module, stage)
            if self._download_stage(stage, module, algo) is None:  # no replica left there
                if cfg.pipeline.recovery == "checkpoint":
                    self._restart_from_checkpoint(stage, module, algo)
                else:
                    self._rebuild(stage, module)
                    algo = self._make_algo(module, stage)  # φ = the rebuilt weights, a fresh outer optimizer
                    self._install(module, algo, stage, lr_scale=self._lr_scale, step=self._step)
        self.record.stage_state = "online"
        self._publish_record()
        self.log.event("stage", stage=stage, previous=previous, how=how)

    def _make_algo(self, module: StageModule, stage: int):
        key = GroupKey(self.options.run_name, stage=stage)
        if self.config.run.algo == "sparseloco":
            bundle = sparseloco_combiner(self.config.sparseloco, [tuple(p.shape) for p in module.parameters()])
            self.collective.combiner, self.collective.codec = bundle, bundle.name
            return SparseLoCo(module, self.config.sparseloco, self.collective, key)
        return DiLoCo(module, self.config.diloco, self.collective, key)

    def _install(self, module: StageModule, algo, stage: int, lr_scale: float = 1.0, step: int = 0,
                 adam: dict[str, torch.Tensor] | None = None, grad_norm: float = 0.0) -> None:
        with self.server.lock:
            self.server.load(module, stage, lr_scale, step)
            if adam is not None:
                _load_adam(self.server.optimizer, module, adam, step)
            self.server.grad_norm = grad_norm
            self.algo = algo
            self.server.phi = self._phi_dict()
            self.server.ready = True
        self._publish_snapshot()

    def _phi_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in zip(self.algo.names, self.algo.phi)}

    def _expected(self, module: StageModule, algo) -> dict[str, tuple[int, ...]]:
        shapes = dict(algo.expected_shapes())
        for name, p in module.named_parameters():
            shapes[f"adam.exp_avg.{name}"] = shapes[f"adam.exp_avg_sq.{name}"] = tuple(p.shape)
        shapes.update({name: (1,) for name in META})
        return shapes

    def _publish_snapshot(self) -> None:
        tensors = dict(self.algo.state_tensors())
        state = self.server.optimizer.state
        for name, p in self.server.module.named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                tensors[f"adam.{moment}.{name}"] = state.get(p, {}).get(moment, torch.zeros_like(p)).detach()
        tensors.update({"meta.step": torch.tensor([float(self.server.step)]),
                        "meta.lr_scale": torch.tensor([float(self.server.lr_scale)]),
                        "meta.grad_norm": torch.tensor([float(self.server.grad_norm)])})
        self.holder.publish(encode_state(tensors, self.round, self.tokens_global, self.config.config_hash(),
                                         self.algo.phi_hash()))

    def _fetch_stage_state(self, stage: int, module: StageModule, algo) -> tuple[dict, str] | None:
        """(the validated state of `stage`, its source) from a live replica there; None if none answers."""
        for r in sorted((r for r in self._stage_records() if r.stage == stage and r.stage_state == "online"
                         and r.peer_id != self.me), key=lambda r: -r.round):
            try:
                state = download_state(self.channels, self.traffic, r.endpoint,
                                       stage_run_id(self.options.run_name, stage), self.me, 0, wait_s=0.0,
                                       timeout=60.0, max_bytes=MAX_STATE_BYTES)
                if state.config_hash != self.config.config_hash():
                    raise StateError(f"state is for config {state.config_hash}")
                return decode_state(state.data, self._expected(module, algo)), r.peer_id
            except StateError as e:
                self.log.event("state_error", source=r.peer_id, stage=stage, error=str(e)[:200])
        return None

    def _download_stage(self, stage: int, module: StageModule, algo) -> str | None:
        got = self._fetch_stage_state(stage, module, algo)
        if got is None:
            return None
        tensors, source = got
        self._load_state(stage, module, algo, tensors)
        self.log.event("state_received", source=source, stage=stage, phi_hash=algo.phi_hash())
        return source

    def _load_state(self, stage: int, module: StageModule, algo, tensors: dict[str, torch.Tensor]) -> None:
        algo.load_state_tensors(tensors)  # φ and the outer optimizer; θ ← φ
        self._install(module, algo, stage, lr_scale=float(tensors["meta.lr_scale"][0]),
                      step=int(tensors["meta.step"][0]), adam=tensors, grad_norm=float(tensors["meta.grad_norm"][0]))

    # ---- the restart baseline: every stage back to the last consistent checkpoint -------------

    def _restart_from_checkpoint(self, stage: int, module: StageModule, algo) -> None:
        """The lost stage comes back from the newest round every stage has a checkpoint of, and this
        peer asks every other peer (its record's `rollback`) to load that round too, two rounds ahead,
        so the replicas of each stage switch at the same round boundary."""
        cfg = self.config
        round_ = self.checkpoints.consistent_round()
        tensors = self._read_checkpoint(stage, round_, module, algo) if round_ is not None else None
        if tensors is None:  # nothing to restart from: the stage starts over from φ_0
            fresh = initial_stage(cfg.model, cfg.run.seed, stage, self.stages, cfg.pipeline.replicate_ends)
            self._install(fresh, self._make_algo(fresh, stage), stage)
            self.log.event("recover", stage=stage, method="restart from φ_0 (no checkpoint)", sources=[])
            return
        self.checkpoints.pin(round_)
        self._load_state(stage, module, algo, tensors)
        self.record.rollback_to, self.record.rollback_at = round_, self._round_at(get_dht_time()) + 2
        self._rollback_done = (self.record.rollback_at, round_)
        self.log.event("recover", stage=stage, method="checkpoint", round=round_, sources=[],
                       rollback_at=self.record.rollback_at)

    def _read_checkpoint(self, stage: int, round_: int, module: StageModule, algo) -> dict | None:
        path = self.checkpoints.path(stage, round_)
        try:
            return decode_state(path.read_bytes(), self._expected(module, algo))
        except (OSError, StateError) as e:
            self.log.event("state_error", source=str(path), stage=stage, error=str(e)[:200])
            return None

    def _maybe_roll_back(self, round_: int) -> None:
        """Before round `round_`: load this stage's checkpoint of the rollback a restart asked for."""
        asked = max(((r.rollback_at, r.rollback_to) for r in self.control.live_peers().values()
                     if r.rollback_to >= 0), default=None)
        if asked is None or asked == self._rollback_done or round_ < asked[0] or not self.server.ready:
            return
        at, to = asked
        module = StageModule(self.config.model, self.stage, self.stages, self.config.pipeline.replicate_ends)
        algo = self._make_algo(module, self.stage)
        tensors = self._read_checkpoint(self.stage, to, module, algo)
        self._rollback_done = asked
        if tensors is None:
            return
        self._load_state(self.stage, module, algo, tensors)
        self.log.event("rollback", stage=self.stage, round=to, at=at, late=round_ > at)

    def _rebuild(self, stage: int, module: StageModule) -> None:
        """No replica of `stage` is left: CheckFree(+) from its neighbours' φ."""
        cfg = self.config
        self._lr_scale, self._step = 1.0, 0
        expected = {n: tuple(p.shape) for n, p in module.named_parameters()}
        fresh = initial_stage(cfg.model, cfg.run.seed, stage, self.stages, cfg.pipeline.replicate_ends)
        deadline = time.monotonic() + cfg.pipeline.stage_wait_s
        while not self.stop_requested.is_set():
            neighbours, sources, steps = {}, [], []
            for side in (stage - 1, stage + 1):
                if 0 <= side < self.stages:
                    got = self._neighbour(side)
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
                self.stop_requested.wait(self.config.sync.heartbeat_s)
                continue
            with torch.no_grad():
                module.load_state_dict(weights)
            self._lr_scale, self._step = LR_SCALE, max(steps, default=0)
            self.log.event("recover", stage=stage, method=method, sources=sources,
                           norms={str(s): neighbours[s][1] for s in neighbours})
            return

    def _neighbour(self, side: int) -> tuple[tuple[dict, float], str, int] | None:
        """((φ of stage `side` by stage-local name, its replicas' mean gradient norm), source, its step)."""
        module = StageModule(self.config.model, side, self.stages, self.config.pipeline.replicate_ends)
        algo = self._make_algo(module, side)
        got = self._fetch_stage_state(side, module, algo)
        if got is None:
            return None
        tensors, source = got
        norms = [r.grad_norm for r in self._stage_records() if r.stage == side and r.stage_state == "online"]
        norm = sum(norms) / len(norms) if norms else float(tensors["meta.grad_norm"][0])
        phi = {name[len("phi."):]: t for name, t in tensors.items() if name.startswith("phi.")}
        return (phi, norm), source, int(tensors["meta.step"][0])

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """The pipeline lifecycle; the transport is already open (Peer.run)."""
        self.round, self.step, self.tokens_global, self.steps_done = 0, 0, 0, 0
        try:
            self._connect()
            self._start_heartbeat()
            self._wait_start_barrier()
            if self.stop_requested.is_set():
                return 0
            self.record.state = "training"
            self._join_stage()
            threading.Thread(target=self._drive, daemon=True, name="driver").start()
            self._rounds()
            return 0
        finally:
            self._leave()

    def _join_stage(self) -> None:
        if self.initial_stage is not None:  # simulate's initial placement: everyone starts from φ_0
            self._take_stage(self.initial_stage, "seed")
            return
        self.stop_requested.wait(2 * self.config.sync.heartbeat_s)  # see the others' records first
        self._take_stage(joiner_stage(self._placements(), self.stages), "join")

    def _round_start(self, round_: int) -> float:
        return self.control.run_epoch + round_ * self.config.pipeline.round_s

    def _round_at(self, t: float) -> int:
        return math.floor((t - self.control.run_epoch) / self.config.pipeline.round_s)

    def _rounds(self) -> None:
        next_round = self._round_at(get_dht_time()) + 1
        while not self.stop_requested.is_set():
            self._watch_end()
            if self.final_round is not None and next_round > self.final_round:
                break
            wait = self._round_start(next_round) - get_dht_time()
            if wait > 0:
                self.stop_requested.wait(min(wait, 1.0))
                continue
            round_, next_round = next_round, self._round_at(get_dht_time()) + 1
            self._maybe_roll_back(round_)
            self._stage_round(round_)
            if self.stop_requested.is_set():
                break
            final = self.final_round is not None and round_ >= self.final_round
            self._maybe_evaluate_pipeline(round_, final)
            if not final:
                self._maybe_move(round_)
        if self.final_round is not None and not self.stop_requested.is_set():
            self._await_final_evaluation()
        self.log.event("done" if self.final_round is not None else "stopped", round=self.round)

    def _await_final_evaluation(self) -> None:
        """Keep serving until the evaluator scored the final model (its record says `complete`)."""
        if self._is_evaluator():
            if not self._final_scored:  # the final round was skipped (this loop was late): score it now
                self._evaluate(self.round, True, self.config.pipeline.stage_wait_s)
            self.record.state = "complete"
            self._publish_record()
            return
        deadline = time.monotonic() + self.config.pipeline.stage_wait_s
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            records = self.control.live_peers().values()
            if any(r.state == "complete" for r in records) or not any(r.state == "training" for r in records
                                                                    if r.peer_id != self.me):
                return
            self.stop_requested.wait(0.5)
        self.log.event("timeout", stage="final evaluation", round=self.round)

    def _is_evaluator(self) -> bool:
        return min({r.peer_id for r in self._stage_records()} | {self.me}) == self.me

    def _watch_end(self) -> None:
        """Fixes the final round once every live driver is done (the same round on every peer)."""
        if self.final_round is not None or not self.done_at:
            return
        records = self._stage_records()
        if all(r.done_at > 0 for r in records if r.peer_id != self.me):
            last = max([self.done_at] + [r.done_at for r in records])
            self.final_round = self._round_at(last) + FINAL_MARGIN_ROUNDS
            self.log.event("final_round", round=self.final_round)

    def _stage_round(self, round_: int) -> None:
        """One sync of this stage's replicas; calls wait for it (the server's lock)."""
        t0, bytes_before = time.time(), self.traffic.sent
        with self.server.lock:
            if not self.server.ready:
                return
            weight = max(self.server.round_steps, 1e-3) * self.tokens_per_step
            try:
                result = self.algo.start_sync(round_, weight).result(self._round_timeout())
                if result.aggregate.any():
                    self.algo.apply(result)
                else:  # nobody stepped (every driver is done): no momentum-only outer step
                    self.algo.load_phi_into_model()
            except NotInRound as e:
                result = self._catch_up(round_, e)
            except (CollectiveError, TimeoutError) as e:
                self.log.event("resync", round=round_, stage=self.stage, reason=str(e)[:200])
                result = None
            self.server.round_steps = 0
            if result is None:
                self.server.ready = False
            else:
                self.server.phi = self._phi_dict()
        if result is None:  # this replica's φ may not be the stage's: take it again from a replica
            others = [r for r in self._stage_records() if r.stage == self.stage and r.peer_id != self.me]
            if others:
                self._take_stage(self.stage, "resync")
            else:  # the stage's only replica: its own φ is the stage's
                self.server.ready = True
            return
        self.round = self.record.round = round_ + 1
        self.rounds_done += 1
        self.tokens_global += int(weight * len(result.contributors))
        self._publish_snapshot()
        self.log.write("round", round=round_, stage=self.stage, t0=t0, sync_s=time.time() - t0,
                       bytes=self.traffic.sent - bytes_before, participants=result.participants,
                       contributors=result.contributors, phi_hash=self.algo.phi_hash(), tokens=weight,
                       leader=result.info.get("leader"), **result.info.get("record", {}))
        self._maybe_checkpoint(round_, result)

    def _catch_up(self, round_: int, late: NotInRound):
        if late.manifest is None:
            return None
        try:
            result = self.algo.catch_up(round_, late.manifest)
        except (CollectiveError, TimeoutError):
            return None
        self.log.event("caught_up", round=round_, stage=self.stage, contributors=len(result.contributors))
        return result

    def _maybe_checkpoint(self, round_: int, result) -> None:
        every = self.config.pipeline.checkpoint_every_rounds
        if every <= 0 or self.options.run_dir is None or round_ % every or result.info.get("leader") != self.me:
            return
        self.checkpoints.write(self.stage, round_, self.holder.snapshot.blob)
        self.log.event("stage_checkpoint", stage=self.stage, round=round_)

    # ---- evaluation, rebalancing ------------------------------------------------------------

    def _maybe_evaluate_pipeline(self, round_: int, final: bool) -> None:
        """The evaluator scores φ after each round: in the background (a stage being rebuilt must not hold
        up this peer's rounds), except the final evaluation, which the run waits for."""
        if not self._is_evaluator():
            return
        if final:
            if self._evaluation is not None:
                self._evaluation.join()
            self._evaluate(round_, final, self.config.pipeline.stage_wait_s)
        elif self._evaluation is None or not self._evaluation.is_alive():
            self._evaluation = threading.Thread(target=self._evaluate, args=(round_, False, self.config.pipeline.round_s),
                                                daemon=True, name="evaluation")
            self._evaluation.start()

    def _evaluate(self, round_: int, final: bool, wait_s: float) -> None:
        try:
            loss = self.driver.evaluate(self.eval_batches, wait_s=wait_s)
        except StageUnavailable as e:
            self.log.event("eval_skipped", round=round_, reason=str(e)[:200])
            return
        tokens = sum(r.step for r in self._stage_records() if r.peer_id != self.me) + self.driver_steps
        self._final_scored = self._final_scored or final
        self.log.write("eval", round=round_ + 1, step=self.driver_steps, tokens=tokens * self.tokens_per_step,
                       loss=loss, final=final)

    def _maybe_move(self, round_: int) -> None:
        """A move when a stage is empty, every rebalance_every_rounds rounds, or at the `rebalance@R` hook.

        Every peer computes the same plan from the same records, so one peer moves. If a stage stays
        empty (its planned mover is stuck or gone before its record expired), each further check
        plans without one more of the movers planned before.
        """
        p = self.config.pipeline
        placements = self._placements()
        empty = any(not [q for q in placements if q.stage == s] for s in range(self.stages))
        self._empty_streak = self._empty_streak + 1 if empty else 0
        periodic = p.rebalance_every_rounds > 0 and round_ % p.rebalance_every_rounds == 0
        hook = self._hook_due()
        if not (empty or periodic or hook):
            return
        if not empty and any(r.stage_state == "joining" for r in self._stage_records()):
            return  # a move is under way: plan again once its throughput is known where it went
        skipped: set[str] = set()
        for _ in range(max(1, self._empty_streak)):
            plan = plan_move([q for q in placements if q.peer_id not in skipped], self.stages, p.hysteresis)
            if plan is None or plan[0] == self.me:
                break
            skipped.add(plan[0])
        if plan is None or plan[0] != self.me:
            return
        _, source, target = plan
        self.log.event("rebalance", stage=target, previous=source, round=round_,
                       reason="empty stage" if empty else ("hook" if hook else "throughput"), skipped=sorted(skipped),
                       throughputs={str(s): round(sum(q.throughput for q in placements if q.stage == s), 3)
                                    for s in range(self.stages)})
        self._empty_streak = 0
        self._take_stage(target, "move")

    def _hook_due(self) -> bool:
        """The test hook `rebalance@N`: one rebalancing check after this peer's N-th round."""
        fault = self.options.fault or ""
        if self._rebalance_hook_fired or not fault.startswith("rebalance@"):
            return False
        self._rebalance_hook_fired = self.rounds_done >= int(fault.partition("@")[2].lstrip("r"))
        return self._rebalance_hook_fired

    # ---- the driver -------------------------------------------------------------------------

    def _drive(self) -> None:
        total, first_step_t = self.config.run.steps, time.time()
        try:
            while self.driver_steps < total and not self.stop_requested.is_set():
                x, y = self.shard.next_batch()
                try:
                    loss = self.driver.train(self.driver_steps, x, y)
                except StageUnavailable as e:
                    self.log.event("microbatch_dropped", step=self.driver_steps, reason=str(e)[:200])
                    loss = None
                self.driver_steps += 1
                if loss is not None and self.driver_steps % 10 == 0:
                    self.log.write("train", step=self.driver_steps, loss=loss)
                if self.driver_steps % 10 == 0 or self.driver_steps >= total:
                    self.log.write("compute", compute_s=self.server.compute_s, steps=self.driver_steps,
                                   tokens=self.driver_steps * self.tokens_per_step, first_step_t=first_step_t,
                                   last_step_t=time.time(), bytes_sent=self.traffic.sent,
                                   checkpoint_bytes=self.traffic.checkpoint_sent)
        except Exception:
            logger.exception("the driver failed")
            self.log.event("driver_failed")
        self.done_at = get_dht_time()
        self._publish_record()


def _replica_of_group(group: str, record: PeerRecord) -> bool:
    """A stage's rounds wait only for that stage's online replicas (GroupKey.group is "<stage>-<fragment>")."""
    return record.stage_state == "online" and str(record.stage) == group.partition("-")[0]


def _load_adam(optimizer: torch.optim.Optimizer, module: StageModule, tensors: dict[str, torch.Tensor],
               step: int) -> None:
    """The inner AdamW's moments from a replica's state (its step count sets the bias correction)."""
    for name, p in module.named_parameters():
        optimizer.state[p] = {"step": torch.tensor(float(step)),
                              "exp_avg": tensors[f"adam.exp_avg.{name}"].to(p.device, copy=True),
                              "exp_avg_sq": tensors[f"adam.exp_avg_sq.{name}"].to(p.device, copy=True)}
