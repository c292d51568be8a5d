"""PeerStats (runtime.peer_stats) sums the records a peer writes through RunLog (runtime.runlog) into
a small summary, and a sink that raises never breaks the log."""

from __future__ import annotations

import json
import logging
import math

from lowcomm.runtime.peer_stats import PeerStats
from lowcomm.runtime.runlog import RunLog
from lowcomm.transport.wire import Traffic

ME, OTHER = "12D3KooWme", "12D3KooWother"
SUMMARY_KEYS = {"tokens", "steps", "sent", "received", "rejects", "resyncs", "contributed", "participated", "sync_s",
                "last_round"}


def a_run(log: RunLog) -> None:
    """Two applied rounds (this peer contributes to the first only), compute, evals, rejects and a resync."""
    log.event("start", algo="diloco", device="cpu", endpoint="127.0.0.1:1")
    log.write("compute", steps=10, tokens=1280, bytes_sent=5000, checkpoint_bytes=70, compute_s=1.0)
    log.write("round", round=0, sync_s=1.25, bytes=4000, participants=[ME, OTHER], contributors=[ME, OTHER],
              phi_hash="ab" * 32)
    log.event("reject", round=1, sender=OTHER, error="a part of the wrong size")
    log.event("reject", method="Reduce", error="unsigned")
    log.write("train", step=15, loss=4.5)
    log.write("compute", steps=20, tokens=2560, bytes_sent=9000, checkpoint_bytes=70, compute_s=2.0)
    log.write("round", round=1, sync_s=0.5, bytes=3000, participants=[ME, OTHER], contributors=[OTHER],
              phi_hash="cd" * 32)
    log.write("eval", round=2, step=20, tokens=5120, loss=3.75, final=False)
    log.event("resync", round=2, reason="drift")
    log.event("caught_up", round=2, contributors=1)


def test_records_in_summary_out():
    stats = PeerStats(ME)
    log = RunLog(None, ME, sinks=[stats.observe])
    a_run(log)
    summary = stats.summary()
    assert set(summary) == SUMMARY_KEYS
    assert summary == {"tokens": 2560, "steps": 20, "sent": 9000, "received": 0, "rejects": 2, "resyncs": 1,
                       "contributed": 1, "participated": 2, "sync_s": 1.75,
                       "last_round": {"round": 1, "participants": 2, "contributors": 1, "bytes": 3000, "sync_s": 0.5,
                                      "phi": "cd" * 8}}
    json.dumps(summary, allow_nan=False)  # plain JSON numbers


def test_summary_before_any_round_and_the_rest_of_the_snapshot():
    stats = PeerStats(ME)
    assert stats.summary()["last_round"] == {}
    assert stats.snapshot()["round"] == 0 and stats.snapshot()["train_loss"] is None
    a_run(RunLog(None, ME, sinks=[stats.observe]))
    s = stats.snapshot()
    assert (s["round"], s["train_loss"], s["held_out_loss"], s["checkpoint_sent"]) == (2, 4.5, 3.75, 70)
    assert s["info"] == {"algo": "diloco", "device": "cpu"}


def test_contributed_counts_only_rounds_with_this_peer_among_the_contributors():
    mine, theirs = PeerStats(ME), PeerStats(OTHER)
    a_run(RunLog(None, ME, sinks=[mine.observe, theirs.observe]))
    assert (mine.summary()["contributed"], theirs.summary()["contributed"]) == (1, 2)
    assert (mine.summary()["participated"], theirs.summary()["participated"]) == (2, 2)


def test_live_traffic_counts_over_the_compute_records():
    traffic = Traffic()
    traffic.sent, traffic.received, traffic.checkpoint_sent = 123, 456, 7
    stats = PeerStats(ME, traffic)
    a_run(RunLog(None, ME, sinks=[stats.observe]))
    assert (stats.summary()["sent"], stats.summary()["received"], stats.snapshot()["checkpoint_sent"]) == (123, 456, 7)


def test_a_downloaded_state_sets_the_round_held_and_losses_and_odd_fields_are_skipped():
    stats = PeerStats(ME)
    stats.observe({"type": "event", "kind": "state_received", "round": 7, "source": OTHER})
    stats.observe({"type": "eval", "loss": float("nan")})
    stats.observe({"type": "compute", "steps": "many", "tokens": -3, "loss": 2.0})
    stats.observe({"type": "round", "round": None})
    stats.observe({"type": "train", "loss": True})
    s = stats.snapshot()
    assert (s["round"], s["steps"], s["tokens"], s["held_out_loss"], s["train_loss"]) == (7, 0, 0, None, 2.0)
    assert all(math.isfinite(v) for v in (s["sync_s"], s["tokens"]))


def test_a_sink_that_raises_does_not_break_the_log(tmp_path, caplog):
    stats = PeerStats(ME)
    calls = []

    def broken(record):
        calls.append(record["type"])
        raise RuntimeError("a broken sink")

    path = tmp_path / "peer.jsonl"
    log = RunLog(path, ME, sinks=[broken, stats.observe])
    with caplog.at_level(logging.ERROR, logger="lowcomm.runtime.runlog"):
        a_run(log)
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == len(calls) == 11  # every record written, every one offered to the broken sink
    assert stats.summary()["steps"] == 20  # the sink after it still sees every record
    assert len([r for r in caplog.records if "sink failed" in r.getMessage()]) == 1  # logged once
