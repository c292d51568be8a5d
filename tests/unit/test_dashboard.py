"""The status page's server (runtime.dashboard): the page, its JSON, /metrics, and its bounds."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lowcomm.runtime.dashboard import MAX_CLIENTS, Dashboard
from lowcomm.runtime.observer import RunView


@pytest.fixture
def served():
    view = RunView("demo-run", "records")
    with view.lock:
        a, b = view.peer("peer-a"), view.peer("peer-b")
        a.round, a.step, a.tokens, a.sent, a.throughput, a.loss, a.loss_kind = 3, 30, 1920, 4096, 100.0, 2.5, "held-out"
        b.rejects = 2
        view.gone(b, 5.0, "killed")
        view.round_seen(2, "peer-a", 4.0, 2, 1, 4096, 0.25, 1.0, "abc")
        view.eval_seen(4.5, 1920, 2.5)
    dashboard = Dashboard(view, "127.0.0.1", 0)
    yield dashboard
    dashboard.close()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_the_page_its_json_and_a_404(served):
    code, kind, body = get(served.url)
    assert code == 200 and kind.startswith("text/html") and b'id="chart-tokens"' in body and b'id="peers"' in body
    code, kind, body = get(served.url + "api/status")
    status = json.loads(body)
    assert code == 200 and kind == "application/json" and status["run"] == "demo-run"
    assert [(p["id"], p["gone"]) for p in status["peers"]] == [("peer-a", False), ("peer-b", True)]
    assert status["totals"]["round"] == 2 and status["evals"][0]["loss"] == 2.5
    code, _, body = get(served.url + "nothing-here")
    assert code == 404 and b"/api/status" in body


def test_metrics_are_prometheus_text_with_lowcomm_series(served):
    code, kind, body = get(served.url + "metrics")
    assert code == 200 and kind.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    run = ("run", "demo-run")
    assert samples[("lowcomm_peers", (run, ("state", "live")))] == 1
    assert samples[("lowcomm_peers", (run, ("state", "gone")))] == 1
    assert samples[("lowcomm_round", (run,))] == 2
    assert samples[("lowcomm_tokens_total", (run,))] == 1920
    assert samples[("lowcomm_rejects_total", (run,))] == 2
    assert samples[("lowcomm_loss", (run,))] == 2.5
    assert samples[("lowcomm_round_sync_seconds", (run,))] == 0.25
    assert samples[("lowcomm_peer_up", (("peer", "peer-b"), run))] == 0
    assert samples[("lowcomm_peer_tokens_total", (("peer", "peer-a"), run))] == 1920
    assert samples[("lowcomm_peer_loss", (("kind", "held_out"), ("peer", "peer-a"), run))] == 2.5
    assert all(name.startswith("lowcomm_") for name, _ in samples)


def test_a_flood_of_idle_connections_is_refused_past_the_bound_and_the_page_comes_back(served):
    idle = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(MAX_CLIENTS + 8)]
    try:
        closed = 0
        for s in idle[MAX_CLIENTS:]:  # the server closes what it cannot serve, without an answer
            closed += s.recv(1) == b""
        assert closed == 8
    finally:
        for s in idle:
            s.close()
    code = 0
    for _ in range(50):  # the idle clients' slots come free as their handlers see them close
        try:
            code = get(served.url + "api/status")[0]
            break
        except (ConnectionError, urllib.error.URLError):
            continue
    assert code == 200


def test_only_get_and_head_are_answered(served):
    request = urllib.request.Request(served.url + "api/status", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 501
    head = urllib.request.Request(served.url + "api/status", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as answer:
        assert answer.status == 200 and answer.read() == b""


def test_a_port_in_use_is_one_line_saying_what_to_do(served):
    with pytest.raises(OSError, match="pass another --dashboard-port"):
        Dashboard(RunView("r", "records"), "127.0.0.1", served.port)


def test_a_route_that_fails_answers_500_and_the_server_goes_on(served, monkeypatch):
    def broken():
        raise RuntimeError("a bug")
    monkeypatch.setattr(served.view, "snapshot", broken)
    assert get(served.url + "api/status")[0] == 500
    assert get(served.url)[0] == 200
