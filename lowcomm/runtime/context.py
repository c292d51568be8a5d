"""What every peer process holds, whatever it trains: identity, control plane, gRPC service and server,
channels, traffic counters, its run log and the stats summed from it, the fault plan and the stop event.

    ctx = PeerContext(options)        # identity, log, stats, traffic, faults; nothing opened yet
    ctx.open()                        # DHT, /metrics if asked, the signed run config, the gRPC server, reachability
    ...                               # a training peer or a stage peer runs on it
    ctx.close()                       # /metrics, the gRPC server (with its grace), channels, DHT; the exit record

``ctx.stats`` (runtime.peer_stats.PeerStats) sees every record the peer writes; with
``options.metrics_port`` set, runtime.metrics serves it as Prometheus series, and a `metrics` event
records the URL (port 0 picks a free port: the event says which).

SIGINT and SIGTERM set ``stop`` (the handler only marks, it never logs: it runs between two
bytecodes of the main thread, maybe inside RunLog.write, whose lock it would wait on forever);
``close`` logs the leave with the signal's time. The handlers are installed after the DHT's child
process is forked, so that child keeps the default action: a signal to the whole process group
ends it, instead of leaving the peer waiting on it forever.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import torch
from hivemind.utils import get_dht_time

from lowcomm.config import ConfigError
from lowcomm.runtime.admission import Admission, load_key
from lowcomm.runtime.clock_check import clock_warning
from lowcomm.runtime.faults import FaultPlan
from lowcomm.runtime.metrics import PeerMetrics
from lowcomm.runtime.peer_stats import PeerStats
from lowcomm.runtime.reachability import decide, dial_back, explain, helpers
from lowcomm.runtime.run_config import fetch_run_config
from lowcomm.runtime.runlog import RunLog
from lowcomm.runtime.state_transfer import StateHolder
from lowcomm.transport.addresses import grpc_endpoint
from lowcomm.transport.control import ControlPlane
from lowcomm.transport.identity import Identity, owner_marker_from_text, peer_id_of
from lowcomm.transport.round_posts import RoundPosts
from lowcomm.transport.signing import Signer
from lowcomm.transport.service import SERVER_THREADS, PeerService
from lowcomm.transport.stats_pulls import StatsPost
from lowcomm.transport.wakeups import POSTED_DHT_POLL_S, Wakes, WakeSender
from lowcomm.transport.shaper import LinkShaper
from lowcomm.transport.wire import Channels, Traffic, start_server

logger = logging.getLogger(__name__)
SERVER_GRACE_S = 1.0


def round_timeout(sync) -> float:
    """How long a peer waits for a round of its own before it gives it up (`sync` is the [sync] section)."""
    return sync.reduce_timeout_s * 3 + sync.announce_s + sync.manifest_s * 8


class PeerContext:
    def __init__(self, options):
        self.options = options
        # a key kept in --key-file gives a stable id (allowlist and token runs); else a fresh one per start
        self.identity = load_key(options.key_file) if options.key_file is not None else Identity.generate()
        self.me = self.identity.peer_id
        self.signer = Signer(self.identity)  # signs this peer's data-plane calls (transport.signing)
        self.faults = FaultPlan.parse(options.fault)
        self.stop = threading.Event()
        self.stop_signal: tuple[str, float] | None = None  # (SIGTERM or SIGINT, when it came): a leave
        self.traffic = Traffic(LinkShaper(options.link) if options.link is not None else None)
        self.stats = PeerStats(self.me, self.traffic)  # what this peer has done, summed from its records
        self.log = RunLog(options.run_dir / "peers" / f"{self.me}.jsonl" if options.run_dir else None, self.me,
                          sinks=[self.stats.observe])
        self.metrics: PeerMetrics | None = None  # the /metrics server, with --metrics-port
        self.control: ControlPlane | None = None
        self.server = None  # the gRPC server
        self.channels: Channels | None = None
        self.wake_sender: WakeSender | None = None
        self.compute_seconds = lambda: 0.0  # set by whoever computes (the trainer, the stage server)
        self.closed = False

    def open(self) -> None:
        """DHT, the signed run config, the gRPC server, the reachability check and the state holder."""
        o = self.options
        self.control = ControlPlane.start(self.identity, o.run_name, initial_peers=o.coordinator,
                                          host=o.dht_host or o.host, port=o.dht_port, announce=o.announce_addr)
        # only now: the DHT's child process, forked above, must keep the default SIGTERM and SIGINT, or a
        # signal to the whole process group (kill -- -PGID, systemd) leaves it running and the peer hung
        self.install_signal_handlers()
        self._serve_metrics()
        self.config, _ = fetch_run_config(self.control, owner_marker_from_text(o.run_key))
        self.control.max_record_ttl_s = self.config.sync.record_ttl_s
        self.control.on_reject = lambda writer, reason: self.log.event("reject", sender=writer[:40], reason=reason)
        self.admission = self._admission()
        torch.set_num_threads(1)
        sync = self.config.sync
        self.channels = Channels(sync.chunk_bytes)
        self.service = PeerService(self.me, self.traffic, self.channels)
        self.service.on_error = lambda method, error: self.log.event("reject", method=method, error=error[:200])
        self.server, port = start_server(self.service, o.host, o.port, sync.chunk_bytes, max_workers=SERVER_THREADS)
        self.endpoint = grpc_endpoint(o.host, port, o.announce_addr)
        self.service.checkpointer = peer_id_of(owner_marker_from_text(o.run_key))  # the coordinator
        records = self.control.live_peers()  # one read for both checks
        self._check_clock(records)
        self.client_mode = self._decide_client_mode(records)
        self.holder = StateHolder(o.run_name, sync.chunk_bytes)
        self.service.state_handler = self.holder.serve
        self.wake_sender = WakeSender(self.channels, self.traffic)
        self.service.posts = RoundPosts(o.run_name, self.admission.admits)
        self.service.stats_post = StatsPost(self.signer, o.run_name, self.stats.summary)  # pulled, Decision 60

    def _serve_metrics(self) -> None:
        """Prometheus /metrics on --metrics-host:--metrics-port (runtime.metrics); its URL in a `metrics` event."""
        o = self.options
        if o.metrics_port is None:
            return
        metrics = PeerMetrics(self.stats, o.run_name, dht_calls=lambda: self.control.calls)
        try:
            metrics.serve(o.metrics_host, o.metrics_port)
        except OSError as e:
            raise ConfigError(f"--metrics-port: this peer cannot serve /metrics on {o.metrics_host}:{o.metrics_port} "
                              f"({e.strerror or e}); pass another port, or 0 for any free one") from None
        self.metrics = metrics
        print(f"peer {self.me}: Prometheus metrics at {metrics.url}", file=sys.stderr, flush=True)
        self.log.event("metrics", url=metrics.url)

    def wakes(self) -> Wakes:
        """What agreement waits on and wakes others with (transport.wakeups)."""
        # a peer others cannot dial gets no posts: it reads the DHT at every look, as without them
        return Wakes(self.service.wakeups, self.wake_sender, posts=self.service.posts, signer=self.signer,
                     dht_poll_s=0.0 if self.client_mode else POSTED_DHT_POLL_S)

    def _admission(self) -> Admission:
        """Who this run admits (run.mode); NotAdmitted, saying what to do, when it is not this peer. With the
        join_unadmitted test hook the peer joins anyway and admits everyone, as a hostile peer would."""
        o = self.options
        if o.join_unadmitted:
            return Admission.everyone(o.run_key)
        admission = Admission(self.config.run, o.run_key, self.control.live_peers)
        admission.check_joiner(self.me, o.token, o.key_file)
        return admission

    def _check_clock(self, records: dict) -> None:
        """A `warning` event, also on stderr, when this clock is surely off the coordinator's (runtime.clock_check)."""
        clock = clock_warning(records.get(self.service.checkpointer), get_dht_time(), self.config.sync.record_ttl_s)
        if clock is not None:
            self.log.event("warning", about="clock", message=clock[:500])
            print(f"peer {self.me}: warning: {clock}", file=sys.stderr, flush=True)

    def _decide_client_mode(self, records: dict) -> bool:
        """--client-mode / --no-client-mode, else a dial-back through a helper (runtime.reachability) among
        the live ``records``; the decision is logged as a `reachability` event, and a warning it gives as a
        `warning` event."""
        forced = self.options.client_mode
        endpoints = helpers(records, self.me, self.service.checkpointer) if forced is None else []
        verdict = decide(forced, endpoints, dial_back(self.channels, self.traffic, self.me, self.endpoint))
        warning = explain(verdict, self.endpoint)
        if warning is not None:
            self.log.event("warning", about="reachability", message=warning[:500])
        try:
            dht = self.control.visible_maddrs()
        except Exception as e:  # hivemind's ValueError when p2pd reports none: the record must not fail the join
            dht = [f"unknown ({e})"]
        self.log.event("reachability", endpoint=self.endpoint, dht=dht, **verdict.event())
        return verdict.client_mode

    def install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            self.stop_signal = (signal.Signals(signum).name, time.time())
            self.stop.set()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, request_stop)
            signal.signal(signal.SIGTERM, request_stop)

    def log_leave(self) -> None:
        if self.stop_signal is not None:
            self.log.event("leave", signal=self.stop_signal[0], signal_t=self.stop_signal[1])

    def close(self) -> None:
        """Stops the gRPC server (within its grace), the channels and the DHT, then writes the exit record."""
        if self.closed:
            return
        self.closed = True
        if self.traffic.link is not None:
            self.traffic.link.close()  # nothing waits on the emulated link any longer
        stopped = False
        if self.wake_sender is not None:
            self.wake_sender.close()
        for name, close in (("metrics", lambda: self.metrics.close()), ("server", self._stop_server),
                            ("channels", lambda: self.channels.close()), ("control", lambda: self.control.shutdown())):
            try:
                if getattr(self, name) is not None:
                    result = close()
                    stopped = stopped or (name == "server" and bool(result))
            except Exception as e:
                logger.info("closing %s: %s", name, e)
        self.log.event("exit", bytes_sent=self.traffic.sent, checkpoint_bytes=self.traffic.checkpoint_sent,
                       compute_s=self.compute_seconds(), server_stopped=stopped,
                       control_calls=dict(self.control.calls) if self.control is not None else {},
                       control_searches=dict(self.control.searches) if self.control is not None else {})
        self.log.close()

    def _stop_server(self) -> bool:
        return self.server.stop(grace=SERVER_GRACE_S).wait(2 * SERVER_GRACE_S)
