"""The run owner's node: first DHT node, signed run config, join command, checkpoints of the global model.

Training does not depend on it: peers sync among themselves, and the config record it published
outlives it for `CONFIG_TTL_S`. It checkpoints by downloading state from a training peer every
`checkpoint.every_rounds` rounds; with `--resume DIR` it serves a checkpoint's state to the peers
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

from hivemind.utils import get_dht_time

from lowcomm.config import RunConfig
from lowcomm.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from lowcomm.runtime.run_config import publish_run_config
from lowcomm.runtime.state_transfer import Snapshot, StateError, StateHolder, download_state
from lowcomm.transport.addresses import grpc_endpoint
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity
from lowcomm.transport.service import PeerService
from lowcomm.transport.wire import Channels, Traffic, start_server

logger = logging.getLogger(__name__)
CONFIG_TTL_S = 24 * 3600.0
RUN_NAME_TTL_S = 180.0  # refreshed every minute: a run whose coordinator stopped drops off the list


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
        self.identity = Identity.load_or_create(self.run_dir / "coordinator.key")
        self.last_checkpoint_round = 0
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
        self.service.max_waiting_calls = 12  # of 16 server threads: Ping always finds one
        self.server, grpc_port = start_server(self.service, self.host, self.port, self.config.sync.chunk_bytes,
                                              max_workers=16)
        endpoint = grpc_endpoint(self.host, grpc_port, self.announce)
        self.record = PeerRecord(self.identity.peer_id, endpoint, state="coordinator")
        if resumed is not None:
            self.holder.publish(resumed)
            self.record.state, self.record.round = "holder", resumed.round
        self.control.publish_peer(self.record, self.config.sync.record_ttl_s)
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
        refresh_at = 0.0
        while not self.stop_requested.wait(1.0):
            try:
                if time.monotonic() >= refresh_at:
                    publish_run_config(self.control, self.config, version=1, ttl=CONFIG_TTL_S, epoch=self.epoch)
                    self.control.publish_run_name(ttl=RUN_NAME_TTL_S)
                    refresh_at = time.monotonic() + 60
                self.control.publish_peer(self.record, self.config.sync.record_ttl_s)
                self._maybe_checkpoint()
            except Exception as e:  # keep serving; a failed checkpoint is retried next time
                logger.warning("coordinator loop: %s", e)
        self.shutdown()

    def _maybe_checkpoint(self) -> None:
        every = self.config.checkpoint.every_rounds
        if every <= 0 or self.config.pipelined:  # a pipeline's stages checkpoint themselves (runtime.stage_peer)
            return
        trainers = [r for r in self.control.live_peers().values() if r.state == "training" and not r.client_mode]
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
        snapshot = Snapshot(int(state.round), int(state.tokens), state.config_hash, state.phi_hash, state.data)
        if snapshot.config_hash != self.config.config_hash():
            logger.warning("refused a checkpoint for another config from %s", source.peer_id)
            return
        path = save_checkpoint(self.run_dir / "checkpoints", snapshot, keep=self.config.checkpoint.keep,
                               config_json=self.config.to_json())
        self.last_checkpoint_round = snapshot.round
        logger.info("checkpoint of round %d written to %s", snapshot.round, path)

    def shutdown(self) -> None:
        """Stops the gRPC server and the channels (those started), then the DHT."""
        try:
            if self.server is not None:
                self.server.stop(grace=1.0).wait(2.0)
            if self.channels is not None:
                self.channels.close()
        finally:
            self.control.shutdown()
