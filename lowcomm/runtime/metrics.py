"""A peer's Prometheus endpoint: GET /metrics, read from its PeerStats (runtime.peer_stats), its byte
counters (transport.wire.Traffic, through PeerStats) and its DHT call counter (ControlPlane.calls).

    metrics = PeerMetrics(stats, run="my-run", dht_calls=lambda: control.calls)
    port = metrics.serve("127.0.0.1", 0)    # 0: any free port; OSError if it cannot listen
    ...
    metrics.close()

Series are named `lowcomm_*` and carry `run` and `peer` labels (docs/metrics.md lists them). The
registry is this object's own, never prometheus_client's global one: each scrape reads the numbers
at that moment.

Network input is hostile and the peer never waits on this server (runtime.http_read: daemon
threads, GET and HEAD of /metrics only, at most `MAX_CLIENTS` connections at once, deadlines per read
and per connection).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lowcomm.runtime.http_read import ReadOnlyServer
from lowcomm.runtime.peer_stats import PeerStats
from lowcomm.version import __version__

logger = logging.getLogger(__name__)
MAX_CLIENTS = 8
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
        yield family(CounterMetricFamily, "lowcomm_rounds_participated", "applied rounds this peer was a member of "
                     "(its contribution counted or left out)", s["participated"])
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


class PeerMetrics:
    """A peer's own registry with its PeerCollector; `serve` publishes it over HTTP until `close`."""

    def __init__(self, stats: PeerStats, run: str, dht_calls: Callable[[], Mapping[str, int]] = dict):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PeerCollector(stats, run, dht_calls))
        self.server: ReadOnlyServer | None = None

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listens on host:port (0: a free port) in a daemon thread; the bound port. OSError if it cannot."""
        self.server = ReadOnlyServer({"/metrics": lambda: (CONTENT_TYPE_LATEST, self.text())}, host, port,
                                     MAX_CLIENTS, b"not found: this peer serves /metrics only\n", name="metrics")
        return self.port

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    @property
    def url(self) -> str:
        return self.server.url("/metrics") if self.server is not None else ""

    def text(self) -> bytes:
        """What a scrape returns now (no server needed)."""
        return generate_latest(self.registry)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
