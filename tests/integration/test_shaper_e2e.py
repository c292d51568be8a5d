"""The link shaper in a simulation of real peers: every round takes at least its bytes over the rate."""

from __future__ import annotations

import pytest

from lowcomm.config import default_config
from lowcomm.transport.shaper import BURST_S, parse_link

# ---- a shaped simulation ---------------------------------------------------------------------------

def test_shaped_simulation_rounds_take_at_least_their_bytes_over_the_rate(tmp_path):
    from lowcomm.runtime.sim import Simulation

    config = default_config().override({"run.steps": 20, "diloco.inner_steps": 5, "link.default": "50mbit:20ms",
                                        "sync.reduce_timeout_s": 15.0})
    sim = Simulation(config, 2, tmp_path / "run", progress=False, timeout_s=300)
    report = sim.run()
    link = parse_link("50mbit:20ms")
    assert report["failed_peers"] == [] and set(report["links"].values()) == {"50mbit:20ms"}
    per_peer = {}
    for r in (r for r in sim.records() if r["type"] == "round"):
        per_peer.setdefault(r["round"], []).append(r["bytes"])
    assert sorted(per_peer) == [0, 1, 2, 3]
    # every round a peer recorded is time its training loop waited (the loop's clock wraps the round's)
    last = {r["peer"]: r for r in sim.records() if r["type"] == "compute"}
    for peer, c in last.items():
        own = sum(r["sync_s"] for r in sim.records() if r["type"] == "round" and r["peer"] == peer)
        assert c["sync_wait_s"] >= own - 1e-3 and own > 0
    assert report["sync_wait_s"] == pytest.approx(sum(c["sync_wait_s"] for c in last.values()))
    assert report["eval_s"] > 0  # the final evaluation at least
    for row in report["rounds"]:
        slack = link.bytes_per_s * BURST_S
        assert all(row["sync_s"] * link.bytes_per_s >= b - slack for b in per_peer[row["round"]]), row
        assert row["link_bound_s"] == pytest.approx(max(per_peer[row["round"]]) / link.bytes_per_s)
        assert row["bytes"] == sum(per_peer[row["round"]]) > 0
