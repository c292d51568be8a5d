"""The φ drift check end to end: replicas whose φ drifted apart (a fault hook) resync from the agreed
φ, by majority, and by the smallest peer id when the split is a tie (the rule's unit cases:
tests/unit/test_drift.py)."""

from __future__ import annotations

from children import events, rounds_of

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

H, ROUNDS, TIE_AT, ALONE_AT = 5, 10, 2, 6  # peers 2 and 3 drift after TIE_AT, peer 1 after ALONE_AT


def test_drifted_replicas_resync_to_one_phi_after_a_tie_and_after_a_lone_drift(tmp_path):
    config = default_config().override({
        "run.algo": "diloco", "run.steps": H * ROUNDS, "diloco.inner_steps": H,
        "data.eval_every_tokens": 10 ** 9, "sync.reduce_timeout_s": 8.0, "sync.announce_s": 3.0,
        "sync.manifest_s": 3.0})
    sim = Simulation(config, 4, tmp_path / "run", progress=False)
    faults = {1: f"drift-phi@{ALONE_AT}", 2: f"drift-phi@{TIE_AT}", 3: f"drift-phi@{TIE_AT}"}
    try:
        sim.start_coordinator()
        peers = [sim.start_peer(i, fault=faults.get(i)) for i in range(4)]
        sim.release(peers)
        sim.wait_peers(peers, timeout=900)
        exit_codes = [p.popen.returncode for p in peers]
    finally:
        leftovers = sim.stop_all()
    assert exit_codes == [0, 0, 0, 0] and leftovers == []
    records = sim.records()
    ids = {e["data_shard"]: e["peer"] for e in events(records, "start")}
    assert sorted(e["peer"] for e in events(records, "fault_drift")) == sorted(ids[i] for i in faults)

    # The tie: {0, 1} against {2, 3}; the side holding the smallest id stays, the other resyncs from it.
    winners = {ids[0], ids[1]} if min(ids.values()) in (ids[0], ids[1]) else {ids[2], ids[3]}
    resyncs = [e for e in events(records, "resync") if "disagrees" in e.get("reason", "")]
    at_tie = [e for e in resyncs if e["round"] == TIE_AT + 1]
    assert sorted(e["peer"] for e in at_tie) == sorted(set(ids.values()) - winners), resyncs
    for e in at_tie:  # from a peer of the agreed side
        assert events(records, "state_received", e["peer"])[0]["source"] in winners
    # The lone drift: peer 1 against three.
    assert [e["peer"] for e in resyncs if e["round"] == ALONE_AT + 1] == [ids[1]]
    assert len(resyncs) == len(at_tie) + 1
    for e in resyncs:  # back to training once resynced: a source for others again
        states = [s for s in events(records, "state", e["peer"]) if s["t"] > e["t"]]
        assert [s["state"] for s in states[:2]] == ["joining", "training"], (e, states)

    rounds = rounds_of(records)
    for round_, rs in rounds.items():
        hashes = {r["phi_hash"] for r in rs}
        assert len(hashes) == (2 if round_ in (TIE_AT, ALONE_AT) else 1), (round_, rs)
    finals = [r for r in records if r["type"] == "eval" and r.get("final")]
    assert len(finals) == 4 and len({r["phi_hash"] for r in finals}) == 1
