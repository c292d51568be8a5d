"""A real peer started with `--metrics-port 0` serves its Prometheus /metrics while it trains.

The peer picks the port itself; the `metrics` event in its JSONL records says the URL. The scrape is
polled until it shows a trained step and an applied round (the numbers come from the same records the
test reads, a moment after they are written); the bounds only catch a hang."""

from __future__ import annotations

import urllib.error
import urllib.request

from children import events, wait_until
from prometheus_client.parser import text_string_to_metric_families

from lowcomm.version import __version__
from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

HANG_S = 120.0


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without run and peer) -> value; {} while the peer is not answering."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "peer")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_peer_serves_its_metrics_while_it_trains(tmp_path):
    config = default_config().override({"run.steps": 100000, "diloco.inner_steps": 10, "data.eval_every_tokens": 10**9,
                                        "checkpoint.every_rounds": 0})
    sim = Simulation(config, 1, tmp_path / "run", progress=False, peer_flags={0: ["--metrics-port", "0"]})
    try:
        sim.start_coordinator()
        peer = sim.start_peer(0, park=False)
        url = wait_until(lambda: next((e["url"] for e in events(sim.records(), "metrics")), None), HANG_S,
                         "the peer's metrics event")
        me = events(sim.records(), "metrics")[0]["peer"]

        def trained():
            got = scrape(url)
            done = got.get(("lowcomm_steps_total", ()), 0) > 0 and got.get(("lowcomm_round", ()), 0) > 0
            return got if done and got.get(("lowcomm_tokens_total", ()), 0) > 0 else None

        got = wait_until(trained, HANG_S, "a scrape showing trained steps and an applied round")
        assert peer.popen.poll() is None  # scraped while it trains
    finally:
        leftovers = sim.stop_all()
    assert leftovers == []
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert got[("lowcomm_bytes_total", (("direction", "sent"), ("plane", "data")))] >= 0
    assert got[("lowcomm_rounds_contributed_total", ())] >= 1  # alone in the run: it contributes to its rounds
    assert got[("lowcomm_info", (("algo", "diloco"), ("device", "cpu"), ("version", __version__)))] == 1
    assert any(name == "lowcomm_dht_calls_total" for name, _ in got)
    assert len(events(sim.records(), "exit", me)) == 1
