"""A peer's lifecycle: join the run, fetch the global state, train, sync every round, leave cleanly.

    join:   PeerContext.open (DHT bootstrap → signed run config → gRPC server → reachability check);
            a pipelined run goes on as a StagePeer (runtime.stage_peer), any other as a TrainingPeer
    train:  inner steps; the replica (algorithms.base.Replica) runs its own rounds around them
    leave:  on SIGINT/SIGTERM, finish or abandon the round, expire records, stop the servers

A TrainingPeer is built from parts: the context, its membership (record, heartbeat, announcing
ahead), its state sync (download, snapshots, resync, drift check), its evaluation, and the
algorithm's replica from the registry. The parts tell the replica what the runtime must do
around a round (``SyncHooks``): the drift check and test hooks before it, the record and the
evaluation due after it, a resync when it fails.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from lowcomm.algorithms.base import ReplicaSpec, RoundDropped, RoundFailed, SyncHooks
from lowcomm.algorithms.registry import PAIRS, algorithm, noloco_grouping
from lowcomm.collectives.base import GroupKey, RoundResult
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.pair_exchange import PairExchange
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.config import ConfigError
from lowcomm.runtime.byzantine import Attack, ByzantineCollective, Kind, check_supported
from lowcomm.runtime.console import Console, megabytes
from lowcomm.runtime.context import PeerContext, round_timeout
from lowcomm.runtime.evaluation import Evaluation
from lowcomm.runtime.faults import Fault
from lowcomm.runtime.membership import Membership
from lowcomm.runtime.options import PeerOptions
from lowcomm.runtime.progress import Progress
from lowcomm.runtime.state_sync import StateSync
from lowcomm.runtime.trainer import LocalTrainer, Trainer, device_label, pick_device
from lowcomm.transport.control import DHTUnreachable, PeerRecord

__all__ = ["Peer", "PeerOptions", "TrainingPeer"]
LATE_HOOK_WAIT_S = 120.0


class Peer:
    """The process's entry: opens the context, then runs the peer the run config calls for.

    ``trainer(config, shard, num_shards, device)`` builds the training peer's trainer (default:
    LocalTrainer, the run config's parts); the Python API (lowcomm.api) passes a user's parts here."""

    def __init__(self, options: PeerOptions, trainer: Callable[..., Trainer] | None = None):
        self.ctx = PeerContext(options)
        self.me = self.ctx.me
        self.make_trainer = trainer
        self.peer: TrainingPeer | None = None  # once built: its evaluation holds the last held-out loss

    def run(self) -> int:
        ctx = self.ctx
        try:
            ctx.open()  # installs the signal handlers once the DHT's process is forked
            if ctx.options.byzantine:
                check_supported(Kind.parse(ctx.options.byzantine), ctx.config.run.algo, ctx.config.pipelined)
            if ctx.config.pipelined:  # the run is cut into stages: this process serves one of them
                if self.make_trainer is not None:
                    raise ConfigError(f"run {ctx.options.run_name!r} is cut into {ctx.config.pipeline.stages} pipeline "
                                      "stages of the built-in GPT; a model of your own joins runs without stages")
                from lowcomm.runtime.stage_peer import StagePeer
                peer = StagePeer(ctx)
            else:
                peer = self.peer = TrainingPeer(ctx, self.make_trainer)
        except BaseException:
            ctx.log_leave()
            ctx.close()
            raise
        try:
            return peer.run()
        except DHTUnreachable:
            if ctx.stop_signal is None:
                raise
            return 0  # a stop signal to the whole group ends the DHT's process first: that is the leave asked for


class TrainingPeer:
    def __init__(self, ctx: PeerContext, trainer: Callable[..., Trainer] | None = None):
        self.ctx, self.config = ctx, ctx.config
        o, config = ctx.options, ctx.config
        device = pick_device(o.device)
        shard = o.data_shard if o.data_shard is not None else int(ctx.me, 16) % o.num_shards
        self.trainer = (trainer or LocalTrainer)(config, shard, o.num_shards, device)
        self.trainer.slowdown = o.slowdown
        self._slowdown_read: int | None = None  # the slowdown file's mtime when it was read
        ctx.compute_seconds = lambda: self.trainer.compute_s
        self.progress = Progress()
        # a parked peer is connected but not in the run yet: no round waits for it
        record = PeerRecord(ctx.me, ctx.endpoint, "parked" if o.start_file is not None else "joining",
                            device_label(device),
                            client_mode=ctx.client_mode)
        self.membership = Membership(ctx, record, fill=self._fill_record, quiet=True)
        self.key = GroupKey(o.run_name)
        self.algorithm = algorithm(config.run.algo)
        # quorum: a peer cut off from the swarm fails its rounds instead of training alone (Decision 27)
        agreement = ManifestAgreement(ctx.control, config.sync, ctx.endpoint, ctx.client_mode, on_event=ctx.log.event,
                                      admits=ctx.admission.admits, quorum=True, wakes=ctx.wakes())
        self.collective = self._collective(agreement)
        if o.byzantine:  # lies on the wire only: its own state stays honest (runtime.byzantine)
            self.collective = ByzantineCollective(self.collective, Attack(Kind.parse(o.byzantine), ctx.me),
                                                  on_event=ctx.log.event)
        self.collective.before_send = self._stall_hook
        hooks = SyncHooks(gate=self._before_round, landed=self._landed, meter=lambda: ctx.traffic.sent,
                          timeout_s=round_timeout(config.sync), total_steps=config.run.steps)
        self.replica = self.algorithm.replica(ReplicaSpec(
            self.trainer.model, config, self.collective, self.key, self.trainer.tokens_per_step,
            self.trainer.optimizer, self.trainer.lr_schedule, lambda round_: agreement.read(self.key.group, round_),
            hooks))
        self.state = StateSync(ctx, self.membership, self.replica, self.progress, agreement, ctx.admission.admits)
        self.evaluation = Evaluation(self.trainer.evaluate, self.replica, self.progress, ctx.log,
                                     config.data.eval_every_tokens, config.run.steps)
        # wall seconds the training loop spent outside compute: in its syncs (codec work, the network,
        # the DHT, bookkeeping) and in the held-out evaluations it runs
        self.loop_s = {"sync": 0.0, "eval": 0.0}
        self._landed_any = False
        self.console = Console()
        self._train_loss: float | None = None
        ctx.log.event("start", endpoint=ctx.endpoint, client_mode=ctx.client_mode, algo=config.run.algo,
                      device=device_label(device), config_hash=config.config_hash(), data_shard=shard,
                      link=str(o.link) if o.link is not None else None, byzantine=o.byzantine)

    def _collective(self, agreement: ManifestAgreement):
        ctx, config, algo = self.ctx, self.config, self.algorithm
        shapes = [tuple(p.shape) for p in self.trainer.model.parameters()]
        if algo.exchange == PAIRS:  # no all-reduce: each member trades (θ − φ, φ) with its group only
            return PairExchange(ctx.signer, ctx.service, ctx.channels, ctx.traffic, agreement, config.sync,
                                config.noloco.codec, shapes + shapes, noloco_grouping(config), on_event=ctx.log.event)
        # no honest part of a round carries more tokens than H inner steps produce
        max_weight = float(self.trainer.tokens_per_step * config.steps_per_sync)
        return ShardedReduce(ctx.signer, ctx.service, ctx.channels, ctx.traffic, agreement, config.sync,
                             algo.codec(config), algo.epoch_rounds(config), on_event=ctx.log.event,
                             combiner=algo.combiner(config, shapes), max_weight=max_weight,
                             lag=int(algo.per_step and config.overlap))  # DeMo one step late

    def _fill_record(self, record: PeerRecord) -> None:
        record.throughput = self.progress.steps_done * self.trainer.tokens_per_step / max(self.trainer.compute_s, 1e-9)
        held_out, train = self.evaluation.last_loss, self._train_loss
        loss, kind = (held_out, "held-out") if held_out is not None else (train, "train")
        if loss is not None and math.isfinite(loss):
            record.loss, record.loss_kind = float(loss), kind

    # ---- the lifecycle -----------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.membership.start_heartbeat()
            self.membership.wait_for_start()
            if self.ctx.stop.is_set():
                return 0  # sent away while parked: never joined
            if not self.state.fetch():
                self.state.publish_snapshot()
            self.membership.set(state="training")
            self._announce_ahead(self.replica.take_ahead())  # the round a downloaded state entered
            self.console.say(f"peer {self.ctx.me} training in run {self.ctx.options.run_name} from round "
                             f"{self.replica.round} ({self.config.run.algo}, {self.trainer.device.type}); records in "
                             f"{self.ctx.log.path or 'nowhere (no --run-dir)'}")
            self._train()
            self._summary()
            return 0
        finally:
            self.ctx.log_leave()
            self.membership.leave(self.replica.round)
            self.ctx.close()

    def _train(self) -> None:
        total, p, r, log = self.config.run.steps, self.progress, self.replica, self.ctx.log
        try:
            self._steps(total)
        except DHTUnreachable:
            if self.ctx.stop_signal is None:
                raise
            # a stop signal to the whole group ends the DHT's process first: the training stops there
        if not self.ctx.stop.is_set():
            self._finish()
        log.event("done" if p.step >= total else "stopped", round=r.round, step=p.step)

    def _steps(self, total: int) -> None:
        """Inner steps and their syncs until ``total`` or a stop."""
        p, r, log = self.progress, self.replica, self.ctx.log
        first_step_t = None
        while p.step < total and not self.ctx.stop.is_set():
            first_step_t = first_step_t or time.time()
            self._read_slowdown()
            self._train_loss = self.trainer.forward_backward()
            if not self._timed("sync", self._sync, r.on_gradients, p.step):
                continue  # the state was replaced: its step is where this replica stands now
            if r.steps_inner_optimizer:
                self.trainer.optimizer_step(p.step)
            p.step += 1
            p.steps_done += 1
            self.membership.record.step = p.step
            self._timed("sync", self._sync, r.after_inner_step, p.step)
            if p.step >= total and not r.in_flight():
                p.eval_due()  # the final evaluation, whether or not a round ended here
            self._timed("eval", self.evaluation.run_due)
            self.console.status(self._status_line())
            if p.step % 10 == 0 or p.step >= total:
                log.write("compute", compute_s=self.trainer.compute_s, steps=p.steps_done,
                          sync_wait_s=self.loop_s["sync"], eval_s=self.loop_s["eval"],
                          tokens=p.steps_done * self.trainer.tokens_per_step, first_step_t=first_step_t,
                          last_step_t=time.time(), bytes_sent=self.ctx.traffic.sent, loss=self._train_loss,
                          checkpoint_bytes=self.ctx.traffic.checkpoint_sent)

    def _read_slowdown(self) -> None:
        """Emulation: the factor in --slowdown-file once it exists (simulate's churn makes a peer slower)."""
        path = self.ctx.options.slowdown_file
        try:
            changed = path is not None and path.stat().st_mtime_ns != self._slowdown_read
            if changed:
                self._slowdown_read, factor = path.stat().st_mtime_ns, float(path.read_text())
        except (OSError, ValueError):  # not written yet
            return
        if changed and factor >= 1:
            self.trainer.slowdown = factor
            self.ctx.log.event("slowdown", factor=factor, round=self.replica.round, step=self.progress.step)

    def _status_line(self) -> str:
        p, t = self.progress, self.ctx.traffic
        tok_s = p.steps_done * self.trainer.tokens_per_step / max(self.trainer.compute_s, 1e-9)
        loss = self.evaluation.last_loss
        shown = f"held-out loss {loss:.3f}" if loss is not None else (
            f"train loss {self._train_loss:.3f}" if self._train_loss is not None else "loss n/a")
        return (f"round {self.replica.round} · step {p.step}/{self.config.run.steps} · {shown} · {tok_s:,.0f} tok/s · "
                f"sync {self.loop_s['sync']:.0f} s · up {megabytes(t.sent)} down {megabytes(t.received)}")

    def _summary(self) -> None:
        p, loss = self.progress, self.evaluation.last_loss
        ended = "done" if p.step >= self.config.run.steps else "stopped"
        self.console.say(f"{ended}: {p.steps_done} steps in {self.replica.round} rounds, "
                         f"{p.tokens_global:,} tokens in the global model, held-out loss "
                         f"{f'{loss:.4f}' if loss is not None else 'n/a'}, up {megabytes(self.ctx.traffic.sent)} "
                         f"down {megabytes(self.ctx.traffic.received)}")

    def _timed(self, what: str, call, *args):
        """``call(*args)`` from the training loop, its wall time added to ``loop_s[what]``."""
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.loop_s[what] += time.perf_counter() - t0

    def _sync(self, call, step: int) -> bool:
        """The replica's ``call(step)``; publishes what landed and announces ahead. False: state replaced."""
        self._landed_any = False
        try:
            ok = call(step)
        except RoundFailed as e:
            self.state.resync(str(e))
            self._announce_ahead(self.replica.take_ahead())  # the round a downloaded state entered
            return False
        self.membership.record.round = self.replica.round
        if self._landed_any:
            self.state.publish_round()
        self._announce_ahead(self.replica.take_ahead())
        return ok

    def _finish(self) -> None:
        """The end of training: what is still in flight lands (the overlap), then the final evaluation."""
        try:
            if not self.replica.finish():
                return
        except RoundDropped as e:  # the final φ misses that round: say so
            self.ctx.log.event("round_dropped", round=e.round, reason=str(e)[:200])
        self.state.publish_round()
        self.progress.eval_due()
        self.evaluation.run_due()

    # ---- around a round (the replica's hooks) -------------------------------------------------

    def _before_round(self, round_: int) -> bool:
        """The drift check (at membership epochs for per-step algorithms) and the test hooks."""
        r, state = self.replica, self.state
        if r.per_step:
            if round_ % self.config.ddp.epoch_steps == 0:
                state.publish_snapshot()  # a ddp joiner enters at an epoch boundary with this state
                if round_ > 0 and state.drift_check(round_):
                    return False
        elif round_ > 0 and r.shared_phi and state.drift_check(round_):
            return False
        self._late_hooks(round_)
        return True

    def _landed(self, result: RoundResult) -> None:
        """Bookkeeping of an applied round: counters, the round record, the evaluation due."""
        info, p, log = result.info, self.progress, self.ctx.log
        round_ = info["round"]
        self._drift_hook(round_)
        p.last_members = frozenset(result.participants)
        p.last_contributors = frozenset(result.contributors)  # the drift check's voters
        # NoLoCo: every member of the round trained, though only the group's tokens are in this update
        tokens = info["weight"] * info.get("trained_members", len(result.contributors))
        p.tokens_global += tokens
        self.membership.record.round = round_ + 1
        if info.get("caught_up"):
            log.event("caught_up", round=round_, contributors=len(result.contributors))
        log.write("round", round=round_, t0=info["t0"], sync_s=info["sync_s"], bytes=info["bytes"],
                  participants=result.participants, contributors=result.contributors,
                  phi_hash=self.replica.phi_hash(), norm=result.norm(), tokens=tokens, tokens_global=p.tokens_global,
                  leader=info.get("leader"), manifest_s=info.get("manifest_s"),
                  reduce_s=info.get("reduce_s", info.get("exchange_s")), **info.get("record", {}))
        p.eval_due(tokens, info.get("leader") == self.ctx.me)
        self._landed_any = True

    def _announce_ahead(self, round_: int | None) -> None:
        """Announces the next round as soon as this one is applied (DiLoCo, SparseLoCo, Streaming, overlap),
        and the round a downloaded state enters (None: nothing to announce).

        A peer a few seconds behind the round's leader is then a member whose contribution is awaited
        until the reduce deadline, instead of being left out after `sync.announce_s` with its H steps
        lost. The late-announce fault hook skips it for the round it targets.
        """
        if (round_ is not None and round_ < self.config.total_rounds
                and not self.ctx.faults.at(Fault.LATE_ANNOUNCE, round_)):
            self.membership.announce_ahead(self.collective, self.key, round_)

    # ---- fault injection (runtime.faults) -----------------------------------------------------

    def _stall_hook(self, round_: int) -> None:
        if self.ctx.faults.at(Fault.STALL_SYNC, round_):
            self.ctx.log.event("fault_stall", round=round_)
            threading.Event().wait()  # the test kills this process group now

    def _drift_hook(self, round_: int) -> None:
        """Every φ value drifts by 1e-3 after round `round_` (peers given the same fault drift alike, so
        tests can split the replicas' φ hashes at will)."""
        if self.ctx.faults.at(Fault.DRIFT_PHI, round_):
            tensors = self.replica.state_tensors()
            self.replica.load_state_tensors({k: v + 1e-3 if k.startswith("phi.") else v.clone()
                                             for k, v in tensors.items()})
            self.ctx.log.event("fault_drift", round=round_)

    def _late_hooks(self, round_: int) -> None:
        """"late-announce@R" announces round R only once its manifest exists (without us);
        "late-start@R" announces R ahead as usual but starts R's sync only once its manifest exists."""
        faults = self.ctx.faults
        kind = next((k for k in (Fault.LATE_ANNOUNCE, Fault.LATE_START) if faults.at(k, round_)), None)
        if kind is None:
            return
        self.ctx.log.event("fault_late", round=round_, hook=kind.value)
        deadline = time.monotonic() + LATE_HOOK_WAIT_S
        while not self.state.agreement.reads.manifests(self.key.group, round_) and time.monotonic() < deadline:
            self.ctx.stop.wait(0.1)
