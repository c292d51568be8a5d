"""The one-step-delay overlap end to end: real peer processes on localhost, rounds landing one round
late, a peer left out of a round and a joiner both catching the round up from its members."""

from __future__ import annotations

import pytest
from children import events, rounds_of, wait_until

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

H, ROUNDS, LATE_ROUND, JOIN_AFTER = 5, 12, 5, 1


def config(algo: str):
    return default_config().override({
        "run.algo": algo, "run.steps": H * ROUNDS, "diloco.inner_steps": H, "sparseloco.inner_steps": H,
        "diloco.overlap": True, "sparseloco.overlap": True, "data.eval_every_tokens": 4 * H * 16 * 64 * 2,
        "sync.reduce_timeout_s": 8.0, "sync.announce_s": 3.0, "sync.manifest_s": 3.0})




@pytest.fixture(scope="module", params=["diloco", "sparseloco"])
def scenario(request, tmp_path_factory):
    """3 peers (peer 2 announces round LATE_ROUND too late) and a joiner after round JOIN_AFTER."""
    sim = Simulation(config(request.param), 3, tmp_path_factory.mktemp(request.param), progress=False)
    out = {"algo": request.param}
    try:
        sim.start_coordinator()
        peers = [sim.start_peer(i, fault=f"late-announce@{LATE_ROUND}" if i == 2 else None) for i in range(3)]
        join_file = sim.run_dir / "join"  # the joiner waits parked, connected, until it is its time
        joiner = sim.start_peer(3, start_file=join_file)
        sim.wait_ready([joiner])
        sim.release(peers)
        wait_until(lambda: any(r["type"] == "round" and r["round"] >= JOIN_AFTER for r in sim.records()), 300,
                   f"round {JOIN_AFTER}")
        join_file.touch()
        sim.wait_peers(peers + [joiner], timeout=900)
        out["exit_codes"] = [p.popen.returncode for p in peers + [joiner]]
        out["joiner_shard"] = 3
    finally:
        out["leftovers"] = sim.stop_all()
    out["records"] = sim.records()
    out["report"] = sim.report(0.0)
    return out


def test_every_round_lands_once_with_one_phi_and_the_loss_falls(scenario):
    assert scenario["exit_codes"] == [0, 0, 0, 0] and scenario["leftovers"] == []
    records, report = scenario["records"], scenario["report"]
    rounds = rounds_of(records)
    assert sorted(rounds) == list(range(ROUNDS))  # the last one landed at the drain
    for round_, rs in rounds.items():
        assert len({r["phi_hash"] for r in rs}) == 1, f"round {round_}: replicas hold different φ"
        assert rs[0]["contributors"]
    starters = [e["peer"] for e in events(records, "start")]
    assert not [e for e in events(records, "resync") if "disagrees" in e.get("reason", "")]
    evals = report["evals"]
    assert len(evals) >= 2 and evals[-1]["loss"] < evals[0]["loss"] - 0.3
    finals = [r for r in records if r["type"] == "eval" and r.get("final")]
    assert len(finals) == len(starters) and len({r["phi_hash"] for r in finals}) == 1  # θ = φ after the drain


def test_a_late_peer_catches_the_round_up_without_a_state_download(scenario):
    records = scenario["records"]
    late = events(records, "fault_late")
    assert len(late) == 1
    peer = late[0]["peer"]
    assert [e["round"] for e in events(records, "caught_up", peer)] == [LATE_ROUND]
    assert not events(records, "resync", peer)
    own = [r for r in rounds_of(records)[LATE_ROUND] if r["peer"] == peer]
    assert len(own) == 1 and own[0]["caught_up"] and peer not in own[0]["contributors"]
    later = [r for rnd, rs in rounds_of(records).items() if rnd > LATE_ROUND for r in rs if r["peer"] == peer]
    assert any(peer in r["contributors"] for r in later)


def test_a_joiner_fetches_the_round_in_flight_and_holds_the_members_phi(scenario):
    records = scenario["records"]
    joiner = next(e["peer"] for e in events(records, "start") if e.get("data_shard") == scenario["joiner_shard"])
    entered = events(records, "state_received", joiner)
    why = [(e["kind"], e.get("round"), e.get("reason") or e.get("error")) for e in records
           if e["type"] == "event" and e.get("peer") == joiner and e["kind"] in ("resync", "timeout", "state_error")]
    assert len(entered) == 1, why  # a second download follows a resync: its reason
    first = entered[0]["round"]
    assert not events(records, "resync", joiner)
    own = sorted((r for r in records if r["type"] == "round" and r["peer"] == joiner), key=lambda r: r["round"])
    assert own[0]["round"] == first - 1 and own[0]["caught_up"]  # the round in flight at the download
    for r in own:  # from then on it holds the members' φ after every round
        assert len({x["phi_hash"] for x in rounds_of(records)[r["round"]]}) == 1
    assert any(joiner in r["contributors"] for r in own[1:])
    # its drift checks found every voter's φ vote: posted, or pulled from the voter (Decision 39)
    assert not events(records, "drift_unchecked", joiner), events(records, "drift_unchecked", joiner)


def test_a_landed_round_is_charged_the_bytes_its_background_reduce_sent(scenario):
    """A round's reduce runs during the next round's inner steps: its record counts what was sent since
    the previous landing, so a peer's rounds add up to nearly all it sent (the loss-vs-bytes curves)."""
    records = scenario["records"]
    for exit_ in events(records, "exit"):
        own = [r["bytes"] for r in records if r["type"] == "round" and r["peer"] == exit_["peer"]]
        assert exit_["bytes_sent"] > 0 and sum(own) >= 0.8 * exit_["bytes_sent"], (exit_["peer"], own)
