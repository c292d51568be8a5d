"""A pipelined peer sent away with SIGTERM leaves like any peer: it logs the leave and stops its gRPC server.

A stage peer's gRPC server and its stage server are two objects; the leave must stop the first
(within its grace) and the signal handler must mark the peer that runs (it logs the `leave`).
"""

from __future__ import annotations

from children import events
from integration.test_pipeline_e2e import pipeline_config, simulate


def test_a_pipelined_peer_that_leaves_logs_it_and_stops_its_grpc_server(tmp_path_factory):
    run = simulate(tmp_path_factory, "pipeline-leave", pipeline_config(2, 240, "leave:1@r1"), peers=4)
    report, records = run["report"], run["records"]
    assert len(report["churn"]["left"]) == 1, report["churn"]
    leaves = [e for e in events(records, "leave") if e.get("signal")]
    assert [e["signal"] for e in leaves] == ["SIGTERM"], leaves
    leaver = leaves[0]["peer"]
    exits = events(records, "exit", peer=leaver)
    assert len(exits) == 1 and exits[0]["server_stopped"] is True, exits
    others = {r["peer"] for r in records if r["peer"] != leaver and r["type"] == "event" and r.get("kind") == "exit"}
    assert len(others) == 3
    assert all(e["server_stopped"] is True for p in others for e in events(records, "exit", peer=p))
