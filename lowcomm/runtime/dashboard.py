"""The status page's HTTP server: `/` the page, `/api/status` its JSON (runtime.observer's
RunView.snapshot), `/metrics` the same numbers as Prometheus series named `lowcomm_*`.

Read-only and bounded (runtime.http_read): GET and HEAD only, at most `MAX_CLIENTS` connections served
at once, deadlines per read and per connection. It listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

from lowcomm.runtime.http_read import ReadOnlyServer
from lowcomm.runtime.observer import DhtSource, Observer, RecordsSource, RunView
from lowcomm.transport.stats_pulls import LiveStats
from lowcomm.transport.wire import Traffic
from lowcomm.version import __version__

MAX_CLIENTS = 32
DHT_POLL_S = 5.0  # a read of the records and a stats pull from each peer per poll, whatever the number of viewers


class RunCollector:
    """The RunView's snapshot as Prometheus metric families (one scrape, one snapshot)."""

    def __init__(self, view: RunView):
        self.view = view

    def collect(self):
        s = self.view.snapshot()
        totals, run = s["totals"], s["run"]

        def gauge(name: str, doc: str, value, labels: dict | None = None):
            family = GaugeMetricFamily(name, doc, labels=["run", *(labels or {})])
            if value is not None:
                family.add_metric([run, *(labels or {}).values()], float(value))
            return family

        yield gauge("lowcomm_info", "the observer's lowcomm version and source", 1,
                    {"version": __version__, "source": s["source"]})
        peers = GaugeMetricFamily("lowcomm_peers", "peers seen, by whether their record is live", labels=["run", "state"])
        peers.add_metric([run, "live"], totals["peers_live"])
        peers.add_metric([run, "gone"], totals["peers_gone"])
        yield peers
        yield gauge("lowcomm_round", "the newest round seen", totals["round"])
        yield gauge("lowcomm_loss", "the latest held-out loss seen", totals["loss"])
        for name, key, doc in (("lowcomm_tokens", "tokens", "tokens trained by every peer seen"),
                               ("lowcomm_rejects", "rejects", "inputs refused by the peers seen"),
                               ("lowcomm_resyncs", "resyncs", "state downloads after a drift or a missed round")):
            family = CounterMetricFamily(name, doc, labels=["run"])
            family.add_metric([run], totals[key])
            yield family
        sent = CounterMetricFamily("lowcomm_bytes", "data-plane bytes sent by every peer seen",
                                   labels=["run", "plane", "direction"])
        sent.add_metric([run, "data", "sent"], totals["bytes"])
        yield sent
        if s["rounds"]:
            last = s["rounds"][-1]
            yield gauge("lowcomm_round_sync_seconds", "the newest round's sync time (its slowest reporter)",
                        last["sync_s"])
            yield gauge("lowcomm_round_contributors", "contributors to the newest round", last["contributors"])
            yield gauge("lowcomm_round_participants", "members of the newest round", last["participants"])
        yield from self._per_peer(run, s["peers"])

    @staticmethod
    def _per_peer(run: str, peers: list[dict]):
        families = {
            "up": GaugeMetricFamily("lowcomm_peer_up", "1 while the peer's record is live", labels=["run", "peer"]),
            "round": GaugeMetricFamily("lowcomm_peer_round", "rounds of global state the peer holds",
                                       labels=["run", "peer"]),
            "step": CounterMetricFamily("lowcomm_peer_steps", "the peer's inner steps", labels=["run", "peer"]),
            "tokens": CounterMetricFamily("lowcomm_peer_tokens", "tokens the peer trained", labels=["run", "peer"]),
            "throughput": GaugeMetricFamily("lowcomm_peer_throughput_tokens_per_second",
                                            "tokens per second of compute", labels=["run", "peer"]),
            "loss": GaugeMetricFamily("lowcomm_peer_loss", "the peer's latest loss", labels=["run", "peer", "kind"]),
            "sent": CounterMetricFamily("lowcomm_peer_bytes_sent", "data-plane bytes the peer sent",
                                        labels=["run", "peer"]),
            "contributed": CounterMetricFamily("lowcomm_peer_rounds_contributed",
                                               "rounds whose aggregate holds the peer's contribution",
                                               labels=["run", "peer"]),
            "participated": CounterMetricFamily("lowcomm_peer_rounds_participated",
                                                "rounds the peer was a member of (its contribution counted or left out)",
                                                labels=["run", "peer"]),
            "rejects": CounterMetricFamily("lowcomm_peer_rejects", "inputs the peer refused", labels=["run", "peer"]),
            "resyncs": CounterMetricFamily("lowcomm_peer_resyncs", "the peer's state downloads", labels=["run", "peer"]),
        }
        for p in peers:
            labels = [run, p["id"]]
            families["up"].add_metric(labels, 0 if p["gone"] else 1)
            for key in ("round", "step", "tokens", "throughput", "sent", "contributed", "participated", "rejects",
                        "resyncs"):
                families[key].add_metric(labels, p[key])
            if p["loss"] is not None:
                families["loss"].add_metric(labels + [p["loss_kind"].replace("-", "_") or "train"], p["loss"])
        yield from families.values()


