"""A peer stopped the way services are stopped: SIGTERM or SIGINT to its process, or to its whole
process group (`kill -- -PGID`, systemd), ends it cleanly, its DHT child and p2pd included.

The peer logs its leave with the signal and its exit, and exits 0; the bounds on the waits only
catch a hang, they are never what is asserted."""

from __future__ import annotations

import signal

import pytest
from children import events, wait_until

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

HANG_S = 90.0  # far beyond a clean stop (about a second); only a hang reaches it


@pytest.mark.parametrize("signum, whole_group", [(signal.SIGTERM, True), (signal.SIGINT, True),
                                                 (signal.SIGTERM, False)])
def test_a_signalled_peer_leaves_cleanly(tmp_path, signum, whole_group):
    config = default_config().override({"run.steps": 100000, "diloco.inner_steps": 10, "data.eval_every_tokens": 10**9,
                                        "checkpoint.every_rounds": 0})
    sim = Simulation(config, 1, tmp_path / "run", progress=False)
    try:
        sim.start_coordinator()
        peer = sim.start_peer(0, park=False)
        wait_until(lambda: any(r["type"] == "round" for r in sim.records()), 300, "a first round")
        if whole_group:
            peer.kill_group(signum)
        else:
            peer.popen.send_signal(signum)
        code = peer.popen.wait(timeout=HANG_S)
        wait_until(lambda: not peer.group_alive(), 30, "the peer's process group (DHT child, p2pd) to end")
    finally:
        leftovers = sim.stop_all()
    records = sim.records()
    assert code == 0 and leftovers == []
    assert [e["signal"] for e in events(records, "leave")] == [signal.Signals(signum).name]
    assert len(events(records, "exit")) == 1 and events(records, "stopped")
