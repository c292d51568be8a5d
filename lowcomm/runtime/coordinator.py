"""The run owner's node: first DHT node, signed run config, join command, checkpoints of the global model.

Training does not depend on it: peers sync among themselves, and the config record it published
outlives it for `CONFIG_TTL_S`. It follows the rounds (runtime.round_anchor.RoundFollower: the
manifest chain and each round's agreed φ hash, signed as the round's anchor for joiners). It
checkpoints by downloading state from a training peer every `checkpoint.every_rounds` rounds, once
`checkpoint.every_s` passed since its last checkpoint (or its start) and while the downloads stay within
`checkpoint.max_share` of the swarm's bytes (runtime.checkpoint_budget), and keeps it only if its φ
hashes to that round's anchor (else it refuses the state, a warning, and asks another peer next
time); with `--resume DIR` it serves a checkpoint's state to the peers
that join, and the run continues at that round. Its gRPC server answers peers' reachability checks
(a Ping with a dial-back, transport.service), so a peer that joins always has someone to ask, the
first one included.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
from hivemind.utils import get_dht_time
from safetensors.torch import load as st_load

from lowcomm.algorithms.registry import PAIRS, algorithm
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.runtime.admission import Admission
from lowcomm.config import ConfigError, RunConfig
from lowcomm.models.factory import build_model
from lowcomm.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lowcomm.runtime.checkpoint_budget import CheckpointBudget
from lowcomm.runtime.round_anchor import Anchor, FollowedRecords, RoundFollower, anchor_fields
from lowcomm.runtime.runlog import COORDINATOR_CALLS_FILE
from lowcomm.runtime.run_config import publish_run_config
from lowcomm.runtime.state_transfer import Snapshot, StateError, StateHolder, download_state, state_phi_hash
from lowcomm.transport.addresses import grpc_endpoint
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity, KeyFileError
from lowcomm.transport.round_posts import ANCHOR, RoundPosts, post_request
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer
from lowcomm.transport.stats_pulls import LiveStats
from lowcomm.transport.wakeups import Wakes
from lowcomm.transport.wire import Channels, Traffic, start_server

logger = logging.getLogger(__name__)
CONFIG_TTL_S = 24 * 3600.0
RUN_NAME_TTL_S = 180.0  # refreshed every minute: a run whose coordinator stopped drops off the list
FOLLOW_S = 1.0  # how often the coordinator reads the rounds' manifests and votes (a joiner may wait this for an anchor)


class Coordinator:
    def __init__(self, config: RunConfig, run_dir: Path, host: str = "0.0.0.0", port: int = 0,
                 resume: Path | None = None, ready_file: Path | None = None, dht_host: str | None = None,
                 dht_port: int = 0, announce: str | None = None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.host, self.port = host, port  # the gRPC data plane: peers' dial-back checks, state for joiners
        self.dht_host, self.dht_port = dht_host or host, dht_port  # the DHT (p2pd): the join command's address
        self.announce = announce  # HOST[:PORT] peers dial (transport.addresses); None: the listening address
        self.resume = resume
        self.ready_file = ready_file
        self.stop_requested = threading.Event()
        try:
            self.identity = Identity.load_or_create(self.run_dir / "coordinator.key")
        except KeyFileError as e:
            raise ConfigError(str(e)) from None
        # who the run admits (run.mode): only they are followed, voted with and checkpointed from
        self.admission = Admission(config.run, self.identity.public_key_text, lambda: self.control.live_peers())
        self.last_checkpoint_round = 0
        self.last_checkpoint_at = time.monotonic()  # checkpoint.every_s counts from here
        self.follower: RoundFollower | None = None  # from the first loop on, for runs whose replicas share φ
        self._first_round = 0
        self._records: FollowedRecords | None = None  # the live records the rounds are followed by
        self.refused_checkpoints = 0  # downloaded states whose φ was not the round's agreed one
        self._refused_sources: set[str] = set()  # not asked again until a checkpoint is kept
        self._pending: tuple[Snapshot, str, float] | None = None  # (state, source, give up at): awaits its anchor
        self._names: list[str] | None = None  # the model's parameter names, in its order (φ's hash)
        self._param_bytes = 0  # the model's fp32 parameters, in bytes (the first download's expected size)
        self._budget: CheckpointBudget | None = None  # the downloads' share of the swarm's bytes
        self._stats: LiveStats | None = None  # the peers' stats the budget reads, pulled from them
        self._deferred = False  # a download held back by the budget was logged
        self.server = None  # the gRPC server, once started
        self.channels: Channels | None = None

    def start(self) -> dict:
        """The DHT, the signed config, the gRPC server and the coordinator's record; the join info. A
        failure once the DHT runs stops the DHT (p2pd) and the gRPC server before it propagates."""
        run = self.config.run.name
        resumed = None
        if self.resume is not None:
            resumed = load_checkpoint(self.resume)
            if resumed.config_hash != self.config.config_hash():
                raise CheckpointError(f"checkpoint {self.resume} is for config {resumed.config_hash}, not "
                                      f"{self.config.config_hash()}; pass the --config it was written with")
            self.last_checkpoint_round = resumed.round
        self.control = ControlPlane.start(self.identity, run, host=self.dht_host, port=self.dht_port,
                                          announce=self.announce)
        self.control.max_record_ttl_s = self.config.sync.record_ttl_s
        try:
            return self._serve(run, resumed)
        except BaseException:
            try:
                self.shutdown()
            except Exception as e:  # the start's own error is the one to report
                logger.warning("stopping after a failed start: %s", e)
            raise

    def _serve(self, run: str, resumed) -> dict:
        self.epoch = get_dht_time()
        publish_run_config(self.control, self.config, version=1, ttl=CONFIG_TTL_S, epoch=self.epoch)
        self.traffic = Traffic()
        self.channels = Channels(self.config.sync.chunk_bytes)
        self.service = PeerService(self.identity.peer_id, self.traffic, self.channels)
        self.holder = StateHolder(run, self.config.sync.chunk_bytes)
        self.service.state_handler = self.holder.serve
        self.service.posts = RoundPosts(run, self.admission.admits)  # the leaders' manifests (transport.round_posts)
        self.service.max_waiting_calls = 12  # of 16 server threads: Ping always finds one
        self.server, grpc_port = start_server(self.service, self.host, self.port, self.config.sync.chunk_bytes,
                                              max_workers=16)
        endpoint = grpc_endpoint(self.host, grpc_port, self.announce)
        self.record = PeerRecord(self.identity.peer_id, endpoint, state="coordinator")
        if resumed is not None:
            self.holder.publish(resumed)
            self.record.state, self.record.round = "holder", resumed.round
        self.control.publish_peer(self.record, self.config.sync.record_ttl_s)
        self._first_round = resumed.round if resumed is not None else 0
        maddrs = self._join_maddrs()
        info = {"run": run, "maddrs": maddrs, "run_key": self.identity.public_key_text,
                "endpoint": self.record.endpoint, "config_hash": self.config.config_hash(),
                "resumed_round": resumed.round if resumed else None, "pid": os.getpid(),
                "join_command": f"lowcomm peer join --coordinator {maddrs[0]} --run-key {self.identity.public_key_text}"
                                f" --run {run}"}
        if self.ready_file is not None:
            tmp = Path(str(self.ready_file) + ".tmp")
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, self.ready_file)
        return info

    def _follower(self, run: str, start: int) -> RoundFollower | None:
        """The follower of the run's rounds; None where replicas hold their own φ (NoLoCo) or stages sync
        apart (pipelines)."""
        algo = algorithm(self.config.run.algo)
        if self.config.pipelined or algo.exchange == PAIRS:
            return None
        sync = self.config.sync
        agreement = ManifestAgreement(self.control, sync, endpoint="", admits=self.admission.admits,
                                      on_event=lambda kind, **fields: logger.info("%s %s", kind, fields),
                                      wakes=Wakes(None, None, FOLLOW_S, posts=self.service.posts,
                                                  dht_poll_s=sync.record_ttl_s))  # a lost post: read late
        group, signer = GroupKey(run).group, Signer(self.identity)

        def serve(anchor: Anchor) -> None:  # for the peers that download a state to pull (round_anchor)
            fields = {"peer_id": signer.peer_id, **anchor_fields(anchor)}
            self.service.posts.keep_own(post_request(signer, run, ANCHOR, group, anchor.round, fields))
        return RoundFollower(self.control, agreement, group, settle_s=sync.announce_s, ttl=sync.record_ttl_s * 6,
                             vote_every=algo.epoch_rounds(self.config), start=start, serve=serve)

    def _join_maddrs(self) -> list[str]:
        """The DHT's multiaddrs for the join command; an error saying what to pass when p2pd reports none."""
        try:
            maddrs = self.control.visible_maddrs()
        except ValueError:  # hivemind's, when p2pd reports no address
            maddrs = []
        if not maddrs:
            raise RuntimeError("the DHT reports no address peers could dial; pass --announce-addr (or --dht-host) "
                               "with an address of this machine the peers reach")
        return maddrs

    def serve_forever(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: self.stop_requested.set())
        refresh_at = beat_at = 0.0
        while not self.stop_requested.wait(FOLLOW_S):
            try:
                if time.monotonic() >= refresh_at:
                    publish_run_config(self.control, self.config, version=1, ttl=CONFIG_TTL_S, epoch=self.epoch)
                    self.control.publish_run_name(ttl=RUN_NAME_TTL_S)
                    refresh_at = time.monotonic() + 60
                self._follow_rounds()  # often: a joiner waits for the anchor of the round it downloads
                self._maybe_checkpoint()
                if time.monotonic() >= beat_at:  # a record that seldom changes: refreshed at half its life
                    self.control.publish_peer(self.record, self.config.sync.record_ttl_s)
                    beat_at = time.monotonic() + self.config.sync.record_ttl_s / 2
            except Exception as e:  # keep serving; a failed checkpoint is retried next time
                logger.warning("coordinator loop: %s", e)
        self._write_calls()
        self.shutdown()

    def _write_calls(self) -> None:
        """Its DHT calls by kind, into COORDINATOR_CALLS_FILE in the run dir (simulate's report counts them apart)."""
        try:
            tmp = self.run_dir / (COORDINATOR_CALLS_FILE + ".tmp")
            tmp.write_text(json.dumps({"control_calls": dict(self.control.calls)}))
            tmp.replace(self.run_dir / COORDINATOR_CALLS_FILE)
        except OSError as e:
            logger.info("could not write the DHT calls: %s", e)

    def _follow_rounds(self) -> None:
        if self.follower is None:
            self.follower = self._follower(self.config.run.name, self._first_round)
        if self.follower is None:
            return
        if self._records is None:
            sync = self.config.sync
            self._records = FollowedRecords(self.control, sync.heartbeat_s, sync.record_ttl_s, self.admission.admits)
        records = self._records
        records.refresh(self.follower.voters())
        for anchor in self.follower.tick(records.newest, records.training, records.joiners):
            logger.info("round %d: agreed φ hash %s of %d members", anchor.round, anchor.phi_hash, len(anchor.members))

    def _maybe_checkpoint(self) -> None:
        every = self.config.checkpoint.every_rounds
        if every <= 0 or self.config.pipelined:  # a pipeline's stages checkpoint themselves (runtime.stage_peer)
            return
        if time.monotonic() - self.last_checkpoint_at < self.config.checkpoint.every_s:
            return
        if self._pending is not None:
            self._keep_checked()
            return
        if self._budget is None:
            self._model_names()
            stats = self._stats = LiveStats(self.control, self.traffic, self.admission.admits)  # pulled (Decision 60)
            self._budget = CheckpointBudget(self.config.checkpoint.max_share, lambda: stats(self.control.live_peers()),
                                            self.admission.admits, first_bytes=self._param_bytes,
                                            most_wait_s=max(self.config.checkpoint.every_s, 60.0))
        if not self._budget.allows():
            if not self._deferred:
                self._deferred = True
                logger.info("checkpoint deferred: the peers have sent %d of the %d bytes within whose %.0f%% "
                            "the next download fits (checkpoint.max_share)", self._budget.swarm_sent(),
                            self._budget.needed(), 100 * self.config.checkpoint.max_share)
            return
        self._deferred = False
        trainers = [r for r in self.control.live_peers().values() if r.state == "training" and not r.client_mode
                    and r.peer_id not in self._refused_sources and self.admission.admits(r.peer_id)]
        due = [r for r in trainers if r.round >= self.last_checkpoint_round + every]
        if not due:
            return
        source = max(due, key=lambda r: r.round)
        target = source.round - source.round % every
        try:
            state = download_state(self.channels, self.traffic, source.endpoint, self.config.run.name,
                                   self.identity.peer_id, target, wait_s=0.0, timeout=60.0, max_bytes=8 << 30)
        except StateError as e:
            logger.info("checkpoint download failed: %s", e)
            return
        self._budget.spent(len(state.data))
        snapshot = Snapshot(int(state.round), int(state.tokens), state.config_hash, state.phi_hash, state.data)
        if snapshot.config_hash != self.config.config_hash():
            logger.warning("refused a checkpoint for another config from %s", source.peer_id)
            return
        self._pending = (snapshot, source.peer_id, time.monotonic() + self.config.sync.announce_s + 10.0)
        self._keep_checked()

    def _keep_checked(self) -> None:
        """Writes the pending state as a checkpoint once its φ is checked against its round's anchor;
        refuses it when the hash differs, or when no anchor settles in time."""
        snapshot, source, give_up = self._pending
        anchor = self.follower.anchors.get(snapshot.round) if self.follower is not None else None
        if self.follower is not None and anchor is None:
            if time.monotonic() < give_up:
                return  # the round may not be settled yet
            self._pending = None
            logger.warning("no agreed φ hash for round %d: its state from %s is not checkpointed", snapshot.round,
                           source)
            return
        self._pending = None
        if anchor is not None:
            try:
                held = state_phi_hash(st_load(snapshot.blob), self._model_names())
            except Exception as e:  # a damaged blob: safetensors raises its own types
                held = f"unreadable ({str(e)[:100]})"
            if held != anchor.phi_hash:
                self.refused_checkpoints += 1
                self._refused_sources.add(source)
                logger.warning("refused the state of round %d from %s: its φ hash %s is not the agreed %s",
                               snapshot.round, source, held, anchor.phi_hash)
                return
        path = save_checkpoint(self.run_dir / "checkpoints", snapshot, keep=self.config.checkpoint.keep,
                               config_json=self.config.to_json())
        self.last_checkpoint_round = snapshot.round
        self.last_checkpoint_at = time.monotonic()
        self._refused_sources.clear()
        logger.info("checkpoint of round %d written to %s", snapshot.round, path)

    def _model_names(self) -> list[str]:
        """The model's parameter names in its order (built once, without memory where torch allows)."""
        if self._names is None:
            try:
                with torch.device("meta"):
                    model = build_model(self.config.model)
            except Exception:  # a factory model that cannot be built on the meta device
                model = build_model(self.config.model)
            self._names = [name for name, _ in model.named_parameters()]
            self._param_bytes = 4 * sum(p.numel() for p in model.parameters())
        return self._names

    def shutdown(self) -> None:
        """Stops the gRPC server and the channels (those started), then the DHT."""
        try:
            if self.server is not None:
                self.server.stop(grace=1.0).wait(2.0)
            if self.channels is not None:
                self.channels.close()
            if self._stats is not None:
                self._stats.close()
        finally:
            self.control.shutdown()
