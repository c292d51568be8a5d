"""PeerMetrics (runtime.metrics) serves a peer's PeerStats, bytes and DHT calls at /metrics, and a
hostile client gets nothing but /metrics and never blocks the server."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections import Counter

import pytest
from children import wait_until
from prometheus_client.parser import text_string_to_metric_families

from lowcomm.version import __version__
from lowcomm.runtime import http_read
from lowcomm.runtime.http_read import _Handler
from lowcomm.runtime.metrics import MAX_CLIENTS, PeerMetrics
from lowcomm.runtime.peer_stats import PeerStats
from lowcomm.runtime.runlog import RunLog
from lowcomm.transport.wire import Traffic

ME = "12D3KooWme"
TIMEOUT_S = 10.0  # only a hang reaches it


def fed_stats() -> PeerStats:
    traffic = Traffic()
    traffic.sent, traffic.received, traffic.checkpoint_sent = 9000, 8000, 700
    stats = PeerStats(ME, traffic)
    log = RunLog(None, ME, sinks=[stats.observe])
    log.event("start", algo="diloco", device="cpu")
    log.write("compute", steps=20, tokens=2560, bytes_sent=9000)
    log.write("train", step=20, loss=4.5)
    log.write("round", round=0, sync_s=1.5, bytes=3000, participants=[ME, "b", "c"], contributors=[ME, "b"],
              phi_hash="ab" * 32)
    log.write("round", round=1, sync_s=0.25, bytes=3000, participants=[ME, "b"], contributors=[ME, "b"],
              phi_hash="cd" * 32)
    log.write("eval", round=2, loss=3.75)
    log.event("reject", error="unsigned")
    log.event("resync", round=2, reason="drift")
    return stats


@pytest.fixture
def metrics():
    calls = Counter({"store peers": 3, "get announce": 5})
    m = PeerMetrics(fed_stats(), "test-run", dht_calls=lambda: calls)
    m.serve("127.0.0.1", 0)
    yield m
    m.close()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the page: (sample name, sorted labels without run and peer) -> value."""
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.name.startswith("lowcomm_")
            assert (s.labels["run"], s.labels["peer"]) == ("test-run", ME)
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "peer")))
            samples[(s.name, labels)] = s.value
    return samples


def test_the_series_and_their_values(metrics):
    assert metrics.port > 0 and metrics.url == f"http://127.0.0.1:{metrics.port}/metrics"
    got = scrape(metrics.url)
    assert got == {
        ("lowcomm_info", (("algo", "diloco"), ("device", "cpu"), ("version", __version__))): 1.0,
        ("lowcomm_steps_total", ()): 20.0,
        ("lowcomm_tokens_total", ()): 2560.0,
        ("lowcomm_loss", (("kind", "train"),)): 4.5,
        ("lowcomm_loss", (("kind", "held_out"),)): 3.75,
        ("lowcomm_bytes_total", (("direction", "sent"), ("plane", "data"))): 9000.0,
        ("lowcomm_bytes_total", (("direction", "received"), ("plane", "data"))): 8000.0,
        ("lowcomm_bytes_total", (("direction", "sent"), ("plane", "checkpoint"))): 700.0,
        ("lowcomm_dht_calls_total", (("kind", "get announce"),)): 5.0,
        ("lowcomm_dht_calls_total", (("kind", "store peers"),)): 3.0,
        ("lowcomm_sync_seconds_total", ()): 1.75,
        ("lowcomm_rejects_total", ()): 1.0,
        ("lowcomm_resyncs_total", ()): 1.0,
        ("lowcomm_round", ()): 2.0,
        ("lowcomm_rounds_contributed_total", ()): 2.0,
        ("lowcomm_rounds_participated_total", ()): 2.0,
        ("lowcomm_round_participants", ()): 2.0,
        ("lowcomm_round_contributors", ()): 2.0,
        ("lowcomm_round_sync_seconds", ()): 0.25,
    }


def test_before_any_record_the_counters_are_zero_and_nothing_is_made_up():
    m = PeerMetrics(PeerStats(ME), "test-run", dht_calls=lambda: 1 / 0)  # an unreadable DHT counter: no samples
    try:
        m.serve("127.0.0.1", 0)
        got = scrape(m.url)
    finally:
        m.close()
    assert got[("lowcomm_steps_total", ())] == 0 and got[("lowcomm_round", ())] == 0
    assert not any(name in ("lowcomm_loss", "lowcomm_dht_calls_total", "lowcomm_round_participants")
                   for name, _ in got)


def test_only_get_metrics_is_answered(metrics):
    base = f"http://127.0.0.1:{metrics.port}"
    for path in ("/", "/metrics/../etc", "/api/status"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + path, timeout=TIMEOUT_S)
        assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(base + "/metrics", data=b"x" * 100, method="POST"),
                               timeout=TIMEOUT_S)
    assert e.value.code == 501


def test_garbage_gets_an_error_and_the_server_answers_on(metrics):
    with socket.create_connection(("127.0.0.1", metrics.port), timeout=TIMEOUT_S) as garbage:
        garbage.sendall(b"\x00\xff" * 500 + b"\r\n\r\n")
        assert b"Error code: 400" in read_all(garbage)  # an HTTP/0.9-looking line: http.server's bare error page
    with socket.create_connection(("127.0.0.1", metrics.port), timeout=TIMEOUT_S) as oversized:
        try:  # answered 414 with the rest of the line unread: a reset may overtake the answer
            oversized.sendall(b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n")
            answer = oversized.recv(100)
        except ConnectionError:
            answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.0 414")
    assert scrape(metrics.url)


def test_a_flood_of_silent_clients_is_refused_and_the_slots_come_back(metrics, monkeypatch):
    monkeypatch.setattr(_Handler, "timeout", 600.0)  # the silent clients keep their slots until they go
    monkeypatch.setattr(http_read, "CLIENT_DEADLINE_S", 600.0)
    silent = [socket.create_connection(("127.0.0.1", metrics.port), timeout=TIMEOUT_S) for _ in range(MAX_CLIENTS)]
    try:
        with socket.create_connection(("127.0.0.1", metrics.port), timeout=TIMEOUT_S) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert extra.recv(100) == b""  # closed unanswered: nothing queued behind the slots
    finally:
        for s in silent:
            s.close()
    wait_until(lambda: _answers(metrics.url), TIMEOUT_S, "a scrape answered once the silent clients left")


def test_a_client_dripping_its_request_is_cut_off_at_the_deadline(metrics, monkeypatch):
    monkeypatch.setattr(_Handler, "timeout", 600.0)  # each read waits long: only the whole-connection deadline ends it
    monkeypatch.setattr(http_read, "CLIENT_DEADLINE_S", 0.2)
    with socket.create_connection(("127.0.0.1", metrics.port), timeout=TIMEOUT_S) as slow:
        slow.sendall(b"GET /met")
        assert slow.recv(100) == b""
    assert scrape(metrics.url)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _answers(url: str) -> bool:
    try:
        return bool(scrape(url))
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def test_close_stops_listening_and_twice_is_harmless():
    m = PeerMetrics(PeerStats(ME), "test-run")
    port = m.serve("127.0.0.1", 0)
    m.close()
    m.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).recv(1)


def test_a_port_in_use_is_an_oserror():
    first = PeerMetrics(PeerStats(ME), "test-run")
    port = first.serve("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            PeerMetrics(PeerStats(ME), "test-run").serve("127.0.0.1", port)
    finally:
        first.close()
