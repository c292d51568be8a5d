"""A peer's lifecycle: join the run, fetch the global state, train, sync every round, leave cleanly.

    join:   DHT bootstrap → signed run config → gRPC server → reachability check → state download
    train:  inner steps; at each sync point the algorithm's collective round; drift check on φ
            (not for NoLoCo: its replicas hold different φ by design)
    leave:  on SIGINT/SIGTERM, finish or abandon the round, expire records, stop the servers

A joiner waits for the next round boundary and downloads that round's state, so it contributes
from that round on and trains from the current global model, never from scratch.

Streaming DiLoCo (`_streaming_step`) runs the same rounds split in two: a fragment round starts
after its inner step and is awaited τ steps later; each applied round is a round like DiLoCo's
(its record carries the fragment), and φ is the same on every peer after each one, with no round
in flight (τ < ⌊H/P⌋), so the drift check, snapshots and joiners work per round unchanged: a
joiner loads φ after round r − 1 and stands at that round's apply step. A fragment round this peer
was left out of is caught up (that fragment's reduced shards from the members); any other failure
resyncs the whole state at the next round.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from lowcomm.algorithms.ddp import DataParallel
from lowcomm.algorithms.demo_replica import Demo
from lowcomm.algorithms.demo_replica import combiner as demo_combiner
from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.algorithms.overlapped import Overlapped
from lowcomm.algorithms.noloco import group_of
from lowcomm.algorithms.noloco_replica import NoLoCo
from lowcomm.algorithms.sparseloco_replica import SparseLoCo
from lowcomm.algorithms.sparseloco_replica import combiner as sparseloco_combiner
from lowcomm.algorithms.streaming_replica import StreamingDiLoCo
from lowcomm.collectives.base import CollectiveError, GroupKey, NotInRound, RoundResult
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.pair_exchange import PairExchange
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.proto import wire_pb2
from lowcomm.runtime.run_config import fetch_run_config
from lowcomm.runtime.runlog import RunLog
from lowcomm.runtime.state_transfer import StateError, StateHolder, decode_state, download_state, encode_state
from lowcomm.runtime.trainer import LocalTrainer, pick_device
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity, owner_marker_from_text, peer_id_of
from lowcomm.transport.service import PeerService
from lowcomm.transport.shaper import LinkShaper, LinkSpec
from lowcomm.transport.wire import Channels, Traffic, deadline_after, start_server

logger = logging.getLogger(__name__)
MAX_STATE_BYTES = 8 << 30


@dataclass
class PeerOptions:
    coordinator: list[str]
    run_key: str
    run_name: str = "lowcomm-default"
    host: str = "127.0.0.1"
    port: int = 0
    announce_addr: str | None = None
    device: str = "auto"
    client_mode: bool | None = None  # None: decided by a dial-back check at join
    data_shard: int | None = None
    num_shards: int = 64
    run_dir: Path | None = None
    fault: str | None = None  # test hooks: "stall-sync@R" blocks inside round R's reduce (or exchange),
    # "late-announce@R" announces round R only after its manifest was written without this peer;
    # "late-start@R" announces R ahead as usual but starts R's sync only once its manifest exists;
    # "drift-phi@R" moves every φ value by 1e-3 after round R (the drift check's tests);
    # "@R+" instead of "@R": every round from R on, so a stall comes in the first round from R this
    # peer is a member of (one left out of round R on a loaded machine never reaches R's reduce)
    start_file: Path | None = None  # simulate's start barrier: train once this file exists
    link: LinkSpec | None = None  # emulated access link for all data-plane traffic (None: unshaped)
    dht_host: str | None = None  # address the DHT (p2pd) listens on; None: `host`
    stage: int | None = None  # pipelines: the stage to start serving from φ_0 (simulate's initial placement)
    slowdown: float = 1.0  # pipelines, emulation: each computation keeps the peer busy this many times as long


@dataclass
class OpenRound:
    """A Streaming DiLoCo round whose reduce runs in the background until its apply step."""

    round: int
    handle: object
    apply_step: int
    weight: float
    t0: float
    bytes_before: int


def drift_sources(hashes: dict[str, str], me: str) -> list[str] | None:
    """The peers to resync from when my φ hash of a round is not the agreed one; None when it is.

    The agreed hash is the one most of the (at least 3) peers published. A tie goes to the hash the
    smallest peer id holds, so every peer that reads the same hashes settles a split the same way:
    without it a 2-2 split had no majority to follow and stayed split for the rest of the run.
    """
    if len(hashes) < 3 or me not in hashes:
        return None
    votes = Counter(hashes.values())
    most = max(votes.values())
    agreed = hashes[min(p for p, h in hashes.items() if votes[h] == most)]
    if hashes[me] == agreed:
        return None
    return sorted(p for p, h in hashes.items() if h == agreed)


class Peer:
    def __init__(self, options: PeerOptions):
        self.options = options
        self.identity = Identity.generate()
        self.me = self.identity.peer_id
        self.stop_requested = threading.Event()
        self._stop_signal: tuple[str, float] | None = None  # (SIGTERM or SIGINT, when it came): a leave
        self.traffic = Traffic(LinkShaper(options.link) if options.link is not None else None)
        self.log = RunLog(options.run_dir / "peers" / f"{self.me}.jsonl" if options.run_dir else None, self.me)
        self.record: PeerRecord | None = None
        self._heartbeat_stop = threading.Event()
        # wall seconds the training loop spent outside compute: in its syncs (codec work, the network,
        # the DHT, bookkeeping) and in the held-out evaluations it runs
        self.loop_s = {"sync": 0.0, "eval": 0.0}
        # the overlap: traffic.sent when a round last landed; the next landing is charged everything sent
        # since, since a round's reduce runs in the background during the next round's inner steps
        self._landed_bytes_mark: int | None = None
        self._last_members: frozenset[str] = frozenset()  # of the last round applied: the drift check

    # ---- join -------------------------------------------------------------------------------

    def _open_transport(self) -> None:
        """DHT, the signed run config, the gRPC server, the reachability check and the state holder."""
        o = self.options
        self.control = ControlPlane.start(self.identity, o.run_name, initial_peers=o.coordinator,
                                          host=o.dht_host or o.host)
        self.config, _ = fetch_run_config(self.control, owner_marker_from_text(o.run_key))
        torch.set_num_threads(1)
        sync = self.config.sync
        self.channels = Channels(sync.chunk_bytes)
        self.service = PeerService(self.me, self.traffic, self.channels)
        self.service.on_error = lambda method, error: self.log.event("reject", method=method, error=error[:200])
        self.server, port = start_server(self.service, o.host, o.port, sync.chunk_bytes)
        self.endpoint = o.announce_addr or f"{o.host}:{port}"
        self.client_mode = o.client_mode if o.client_mode is not None else not self._reachable()
        self.holder = StateHolder(o.run_name, sync.chunk_bytes)
        self.service.state_handler = self.holder.serve
        self.service.checkpointer = peer_id_of(owner_marker_from_text(o.run_key))

    def compute_seconds(self) -> float:
        trainer = getattr(self, "trainer", None)
        return trainer.compute_s if trainer is not None else 0.0

    def _connect(self) -> None:
        o = self.options
        sync = self.config.sync
        device = pick_device(o.device)
        shard = o.data_shard if o.data_shard is not None else int(self.me, 16) % o.num_shards
        self.trainer = LocalTrainer(self.config, shard, o.num_shards, device)
        # a parked peer is connected but not in the run yet: no round waits for it
        state = "parked" if o.start_file is not None else "joining"
        self.record = PeerRecord(self.me, self.endpoint, state, device.type, client_mode=self.client_mode)
        algo = self.config.run.algo
        epoch_rounds = self.config.ddp.epoch_steps if self.config.per_step else 1
        codec = {"ddp": "fp32", "streaming-diloco": self.config.streaming.codec}.get(algo, self.config.diloco.codec)
        shapes = [tuple(p.shape) for p in self.trainer.model.parameters()]
        combiner = {"sparseloco": lambda: sparseloco_combiner(self.config.sparseloco, shapes),
                    "demo": lambda: demo_combiner(self.config.demo, shapes)}.get(algo, lambda: None)()
        agreement = ManifestAgreement(self.control, sync, self.endpoint, self.client_mode, on_event=self.log.event)
        if algo == "noloco":  # no all-reduce: each member trades (θ − φ, φ) with its group only
            noloco = self.config.noloco
            grouping = lambda run, round_, members: group_of(run, round_, members, noloco.group_size)  # noqa: E731
            self.collective = PairExchange(self.me, self.service, self.channels, self.traffic, agreement, sync,
                                           noloco.codec, shapes + shapes, grouping, on_event=self.log.event)
        else:
            self.collective = ShardedReduce(self.me, self.service, self.channels, self.traffic, agreement, sync,
                                            codec, epoch_rounds, on_event=self.log.event, combiner=combiner)
        self.collective.before_send = self._fault_hook
        self.key = GroupKey(o.run_name)
        if algo == "ddp":
            self.algo = DataParallel(self.trainer.model, self.trainer.optimizer, self.collective, self.key)
        elif algo == "sparseloco":
            self.algo = SparseLoCo(self.trainer.model, self.config.sparseloco, self.collective, self.key)
        elif algo == "noloco":
            self.algo = NoLoCo(self.trainer.model, self.config.noloco, self.collective, self.key)
        elif algo == "demo":  # the run's warm-up schedule, scaled to DeMo's own lr
            lr_at = lambda step: self.trainer.lr_at(step) * self.config.demo.lr / self.config.inner.lr  # noqa: E731
            self.algo = Demo(self.trainer.model, self.config.demo, self.collective, self.key, lr_at)
        elif algo == "streaming-diloco":
            self.algo = StreamingDiLoCo(self.trainer.model, self.config.diloco, self.config.streaming,
                                        self.collective, self.key)
        else:
            self.algo = DiLoCo(self.trainer.model, self.config.diloco, self.collective, self.key)
        if self.config.overlap:
            self.algo = Overlapped(self.algo, lambda round_: agreement.read(self.key.group, round_))
        self.rounds_per_sync = self.config.steps_per_sync
        self.log.event("start", endpoint=self.endpoint, client_mode=self.client_mode, algo=algo,
                       device=device.type, config_hash=self.config.config_hash(), data_shard=shard,
                       link=str(o.link) if o.link is not None else None)

    def _reachable(self) -> bool:
        """Asks a known peer (or the coordinator) to dial us back; no answer means client mode."""
        for record in self.control.live_peers().values():
            try:
                request, timeout = wire_pb2.PingRequest(sender=self.me, dial_back=self.endpoint), 10.0
                deadline = deadline_after(timeout)
                self.traffic.count_sent(request, deadline)
                reply = self.channels.stub(record.endpoint).Ping(request, timeout=timeout)
                self.traffic.count_received(reply, deadline)
                return reply.dial_back_ok
            except Exception as e:  # any failure of the helper: try the next one
                logger.info("reachability check through %s failed: %s", record.endpoint, e)
        return True  # nobody to ask: we are the first, others will dial us

    def _start_heartbeat(self) -> None:
        def beat():
            while not self._heartbeat_stop.wait(self.config.sync.heartbeat_s):
                self._publish_record()
        self._publish_record()
        threading.Thread(target=beat, daemon=True, name="heartbeat").start()

    def _publish_record(self) -> None:
        try:
            self.record.throughput = self.tokens_trained / max(self.trainer.compute_s, 1e-9)
            self.control.publish_peer(self.record, self.config.sync.record_ttl_s)
        except Exception as e:  # a heartbeat must never kill training
            logger.warning("heartbeat failed: %s", e)

    # ---- state ------------------------------------------------------------------------------

    def _round_boundary_for(self, completed: int) -> int:
        """The first round at which a newcomer can enter when others hold `completed` rounds."""
        if self.config.per_step:
            epoch = self.config.ddp.epoch_steps
            return (completed // epoch + 1) * epoch
        return completed + 1

    def _fetch_state(self, min_round: int | None = None, prefer: list[str] | None = None) -> bool:
        """Downloads the global state from the peer with the newest round (of `prefer` where one of them
        is training); False if there is none."""
        deadline = time.monotonic() + 600
        empty_since = None
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            everyone = self.control.live_peers()
            records = [r for p, r in everyone.items()
                       if p != self.me and r.state in ("training", "holder") and not r.client_mode]
            trainers = [r for r in records if r.state == "training"]
            if not records:
                # A fresh DHT node may not see records yet: only call ourselves first once the
                # coordinator's record is visible and two heartbeats passed without any trainer.
                # A resync (min_round set) is mid-run: a record missing for a moment (a busy
                # peer's late heartbeat) is no reason to give up, so it waits for the deadline.
                empty_since = empty_since or time.monotonic()
                settled = time.monotonic() - empty_since > 2 * self.config.sync.heartbeat_s
                if min_round is None and any(r.state == "coordinator" for r in everyone.values()) and settled:
                    return False
                time.sleep(0.2)
                continue
            empty_since = None
            if trainers and max(r.round for r in trainers) == 0 and not min_round:
                return False  # the run is in its first round: start from the shared seeded φ_0 and join it
            trainers = [r for r in trainers if r.peer_id in (prefer or ())] or trainers
            if trainers:
                newest = max(r.round for r in trainers)
                target = max(min_round or 0, self._round_boundary_for(newest))
                source = random.choice([r for r in trainers if r.round == newest])
            else:  # only a holder (a resumed coordinator): take its round as is
                source = max(records, key=lambda r: r.round)
                target = max(min_round or 0, source.round)
            self.record.state, self.record.round = "joining", target
            self._publish_record()
            try:
                state = download_state(self.channels, self.traffic, source.endpoint, self.options.run_name, self.me,
                                       target, wait_s=120.0, timeout=60.0, max_bytes=MAX_STATE_BYTES)
                if state.config_hash != self.config.config_hash():
                    raise StateError(f"state is for config {state.config_hash}, this run is "
                                     f"{self.config.config_hash()}")
                tensors = decode_state(state.data, self.algo.expected_shapes())
            except StateError as e:
                self.log.event("state_error", source=source.peer_id, error=str(e)[:200])
                continue
            self.algo.load_state_tensors(tensors)
            self._last_members = frozenset()
            self.round, self.tokens_global = int(state.round), int(state.tokens)
            self.step = self.config.step_after_rounds(self.round)
            self.open_round = None  # a streaming round begun before this state is void
            # overlap: the round in flight when the state was taken lands at our first sync
            if self.config.overlap and not self.algo.enter(self.round, wait_s=self.config.sync.manifest_s):
                self.log.event("round_dropped", round=self.round - 1, reason="no manifest (a resumed checkpoint?)")
            self.collective.end_epoch(self.key)
            self._publish_snapshot()
            self.log.event("state_received", source=source.peer_id, round=self.round, phi_hash=self.algo.phi_hash())
            return True
        return False

    def _wait_start_barrier(self) -> None:
        """Parks a simulated peer, fully started, until the launcher releases all peers at once."""
        if self.options.start_file is None:
            return
        self.log.event("ready")
        deadline = time.monotonic() + 3600
        while not self.options.start_file.exists() and not self.stop_requested.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError(f"start barrier {self.options.start_file} never appeared")
            self.stop_requested.wait(0.05)
        self.record.state = "joining"
        self._publish_record()  # at once: the first round waits for every peer whose record is due

    def _publish_snapshot(self) -> None:
        snapshot = encode_state(self.algo.state_tensors(), self.round, self.tokens_global,
                                self.config.config_hash(), self.algo.phi_hash())
        self.holder.publish(snapshot)

    def _catch_up(self, round_: int, late: NotInRound) -> RoundResult | None:
        """A DiLoCo peer left out of a round applies the round's result from its members; else resync.

        (A NoLoCo replica takes the round as a group of one: algorithms.noloco_replica.)"""
        if self.config.per_step or late.manifest is None:
            self._resync(f"round {round_}: {late}")
            return None
        try:
            result = self.algo.catch_up(round_, late.manifest)
        except (CollectiveError, TimeoutError) as e:
            self._resync(f"round {round_}: {late}; catching up failed: {e}")
            return None
        self.log.event("caught_up", round=round_, contributors=len(result.contributors))
        return result

    def _resync(self, reason: str, sources: list[str] | None = None) -> None:
        """Drops this peer's state for a newer one; `sources`: the peers to take it from where they can."""
        self.log.event("resync", round=self.round, reason=reason[:200])
        if self._round_boundary_for(self.round) >= self.config.total_rounds:
            # the run ends before the next boundary: nothing left to join, stop as done
            self.step = self.config.run.steps
            self.log.event("late_at_end", round=self.round)
            self._pending_eval = self._pending_eval or (0, False)  # its final evaluation is still due
            return
        if not self._fetch_state(min_round=self.round + 1, prefer=sources):
            if self.stop_requested.is_set():
                return
            if not any(r.state == "training" for r in self.control.live_peers().values()):
                # everyone else finished and left while this peer was behind: the run is over
                self.step = self.config.run.steps
                self.log.event("run_over", round=self.round)
                self._pending_eval = self._pending_eval or (0, False)
                return
            raise RuntimeError("no peer to resync from; leaving the run")

    def _drift_check(self, round_: int) -> bool:
        """A peer whose φ hash of round `round_` is not the agreed one (`drift_sources`) resyncs from a
        peer that holds it. The verdict waits (up to announce_s) for the hash of every member of the
        last round this peer applied, and without them all is left to the next check: a verdict on part
        of the hashes could follow a minority.

        True when it resynced: the caller's round is then behind this peer and must not run.
        """
        deadline = time.monotonic() + self.config.sync.announce_s
        hashes = self.control.phi_hashes(self.key.group, round_)
        while not self._last_members <= hashes.keys() and time.monotonic() < deadline:
            if self.stop_requested.wait(0.2):
                return False
            hashes = self.control.phi_hashes(self.key.group, round_)
        if not self._last_members <= hashes.keys():
            return False
        sources = drift_sources(hashes, self.me)
        if sources is None:
            return False
        self._resync(f"φ hash of round {round_} disagrees with {len(sources)} of {len(hashes)} peers", sources)
        return True

    # ---- the loop ---------------------------------------------------------------------------

    @property
    def tokens_trained(self) -> int:
        return self.steps_done * self.trainer.tokens_per_step

    def run(self) -> int:
        self._install_signal_handlers()
        self.steps_done, self.round, self.step, self.tokens_global = 0, 0, 0, 0
        self.open_round: OpenRound | None = None
        self._announced = -1  # the last round announced ahead of its start (withdrawn if the peer leaves)
        try:
            self._open_transport()
        except BaseException:
            self._leave()
            raise
        if self.config.pipelined:  # the run is cut into stages: this process serves one of them
            from lowcomm.runtime.stage_peer import StagePeer
            return StagePeer.from_peer(self).run()
        try:
            self._connect()
            self._start_heartbeat()
            self._wait_start_barrier()
            if self.stop_requested.is_set():
                return 0  # sent away while parked: never joined
            if not self._fetch_state():
                self._publish_snapshot()
            self.record.state = "training"
            self._publish_record()
            self._train()
            return 0
        finally:
            self._leave()

    def _train(self) -> None:
        total = self.config.run.steps
        first_step_t, self._pending_eval = None, None
        while self.step < total and not self.stop_requested.is_set():
            if first_step_t is None:
                first_step_t = time.time()
            self.trainer.forward_backward()
            if self.config.per_step:
                if not self._timed("sync", self._sync, self.step):
                    continue
                if self.config.run.algo == "ddp":  # DeMo's sync applied its own update
                    self.trainer.optimizer_step(self.step)
            else:
                self.trainer.optimizer_step(self.step)
            self.step += 1
            self.steps_done += 1
            self.record.step = self.step
            if self.config.streaming_run:
                self._timed("sync", self._streaming_step)
            elif not self.config.per_step and self.step % self.rounds_per_sync == 0:
                self._timed("sync", self._sync, self.round)
            if self._pending_eval is not None:
                self._timed("eval", self._maybe_evaluate, *self._pending_eval)
                self._pending_eval = None
            if self.step % 10 == 0 or self.step >= total:
                self.log.write("compute", compute_s=self.trainer.compute_s, steps=self.steps_done,
                               sync_wait_s=self.loop_s["sync"], eval_s=self.loop_s["eval"],
                               tokens=self.tokens_trained, first_step_t=first_step_t, last_step_t=time.time(),
                               bytes_sent=self.traffic.sent, checkpoint_bytes=self.traffic.checkpoint_sent)
        if self.config.overlap and self.algo.pending is not None and not self.stop_requested.is_set():
            self._drain_overlap()
        self.log.event("done" if self.step >= total else "stopped", round=self.round, step=self.step)

    def _timed(self, what: str, call, *args):
        """``call(*args)`` from the training loop, its wall time added to ``loop_s[what]``."""
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.loop_s[what] += time.perf_counter() - t0

    def _sync(self, round_: int) -> bool:
        """One collective round; True when this peer applied the agreed aggregate."""
        is_ddp = self.config.per_step  # ddp and DeMo: per-step syncs in membership epochs
        shared_phi = getattr(self.algo, "shared_phi", True)  # False for NoLoCo: no global φ to agree on
        if is_ddp and round_ % self.config.ddp.epoch_steps == 0:
            self._publish_snapshot()  # a ddp joiner enters at an epoch boundary with this state
            if round_ > 0 and self._drift_check(round_):
                return False
        elif not is_ddp and round_ > 0 and shared_phi and self._drift_check(round_):
            return False
        self._late_announce_hook(round_)
        bytes_before, t0 = self.traffic.sent, time.time()
        weight = self.trainer.tokens_per_step * (1 if is_ddp else self.rounds_per_sync)
        if self.config.overlap:
            return self._overlapped_sync(round_, weight, t0)
        result = self._await_round(round_, lambda timeout: self.algo.sync(round_, weight, timeout=timeout))
        if result is None:
            return False
        self._round_done(round_, result, weight, t0, sync_s=time.time() - t0,
                         bytes_sent=self.traffic.sent - bytes_before)
        if not is_ddp and shared_phi:
            self._announce_ahead()
        return True

    def _overlapped_sync(self, round_: int, weight: float, t0: float) -> bool:
        """One-step-delay overlap: start round_'s reduce; the previous round's aggregate lands now.

        Its record is written now, one round after it started (none at the first round); at the last
        step the final round lands at once (θ ← φ for the final evaluation). The snapshot and φ hash
        are labelled round_ + 1 and hold φ up to round_ − 1: a joiner that enters there fetches
        round_'s aggregate at its first sync (Overlapped.enter).
        """
        timeout = self._round_timeout()
        if self._landed_bytes_mark is None:
            self._landed_bytes_mark = self.traffic.sent
        try:
            landed = [self.algo.sync(round_, weight, timeout=timeout)]
            if self.step >= self.config.run.steps:
                landed.append(self.algo.drain(timeout))
        except (CollectiveError, TimeoutError) as e:  # a late round was caught up inside; this is worse
            self._resync(f"round {round_ - 1}: {e}")
            return False
        self._land(landed, weight, t0)
        self.round = self.record.round = round_ + 1
        self._publish_round()
        self._announce_ahead()
        return True

    def _drain_overlap(self) -> None:
        """The end of an overlapped run whose steps are not a multiple of H: the last round lands."""
        t0 = time.time()
        try:
            landed = self.algo.drain(self._round_timeout())
        except (CollectiveError, TimeoutError) as e:  # the final φ misses that round: say so, θ ← φ anyway
            self.log.event("round_dropped", round=self.round - 1, reason=str(e)[:200])
            self.algo.inner.load_phi_into_model()
            landed = None
        self._land([landed], self.trainer.tokens_per_step * self.rounds_per_sync, t0)
        self._publish_round()
        self._pending_eval = self._pending_eval or (0, False)
        self._maybe_evaluate(*self._pending_eval)

    def _land(self, landed: list, weight: float, t0: float) -> None:
        """Records the rounds whose aggregates the overlap applied just now (None: nothing landed).

        A round's bytes are everything sent since the previous landing: its reduce ran in the background.
        """
        for result in filter(None, landed):
            sent = self.traffic.sent
            mark = sent if self._landed_bytes_mark is None else self._landed_bytes_mark
            self._landed_bytes_mark = sent
            self._round_done(result.info["round"], result, weight, t0, sync_s=time.time() - t0,
                             bytes_sent=sent - mark, publish=False,
                             caught_up=bool(result.info.get("caught_up")))
            if result.info.get("caught_up"):
                self.log.event("caught_up", round=result.info["round"], contributors=len(result.contributors))
            t0 = time.time()

    def _announce_ahead(self) -> None:
        """Announces the next round as soon as this one is applied (DiLoCo, SparseLoCo, Streaming, overlap).

        A peer a few seconds behind the round's leader is then a member whose contribution is awaited
        until the reduce deadline, instead of being left out after `sync.announce_s` with its H steps
        lost (on 8 peers sharing 2 cores, 13% of plain DiLoCo's peer-rounds were, before this). The
        late-announce fault hook skips it for the round it targets.
        """
        if self.round < self.config.total_rounds and not self._fault_at("late-announce", self.round):
            self.collective.announce_ahead(self.key, self.round)
            self._announced = self.round

    def _round_timeout(self) -> float:
        sync = self.config.sync
        return sync.reduce_timeout_s * 3 + sync.announce_s + sync.manifest_s * 8

    def _await_round(self, round_: int, wait) -> RoundResult | None:
        """``wait(timeout)`` → the applied result; a late peer catches up, any other failure resyncs (None)."""
        try:
            return wait(self._round_timeout())
        except NotInRound as e:
            return self._catch_up(round_, e)
        except (CollectiveError, TimeoutError) as e:
            self._resync(f"round {round_}: {e}")
            return None

    def _round_done(self, round_: int, result: RoundResult, weight: float, t0: float, sync_s: float,
                    bytes_sent: int, publish: bool = True, **extra) -> None:
        """Bookkeeping of an applied round: counters, φ hash, snapshot, the round record, the eval due."""
        self._drift_fault_hook(round_)
        self._last_members = frozenset(result.participants)
        self.round = round_ + 1
        # NoLoCo: every member of the round trained, though only the group's tokens are in this update
        tokens = weight * result.info.get("trained_members", len(result.contributors))
        self.tokens_global += tokens
        self.record.round = self.round
        phi_hash = self.algo.phi_hash()
        if publish:
            self._publish_round()
        self.log.write("round", round=round_, t0=t0, sync_s=sync_s, bytes=bytes_sent,
                       participants=result.participants, contributors=result.contributors, phi_hash=phi_hash,
                       tokens=tokens, tokens_global=self.tokens_global,
                       leader=result.info.get("leader"), manifest_s=result.info.get("manifest_s"),
                       reduce_s=result.info.get("reduce_s", result.info.get("exchange_s")),
                       **result.info.get("record", {}), **extra)
        added, leader = self._pending_eval or (0, False)  # two streaming rounds may land in one step
        self._pending_eval = (added + tokens, leader or result.info.get("leader") == self.me)

    def _publish_round(self) -> None:
        """φ's hash (the drift check) and the state snapshot (joiners) under the round reached."""
        is_ddp = self.config.per_step
        shared_phi = getattr(self.algo, "shared_phi", True)  # False for NoLoCo: no global φ to agree on
        if shared_phi and (not is_ddp or self.round % self.config.ddp.epoch_steps == 0):
            self.control.publish_phi_hash(self.key.group, self.round, self.algo.phi_hash(),
                                          self.config.sync.record_ttl_s * 6)
        if not is_ddp:  # ddp's state is complete only after the optimizer step: it snapshots at epoch starts
            self._publish_snapshot()

    # ---- Streaming DiLoCo ---------------------------------------------------------------------

    def _streaming_step(self) -> None:
        """After inner step `self.step`: await the fragment round due now, then start the one due now.

        At the run's last step every round begun is awaited at once (the final sync): φ does not
        depend on when a round is applied, only θ would, and θ is not trained any further.
        """
        last = self.step >= self.config.run.steps
        open_round = self.open_round
        if open_round is not None and (open_round.apply_step <= self.step or last):
            if not self._finish_streaming_round():
                return
        round_ = self.algo.round_starting(self.step)
        if round_ is not None:
            if not self._start_streaming_round(round_):
                return
            if self.open_round.apply_step <= self.step or last:  # τ = 0, or the final sync
                if not self._finish_streaming_round():
                    return
        if last and self._pending_eval is None:
            self._pending_eval = (0, False)  # the final evaluation of φ, even with no round ending here
        if self.open_round is None and self._announced < self.round:
            self._announce_ahead()  # nothing in flight: the next round, so a leader a few steps ahead counts us in

    def _start_streaming_round(self, round_: int) -> bool:
        """Drift check, then the fragment's reduce in the background; False when the peer resynced instead."""
        if round_ > 0 and self._drift_check(round_):
            return False
        self._late_announce_hook(round_)
        # each fragment round carries the tokens trained since the previous round began (H/P steps)
        steps = self.algo.start_step(round_) - (self.algo.start_step(round_ - 1) if round_ > 0 else 0)
        weight = self.trainer.tokens_per_step * steps
        bytes_before, t0 = self.traffic.sent, time.time()
        self.open_round = OpenRound(round_, self.algo.start_sync(round_, weight), self.algo.apply_step(round_),
                                    weight, t0, bytes_before)
        return True

    def _finish_streaming_round(self) -> bool:
        """Awaits and applies the open fragment round; False when it failed (the peer caught up or resynced)."""
        open_round, self.open_round = self.open_round, None
        round_ = open_round.round
        t_wait = time.time()
        result = self._await_round(round_, lambda timeout: self.algo.finish_sync(round_, open_round.handle, timeout))
        if result is None:
            return False
        # sync_s: the reduce itself (manifest + exchange), overlapped with τ inner steps; blocked_s: what
        # training waited for at the apply step
        own = (result.info.get("manifest_s") or 0.0) + (result.info.get("reduce_s") or 0.0)
        self._round_done(round_, result, open_round.weight, open_round.t0, sync_s=own or time.time() - open_round.t0,
                         bytes_sent=self.traffic.sent - open_round.bytes_before,
                         fragment=self.algo.fragment_of(round_), blocked_s=time.time() - t_wait)
        return True

    def _maybe_evaluate(self, added_tokens: int, is_leader: bool) -> None:
        """The round's leader evaluates whenever the run crosses `eval_every_tokens`; everyone at the end."""
        every = self.config.data.eval_every_tokens
        final = self.step >= self.config.run.steps
        crossed = self.tokens_global // every != (self.tokens_global - added_tokens) // every
        if final or (is_leader and crossed):
            with getattr(self.algo, "global_model", nullcontext)():  # Streaming DiLoCo: φ, not the live θ
                loss = self.trainer.evaluate()
            self.log.write("eval", round=self.round, step=self.step, tokens=self.tokens_global, loss=loss,
                           final=final, phi_hash=self.algo.phi_hash())

    def _fault_at(self, kind: str, round_: int) -> bool:
        fault = self.options.fault or ""
        if not fault.startswith(f"{kind}@"):
            return False
        at = fault.split("@")[1]
        return round_ >= int(at[:-1]) if at.endswith("+") else round_ == int(at)

    def _fault_hook(self, round_: int) -> None:
        if self._fault_at("stall-sync", round_):
            self.log.event("fault_stall", round=round_)
            threading.Event().wait()  # the test kills this process group now

    def _drift_fault_hook(self, round_: int) -> None:
        """Fault injection: every φ value drifts by 1e-3 after round `round_` (peers given the same fault
        drift alike, so tests can split the replicas' φ hashes at will)."""
        if self._fault_at("drift-phi", round_):
            state = {k: v + 1e-3 if k.startswith("phi.") else v.clone() for k, v in self.algo.state_tensors().items()}
            self.algo.load_state_tensors(state)
            self.log.event("fault_drift", round=round_)

    def _late_announce_hook(self, round_: int) -> None:
        """Test hooks: "late-announce@R" announces round R only once its manifest exists (without us);
        "late-start@R" announces R ahead as usual but starts R's sync only once its manifest exists."""
        kind = next((k for k in ("late-announce", "late-start") if self._fault_at(k, round_)), None)
        if kind is None:
            return
        self.log.event("fault_late", round=round_, hook=kind)
        deadline = time.monotonic() + 120
        while not self.control.manifests(self.key.group, round_) and time.monotonic() < deadline:
            self.stop_requested.wait(0.1)

    # ---- leave ------------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            # Nothing is logged here: the handler runs on the main thread between two bytecodes, maybe
            # inside RunLog.write, whose lock it would then wait on forever. _leave logs the signal.
            self._stop_signal = (signal.Signals(signum).name, time.time())
            self.stop_requested.set()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, request_stop)
            signal.signal(signal.SIGTERM, request_stop)

    def _leave(self) -> None:
        if self._stop_signal is not None:
            self.log.event("leave", signal=self._stop_signal[0], signal_t=self._stop_signal[1])
        self._heartbeat_stop.set()
        if self.traffic.link is not None:
            self.traffic.link.close()  # nothing waits on the emulated link any longer
        try:
            if self.record is not None:
                self.record.state = "leaving"
                self.control.expire_peer()
                if self._announced >= self.round:  # only a ShardedReduce announces ahead
                    self.collective.withdraw_ahead(self.key, self._announced)  # its leader need not wait for us
        except Exception as e:
            logger.info("could not expire the peer record: %s", e)
        for closer in ("server", "channels", "control"):
            obj = getattr(self, closer, None)
            try:
                if closer == "server" and obj is not None:
                    obj.stop(grace=1.0).wait(2.0)
                elif closer == "channels" and obj is not None:
                    obj.close()
                elif closer == "control" and obj is not None:
                    obj.shutdown()
            except Exception as e:
                logger.info("closing %s: %s", closer, e)
        self.log.event("exit", bytes_sent=self.traffic.sent, checkpoint_bytes=self.traffic.checkpoint_sent,
                       compute_s=self.compute_seconds())
        self.log.close()
