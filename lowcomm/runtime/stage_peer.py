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

It is built from the same parts as a training peer (runtime.context, runtime.membership) plus its
stage (runtime.stage_state), its stage server (pipeline.server) and its driver (pipeline.driver).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from lowcomm.collectives.base import CollectiveError, NotInRound
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.data.corpus import load_corpus
from lowcomm.data.loader import TokenShard, heldout_batches
from lowcomm.pipeline.driver import Driver, StageEntry, StageUnavailable
from lowcomm.pipeline.rebalance import joiner_stage
from lowcomm.pipeline.routing import StageRouter
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import initial_stage
from lowcomm.runtime.context import PeerContext, round_timeout
from lowcomm.runtime.membership import Membership
from lowcomm.runtime.stage_guard import StageCallGuard
from lowcomm.runtime.stage_checkpoints import StageCheckpoints
from lowcomm.runtime.stage_moves import StageMoves
from lowcomm.runtime.stage_state import StageState
from lowcomm.runtime.trainer import device_label, pick_device
from lowcomm.transport.control import PeerRecord

logger = logging.getLogger(__name__)
FINAL_MARGIN_ROUNDS = 2  # the final round comes this many rounds after the last driver finished


class StagePeer:
    def __init__(self, ctx: PeerContext):
        self.ctx, self.config = ctx, ctx.config
        o, cfg = ctx.options, ctx.config
        self.me, self.stages, self.slowdown = ctx.me, cfg.pipeline.stages, o.slowdown
        self.round, self.tokens_global, self.driver_steps, self.rounds_done = 0, 0, 0, 0
        self.done_at = 0.0
        self.final_round: int | None = None
        self._evaluation: threading.Thread | None = None
        self._final_scored = False
        self.tokens_per_step = cfg.inner.batch_size * cfg.model.context
        shard = o.data_shard if o.data_shard is not None else int(self.me, 16) % o.num_shards
        corpus = load_corpus(cfg.data, cfg.model.vocab_size, cfg.model.context)
        self.shard = TokenShard(corpus.train, shard, o.num_shards, cfg.model.context, cfg.inner.batch_size,
                                cfg.run.seed)
        self.eval_batches = heldout_batches(corpus.heldout, cfg.model.context, cfg.inner.batch_size,
                                            cfg.data.eval_batches)
        agreement = ManifestAgreement(ctx.control, cfg.sync, ctx.endpoint, ctx.client_mode, on_event=ctx.log.event,
                                      due_in_group=_replica_of_group, admits=ctx.admission.admits,
                                      wakes=ctx.wakes())
        self.collective = ShardedReduce(ctx.signer, ctx.service, ctx.channels, ctx.traffic, agreement, cfg.sync,
                                        cfg.diloco.codec, 1, on_event=ctx.log.event)
        self.device = pick_device(o.device)
        # the stage server answers StageForward / StageBackward; ctx.server stays the process's gRPC server
        self.server = StageServer(cfg, initial_stage(cfg.model, cfg.run.seed, 0, self.stages,
                                                     cfg.pipeline.replicate_ends), 0, self.slowdown, self.device)
        ctx.service.stage_handler = self.server
        ctx.service.stage_guard = StageCallGuard(o.run_name, lambda: set(ctx.control.live_peers()),
                                                 cfg.sync.heartbeat_s, ctx.log.event, ctx.admission.admits)
        ctx.compute_seconds = lambda: self.server.compute_s
        record = PeerRecord(self.me, ctx.endpoint, "parked" if o.start_file is not None else "joining",
                            device_label(self.device), client_mode=ctx.client_mode)
        self.membership = Membership(ctx, record, fill=self._fill_record)
        self.record = record
        checkpoints = StageCheckpoints((o.run_dir or Path(".")) / "stage-checkpoints", self.stages)
        self.checkpoints = checkpoints
        self.state = StageState(ctx, self.membership, self.server, self.collective, checkpoints, self._stage_records,
                                lambda: self._round_at(get_dht_time()), lambda: (self.round, self.tokens_global))
        self.moves = StageMoves(ctx, self.state, self.server, self._stage_records)
        self.router = StageRouter(random.Random(f"{cfg.run.seed}-{self.me}"))
        self.driver = Driver(o.run_name, ctx.signer, self.stages, cfg.pipeline.replicate_ends, self.router,
                             ctx.channels, ctx.traffic, self._directory, lambda: self.server, cfg.pipeline.hop_timeout_s,
                             cfg.pipeline.stage_wait_s, cfg.sync.heartbeat_s, ctx.log.event, ctx.stop)
        ctx.log.event("start", endpoint=ctx.endpoint, client_mode=ctx.client_mode, algo=cfg.run.algo,
                      device=device_label(self.device), config_hash=cfg.config_hash(), data_shard=shard, stages=self.stages,
                      slowdown=self.slowdown, link=str(o.link) if o.link is not None else None)

    @property
    def stage(self) -> int:
        return self.state.stage

    def _fill_record(self, record: PeerRecord) -> None:
        record.throughput = self.server.throughput
        record.grad_norm = self.server.grad_norm
        record.step, record.done_at = self.driver_steps, self.done_at

    # ---- the view of the pipeline -----------------------------------------------------------

    def _stage_records(self) -> list[PeerRecord]:
        """The stage peers the run admits: routes, stage state and moves use no other."""
        records = self.ctx.control.live_peers()
        admitted = self.ctx.admission.admitted(records)
        return [r for p, r in records.items()
                if p in admitted and 0 <= r.stage < self.stages and r.state in ("training", "joining")]

    def _directory(self) -> dict[int, dict[str, StageEntry]]:
        """Online replicas per stage, for the driver (this peer's own stage from its live state)."""
        now, ttl = get_dht_time(), self.config.sync.record_ttl_s
        out: dict[int, dict[str, StageEntry]] = {}
        for r in self._stage_records():
            if r.stage_state == "online" and r.peer_id != self.me:
                expires_at = time.monotonic() + max(0.0, r.heartbeat + ttl - now)
                out.setdefault(r.stage, {})[r.peer_id] = StageEntry(r.endpoint, r.throughput, expires_at)
        if self.server.ready:
            out.setdefault(self.stage, {})[self.me] = StageEntry(self.ctx.endpoint, self.server.throughput,
                                                                 time.monotonic() + ttl)
        return out

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """The pipeline lifecycle; the context is open (Peer.run)."""
        try:
            self.membership.start_heartbeat()
            self.membership.wait_for_start()
            if self.ctx.stop.is_set():
                return 0
            self.record.state = "training"
            self._join_stage()
            threading.Thread(target=self._drive, daemon=True, name="driver").start()
            self._rounds()
            return 0
        finally:
            self.ctx.log_leave()
            self.membership.leave(self.round)
            self.ctx.close()

    def _join_stage(self) -> None:
        if self.ctx.options.stage is not None:  # simulate's initial placement: everyone starts from φ_0
            self.state.take(self.ctx.options.stage, "seed")
            return
        self.ctx.stop.wait(2 * self.config.sync.heartbeat_s)  # see the others' records first
        self.state.take(joiner_stage(self.moves.placements(), self.stages), "join")

    def _round_start(self, round_: int) -> float:
        return self.ctx.control.run_epoch + round_ * self.config.pipeline.round_s

    def _round_at(self, t: float) -> int:
        return math.floor((t - self.ctx.control.run_epoch) / self.config.pipeline.round_s)

    def _rounds(self) -> None:
        # the first round starts a heartbeat after the stage is taken: the stage-mates' gathers see the record,
        # whose round says from which round on they wait for this replica
        next_round = self._round_at(get_dht_time() + self.config.sync.heartbeat_s) + 1
        self.record.round = next_round
        self.membership.publish()
        while not self.ctx.stop.is_set():
            self._watch_end()
            if self.final_round is not None and next_round > self.final_round:
                break
            wait = self._round_start(next_round) - get_dht_time()
            if wait > 0:
                self.ctx.stop.wait(min(wait, 1.0))
                continue
            round_, next_round = next_round, self._round_at(get_dht_time()) + 1
            self.state.maybe_roll_back(round_)
            self._stage_round(round_)
            if self.ctx.stop.is_set():
                break
            final = self.final_round is not None and round_ >= self.final_round
            self._maybe_evaluate_pipeline(round_, final)
            if not final:
                self.moves.maybe_move(round_, self.rounds_done)
        if self.final_round is not None and not self.ctx.stop.is_set():
            self._await_final_evaluation()
        self.ctx.log.event("done" if self.final_round is not None else "stopped", round=self.round)

    def _await_final_evaluation(self) -> None:
        """Keep serving until the evaluator scored the final model (its record says `complete`), or is gone:
        it leaves once it scored, and its record with it, often before a look here saw `complete`."""
        evaluator = min({r.peer_id for r in self._stage_records()} | {self.me})
        if evaluator == self.me:
            if not self._final_scored:  # the final round was skipped (this loop was late): score it now
                self._evaluate(self.round, True, self.config.pipeline.stage_wait_s)
            self.record.state = "complete"
            self.membership.publish()
            return
        deadline = time.monotonic() + self.config.pipeline.stage_wait_s
        while time.monotonic() < deadline and not self.ctx.stop.is_set():
            live = self.ctx.control.live_peers()
            records = live.values()
            if (any(r.state == "complete" for r in records) or evaluator not in live
                    or not any(r.state == "training" for r in records if r.peer_id != self.me)):
                return
            self.ctx.stop.wait(0.5)
        self.ctx.log.event("timeout", stage="final evaluation", round=self.round)

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
            self.ctx.log.event("final_round", round=self.final_round)

    def _stage_round(self, round_: int) -> None:
        """One sync of this stage's replicas; calls wait for it (the server's lock)."""
        t0, bytes_before = time.time(), self.ctx.traffic.sent
        with self.server.lock:
            if not self.server.ready:
                return
            weight = max(self.server.round_steps, 1e-3) * self.tokens_per_step
            try:
                result = self.state.algo.start_sync(round_, weight).result(round_timeout(self.config.sync))
                if result.aggregate.any():
                    self.state.algo.apply(result)
                else:  # nobody stepped (every driver is done): no momentum-only outer step
                    self.state.algo.load_phi_into_model()
            except NotInRound as e:
                result = self._catch_up(round_, e)
            except (CollectiveError, TimeoutError) as e:
                self.ctx.log.event("resync", round=round_, stage=self.stage, reason=str(e)[:200])
                result = None
            self.server.round_steps = 0
            if result is None:
                self.server.ready = False
            else:
                self.server.phi = self.state.phi_dict()
        if result is None:  # this replica's φ may not be the stage's: take it again from a replica
            others = [r for r in self._stage_records() if r.stage == self.stage and r.peer_id != self.me]
            if others:
                self.state.take(self.stage, "resync")
            else:  # the stage's only replica: its own φ is the stage's
                self.server.ready = True
            return
        self.round = self.record.round = round_ + 1
        self.rounds_done += 1
        self.tokens_global += int(weight * len(result.contributors))
        self.state.publish_snapshot()
        self.ctx.log.write("round", round=round_, stage=self.stage, t0=t0, sync_s=time.time() - t0,
                           bytes=self.ctx.traffic.sent - bytes_before, participants=result.participants,
                           contributors=result.contributors, phi_hash=self.state.algo.phi_hash(), norm=result.norm(),
                           tokens=weight,
                           leader=result.info.get("leader"), **result.info.get("record", {}))
        self._maybe_checkpoint(round_, result)

    def _catch_up(self, round_: int, late: NotInRound):
        if late.manifest is None:
            return None
        try:
            result = self.state.algo.catch_up(round_, late.manifest)
        except (CollectiveError, TimeoutError):
            return None
        self.ctx.log.event("caught_up", round=round_, stage=self.stage, contributors=len(result.contributors))
        return result

    def _maybe_checkpoint(self, round_: int, result) -> None:
        every = self.config.pipeline.checkpoint_every_rounds
        if every <= 0 or self.ctx.options.run_dir is None or round_ % every or result.info.get("leader") != self.me:
            return
        self.checkpoints.write(self.stage, round_, self.ctx.holder.snapshot.blob)
        self.ctx.log.event("stage_checkpoint", stage=self.stage, round=round_)

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
            self.ctx.log.event("eval_skipped", round=round_, reason=str(e)[:200])
            return
        tokens = sum(r.step for r in self._stage_records() if r.peer_id != self.me) + self.driver_steps
        self._final_scored = self._final_scored or final
        self.ctx.log.write("eval", round=round_ + 1, step=self.driver_steps, tokens=tokens * self.tokens_per_step,
                       loss=loss, final=final)

    # ---- the driver -------------------------------------------------------------------------

    def _drive(self) -> None:
        total, first_step_t = self.config.run.steps, time.time()
        try:
            while self.driver_steps < total and not self.ctx.stop.is_set():
                x, y = self.shard.next_batch()
                try:
                    loss = self.driver.train(self.driver_steps, x, y)
                except StageUnavailable as e:
                    self.ctx.log.event("microbatch_dropped", step=self.driver_steps, reason=str(e)[:200])
                    loss = None
                self.driver_steps += 1
                if loss is not None and self.driver_steps % 10 == 0:
                    self.ctx.log.write("train", step=self.driver_steps, loss=loss)
                if self.driver_steps % 10 == 0 or self.driver_steps >= total:
                    self.ctx.log.write("compute", compute_s=self.server.compute_s, steps=self.driver_steps,
                                       tokens=self.driver_steps * self.tokens_per_step, first_step_t=first_step_t,
                                       last_step_t=time.time(), bytes_sent=self.ctx.traffic.sent,
                                       checkpoint_bytes=self.ctx.traffic.checkpoint_sent)
        except Exception:
            logger.exception("the driver failed")
            self.ctx.log.event("driver_failed")
        self.done_at = get_dht_time()
        self.membership.publish()


def _replica_of_group(group: str, record: PeerRecord) -> bool:
    """A stage's rounds wait only for that stage's online replicas (GroupKey.group is "<stage>-<fragment>")."""
    return record.stage_state == "online" and str(record.stage) == group.partition("-")[0]


