"""A peer's Prometheus endpoint: GET /metrics, read from its PeerStats (runtime.peer_stats), its byte
counters (transport.wire.Traffic, through PeerStats) and its DHT call counter (ControlPlane.calls).

    metrics = PeerMetrics(stats, run="my-run", dht_calls=lambda: control.calls)
    port = metrics.serve("127.0.0.1", 0)    # 0: any free port; OSError if it cannot listen
    ...
    metrics.close()

Series are named `lowcomm_*` and carry `run` and `peer` labels (docs/metrics.md lists them). The
registry is this object's own, never prometheus_client's global one: each scrape reads the numbers
at that moment.

Network input is hostile and the peer never waits on this server: it runs in daemon threads, answers
GET /metrics only (404 for any other path, 501 for any other method), serves at most `MAX_CLIENTS`
connections at once (more are closed unanswered), gives a client `CLIENT_TIMEOUT_S` per read or
write and `CLIENT_DEADLINE_S` for its whole connection, and keeps http.server's limits on the
request line and headers.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lowcomm.version import __version__
from lowcomm.runtime.peer_stats import PeerStats

logger = logging.getLogger(__name__)
MAX_CLIENTS = 8
CLIENT_TIMEOUT_S = 5.0
CLIENT_DEADLINE_S = 10.0
MAX_DHT_KINDS = 64  # ControlPlane.calls' kinds are this process's own; a bound all the same


class PeerCollector:
    """One scrape: one PeerStats snapshot and one copy of the DHT call counter, as metric families."""

    def __init__(self, stats: PeerStats, run: str, dht_calls: Callable[[], Mapping[str, int]]):
        self.stats, self.run, self.dht_calls = stats, run, dht_calls

    def collect(self):
        s = self.stats.snapshot()
        ids = [self.run, self.stats.peer_id]

        def family(kind, name: str, doc: str, value=None, **labels):
            metric = kind(name, doc, labels=["run", "peer", *labels])
            if value is not None:
                metric.add_metric(ids + list(labels.values()), float(value))
            return metric

        yield family(GaugeMetricFamily, "lowcomm_info", "this peer's lowcomm version, device and algorithm", 1,
                     version=__version__, device=s["info"]["device"], algo=s["info"]["algo"])
        yield family(CounterMetricFamily, "lowcomm_steps", "inner steps this peer trained", s["steps"])
        yield family(CounterMetricFamily, "lowcomm_tokens", "tokens this peer trained", s["tokens"])
        loss = GaugeMetricFamily("lowcomm_loss", "this peer's latest loss: a training loss or a held-out evaluation",
                                 labels=["run", "peer", "kind"])
        for kind in ("train", "held_out"):
            if s[f"{kind}_loss"] is not None:
                loss.add_metric(ids + [kind], s[f"{kind}_loss"])
        yield loss
        traffic = CounterMetricFamily("lowcomm_bytes", "bytes this peer moved, by plane and direction",
                                      labels=["run", "peer", "plane", "direction"])
        traffic.add_metric(ids + ["data", "sent"], s["sent"])
        traffic.add_metric(ids + ["data", "received"], s["received"])
        traffic.add_metric(ids + ["checkpoint", "sent"], s["checkpoint_sent"])
        yield traffic
        yield self._dht_calls(ids)
        yield family(CounterMetricFamily, "lowcomm_sync_seconds", "seconds the applied rounds took to sync",
                     s["sync_s"])
        yield family(CounterMetricFamily, "lowcomm_rejects", "inputs this peer refused", s["rejects"])
        yield family(CounterMetricFamily, "lowcomm_resyncs", "state downloads after a drift or a failed round",
                     s["resyncs"])
        yield family(GaugeMetricFamily, "lowcomm_round", "rounds of global state this peer holds "
                     "(the latest applied round + 1)", s["round"])
        yield family(CounterMetricFamily, "lowcomm_rounds_contributed", "applied rounds holding this peer's "
                     "contribution", s["contributed"])
        last = s["last_round"]
        for key, doc in (("participants", "members"), ("contributors", "contributors")):
            yield family(GaugeMetricFamily, f"lowcomm_round_{key}", f"{doc} of the latest round this peer applied",
                         last.get(key))
        yield family(GaugeMetricFamily, "lowcomm_round_sync_seconds", "the latest applied round's sync time",
                     last.get("sync_s"))

    def _dht_calls(self, ids: list[str]):
        calls = CounterMetricFamily("lowcomm_dht_calls", "this peer's DHT calls, by kind",
                                    labels=["run", "peer", "kind"])
        try:
            counts = dict(self.dht_calls())
        except Exception as e:  # no control plane yet, or it is closing: no samples this scrape
            logger.debug("dht calls unreadable: %s", e)
            counts = {}
        for kind, count in sorted(counts.items())[:MAX_DHT_KINDS]:
            calls.add_metric(ids + [str(kind)[:64]], float(count))
        return calls


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds up the peer's exit
    allow_reuse_address = True

    def __init__(self, address, registry: CollectorRegistry):
        self.registry = registry
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.refused = 0
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # a flood of connections: refused, nothing queued
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        # the whole connection's deadline: a client dripping bytes within each read's timeout is cut off too
        cutoff = threading.Timer(CLIENT_DEADLINE_S, _cut, args=(request,))
        cutoff.daemon = True
        cutoff.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cutoff.cancel()
            self.slots.release()

    def handle_error(self, request, client_address) -> None:  # a client's broken or slow connection: no traceback
        logger.debug("metrics client %s: connection failed", client_address, exc_info=True)


def _cut(request: socket.socket) -> None:
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    timeout = CLIENT_TIMEOUT_S
    server: _Server
    server_version = f"lowcomm/{__version__}"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self._send(404, "text/plain; charset=utf-8", b"not found: this peer serves /metrics only\n")
            return
        self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.server.registry))

    def _send(self, code: int, kind: str, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # no line per request on the peer's terminal
        logger.debug("metrics: " + format, *args)


class PeerMetrics:
    """A peer's own registry with its PeerCollector; `serve` publishes it over HTTP until `close`."""

    def __init__(self, stats: PeerStats, run: str, dht_calls: Callable[[], Mapping[str, int]] = dict):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PeerCollector(stats, run, dht_calls))
        self.server: _Server | None = None
        self.host = ""
        self._thread: threading.Thread | None = None

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listens on host:port (0: a free port) in a daemon thread; the bound port. OSError if it cannot."""
        self.server = _Server((host, port), self.registry)
        self.host = host
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        daemon=True, name="metrics")
        self._thread.start()
        return self.port

    @property
    def port(self) -> int:
        return self.server.server_address[1] if self.server is not None else 0

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def text(self) -> bytes:
        """What a scrape returns now (no server needed)."""
        return generate_latest(self.registry)

    def close(self) -> None:
        if self.server is None:
            return
        server, self.server = self.server, None
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
