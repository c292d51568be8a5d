"""The status page's model (runtime.observer): records and DHT records in, the page's JSON out."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from lowcomm.runtime.observer import MAX_EVENTS, MAX_LINE, DhtSource, RecordsSource, RunView
from lowcomm.transport.control import PeerRecord, clean_stats


def write(path, *records, tail: str = "") -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)


def run_folder(tmp_path):
    peers, launcher = tmp_path / "peers", tmp_path / "launcher"
    peers.mkdir()
    launcher.mkdir()
    view = RunView("r", "records")
    return view, RecordsSource([peers, launcher], view), peers, launcher


def test_records_give_peers_rounds_evals_and_a_killed_peer_gone(tmp_path):
    view, source, peers, launcher = run_folder(tmp_path)
    for i, peer in enumerate(("a", "b")):
        write(peers / f"{peer}.jsonl",
              {"type": "event", "kind": "start", "peer": peer, "t": 1.0, "device": "cpu", "link": "20mbit:80ms",
               "endpoint": f"127.0.0.1:{9000 + i}"},
              {"type": "round", "peer": peer, "t": 2.0, "round": 0, "participants": ["a", "b"],
               "contributors": ["a", "b"] if peer == "a" else ["a"], "bytes": 100, "sync_s": 0.5 + i,
               "phi_hash": "f" * 40, "norm": 1.5},
              {"type": "compute", "peer": peer, "t": 3.0, "steps": 10, "tokens": 640, "compute_s": 2.0,
               "bytes_sent": 1000})
    write(peers / "a.jsonl", {"type": "eval", "peer": "a", "t": 3.5, "tokens": 1280, "loss": 3.25},
          {"type": "event", "kind": "reject", "peer": "a", "t": 3.6, "method": "Contribute", "error": "forged"})
    write(launcher / "churn.jsonl", {"type": "event", "kind": "kill", "by": "churn", "peer": "b", "t": 4.0,
                                     "name": "peer-1", "round": 1})
    source.poll()
    s = view.snapshot()
    by_id = {p["id"]: p for p in s["peers"]}
    assert by_id["a"]["device"] == "cpu" and by_id["a"]["link"] == "20mbit:80ms"
    assert (by_id["a"]["round"], by_id["a"]["step"], by_id["a"]["tokens"], by_id["a"]["sent"]) == (1, 10, 640, 1000)
    assert by_id["a"]["throughput"] == 320.0 and by_id["a"]["contributed"] == 1 and by_id["b"]["contributed"] == 0
    assert by_id["a"]["participated"] == by_id["b"]["participated"] == 1  # b was a member, left out
    assert by_id["a"]["rejects"] == 1 and by_id["a"]["loss"] == 3.25
    assert not by_id["a"]["gone"] and by_id["b"]["gone"] and by_id["b"]["gone_why"] == "killed"
    assert s["rounds"] == [{"round": 0, "t": 2.0, "participants": 2, "contributors": 2, "bytes": 200, "sync_s": 1.5,
                            "norm": 1.5, "phi": "f" * 16, "reporters": 2}]
    assert s["evals"] == [{"t": 3.5, "tokens": 1280, "bytes": 2000, "loss": 3.25}]
    kinds = [e["kind"] for e in s["events"]]
    assert kinds == ["join", "join", "reject", "kill", "gone"]
    assert s["totals"]["peers_live"] == 1 and s["totals"]["peers_gone"] == 1 and s["totals"]["rejects"] == 1
    json.dumps(s, allow_nan=False)


def test_records_are_tailed_a_torn_line_waits_and_bad_lines_are_skipped(tmp_path):
    view, source, peers, _ = run_folder(tmp_path)
    line = json.dumps({"type": "eval", "peer": "a", "t": 5.0, "tokens": 1, "loss": 2.0})
    write(peers / "a.jsonl", {"type": "eval", "peer": "a", "t": 4.0, "tokens": 1, "loss": float("nan")},
          tail="not json\n" + "x" * (MAX_LINE + 1) + "\n" + '["a list"]\n' + line[:10])
    source.poll()
    assert view.snapshot()["evals"] == []  # NaN dropped, garbage skipped, the torn line not yet read
    write(peers / "a.jsonl", tail=line[10:] + "\n")
    source.poll()
    source.poll()  # nothing new: nothing read twice
    assert [e["loss"] for e in view.snapshot()["evals"]] == [2.0]


def test_records_older_than_the_page_are_not_shown(tmp_path):
    view = RunView("r", "records")
    (tmp_path / "peers").mkdir()
    write(tmp_path / "peers" / "old.jsonl", {"type": "event", "kind": "start", "peer": "old", "t": 10.0})
    RecordsSource([tmp_path / "peers"], view, since=20.0).poll()
    assert view.snapshot()["peers"] == []


def test_the_event_list_is_bounded_and_holds_no_nan():
    view = RunView("r", "records")
    for i in range(MAX_EVENTS + 50):
        view.event(float(i), "reject", "p" * 500, reason="x" * 10_000, score=math.inf, n=i, nested={"a": 1})
    events = view.snapshot()["events"]
    assert len(events) == MAX_EVENTS and events[-1]["detail"] == {"reason": "x" * 200, "n": MAX_EVENTS + 49}
    assert len(events[-1]["peer"]) == 64


class FakeControl:  # the DHT's answers, as ControlPlane.live_peers and live_stats give them (checked records)
    def __init__(self):
        self.records: dict[str, PeerRecord] = {}
        self.stats: dict[str, dict] = {}

    def live_peers(self):
        return dict(self.records)

    def live_stats(self):
        return dict(self.stats)


def record(peer_id: str, **fields) -> PeerRecord:
    return PeerRecord.from_value({**asdict(PeerRecord(peer_id, "127.0.0.1:1")), **fields})


def test_dht_records_give_joins_counters_rounds_and_gone_peers():
    control, view = FakeControl(), RunView("r", "dht")
    source = DhtSource(control, view)
    last = {"round": 3, "participants": 2, "contributors": 2, "bytes": 500, "sync_s": 0.7, "norm": 0.25, "phi": "ab"}
    control.records = {"a": record("a", state="training", round=4, heartbeat=10.0, loss=3.0, loss_kind="held-out"),
                       "b": record("b", state="training", heartbeat=10.0),
                       "c": record("c", state="coordinator", heartbeat=10.0)}
    control.stats = {"a": clean_stats({"tokens": 100, "sent": 50, "rejects": 0, "last_round": last}),
                     "b": clean_stats({"tokens": 200, "last_round": last})}
    source.poll()
    control.records["a"] = record("a", state="training", round=5, heartbeat=12.0, loss=2.5, loss_kind="held-out")
    control.stats["a"] = clean_stats({"tokens": 300, "sent": 70, "rejects": 2})
    del control.records["b"], control.stats["b"]
    source.poll()
    s = view.snapshot()
    by_id = {p["id"]: p for p in s["peers"]}
    assert by_id["a"]["tokens"] == 300 and by_id["a"]["rejects"] == 2 and not by_id["a"]["gone"]
    assert by_id["b"]["gone"] and by_id["b"]["gone_why"] == "its record expired"
    assert [(e["kind"], e["peer"]) for e in s["events"]] == [("join", "a"), ("join", "b"), ("join", "c"),
                                                             ("reject", "a"), ("gone", "b")]
    assert by_id["c"]["state"] == "coordinator" and (s["totals"]["peers_live"], s["totals"]["peers_gone"]) == (1, 1)
    assert s["rounds"][0]["bytes"] == 1000 and s["rounds"][0]["reporters"] == 2 and s["rounds"][0]["phi"] == "ab"
    assert [e["loss"] for e in s["evals"]] == [3.0, 2.5]


@pytest.mark.parametrize("stats", [
    [], {"tokens": math.nan}, {"tokens": -1}, {"tokens": True}, {"tokens": 1e30}, {"sent": "1"},
    {"last_round": []}, {"last_round": {"round": math.inf}}, {"last_round": {"round": 1, "phi": "x" * 65}},
    {"last_round": {"round": 1, "phi": "\x1b[31m"}},
])
def test_hostile_stats_are_refused(stats):
    with pytest.raises(ValueError):
        clean_stats(stats)


def test_stats_keep_only_the_known_numbers_and_records_only_short_labels():
    assert clean_stats({"tokens": 5, "junk": "x" * 1000, "last_round": {"round": 2, "extra": 1}}) == \
        {"tokens": 5, "last_round": {"round": 2, "phi": ""}}
    with pytest.raises(ValueError):
        record("a", link="x" * 65)
    with pytest.raises(ValueError):
        record("a", state="\x1b[2J")