def page() -> bytes:
    return resources.files("lowcomm.runtime").joinpath("status_page.html").read_bytes()


class Dashboard:
    """Serves `view` on host:port (0: a free port) in a daemon thread until `close()`."""

    def __init__(self, view: RunView, host: str = "127.0.0.1", port: int = 0):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RunCollector(view))
        html = page()
        routes = {"/": lambda: ("text/html; charset=utf-8", html),
                  "/index.html": lambda: ("text/html; charset=utf-8", html),
                  "/api/status": lambda: ("application/json", json.dumps(view.snapshot(), allow_nan=False).encode()),
                  "/metrics": lambda: (CONTENT_TYPE_LATEST, generate_latest(registry))}
        try:
            self.server = ReadOnlyServer(routes, host, port, MAX_CLIENTS, b"not found: the page is at /, its JSON "
                                         b"at /api/status, metrics at /metrics\n", name="dashboard")
        except OSError as e:
            raise OSError(f"the status page cannot listen on {host}:{port} ({e.strerror or e}); pass another "
                          "--dashboard-port") from None
        self.view, self.port, self.url = view, self.server.port, self.server.url("/")

    def close(self) -> None:
        self.server.close()


class StatusPage:
    """A RunView fed by its sources (runtime.observer) and served by a Dashboard: the coordinator's and
    `lowcomm observe`'s read the DHT (`for_dht`), `simulate`'s its peers' records (`for_records`)."""

    def __init__(self, view: RunView, sources: list, host: str, port: int, refresh_s: float):
        self.observer = Observer(view, sources, refresh_s).start()
        try:
            self.dashboard = Dashboard(view, host, port)
        except OSError:
            self.observer.close()
            raise
        self.url = self.dashboard.url
        self.closing: list = []  # what the sources hold open (the stats pulls' channels), closed with the page

    @classmethod
    def for_dht(cls, control, run: str, host: str, port: int) -> "StatusPage":
        """The DHT's peer records, and the stats pulled from the peers (transport.stats_pulls)."""
        view = RunView(run, "the DHT's peer records")
        stats = LiveStats(control, Traffic())
        try:
            page = cls(view, [DhtSource(control, view, stats)], host, port, DHT_POLL_S)
        except BaseException:
            stats.close()
            raise
        page.closing.append(stats.close)
        return page

    @classmethod
    def for_records(cls, run_dir: Path, run: str, host: str, port: int) -> "StatusPage":
        view = RunView(run, f"the peers' records in {run_dir}")
        folders = [run_dir / "peers", run_dir / "launcher"]
        return cls(view, [RecordsSource(folders, view, since=time.time())], host, port, 1.0)

    def close(self) -> None:
        self.dashboard.close()
        self.observer.close()
        for close in self.closing:
            close()
