"""Announcing the next round ahead, with real peers: a peer that starts a round only after its manifest
exists still contributes to it (the unit cases are in tests/unit/test_announce_ahead.py)."""

from __future__ import annotations

import pytest
from children import events, rounds_of

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation


@pytest.mark.parametrize("algo", ["diloco", "sparseloco"])
def test_a_peer_that_starts_a_round_after_its_manifest_still_contributes(tmp_path, algo):
    """Peer 2 reaches round LATE only once the round's manifest was written (a fault hook): it had
    announced LATE ahead, so it is a member, sends within the reduce deadline and is counted."""
    h, rounds, late = 5, 5, 2
    config = default_config().override({
        "run.algo": algo, "run.steps": h * rounds, "diloco.inner_steps": h, f"{algo}.inner_steps": h,
        "data.eval_every_tokens": 10 ** 9, "sync.reduce_timeout_s": 8.0, "sync.announce_s": 3.0,
        "sync.manifest_s": 3.0})
    sim = Simulation(config, 3, tmp_path / "run", progress=False)
    try:
        sim.start_coordinator()
        peers = [sim.start_peer(i, fault=f"late-start@{late}" if i == 2 else None) for i in range(3)]
        sim.release(peers)
        sim.wait_peers(peers, timeout=600)
        exit_codes = [p.popen.returncode for p in peers]
    finally:
        leftovers = sim.stop_all()
    assert exit_codes == [0, 0, 0] and leftovers == []
    records = sim.records()
    hooked = events(records, "fault_late")
    assert [(e["round"], e["hook"]) for e in hooked] == [(late, "late-start")]
    slow = hooked[0]["peer"]
    by_round = rounds_of(records)
    assert len(by_round[late]) == 3
    for record in by_round[late]:
        assert slow in record["participants"] and slow in record["contributors"], record
    assert not [e for e in events(records, "caught_up", slow) if e["round"] == late]
    assert all(len({r["phi_hash"] for r in rs}) == 1 for rs in by_round.values())
