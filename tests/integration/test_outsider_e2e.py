"""Outsiders against a live swarm: a simulate run of 3 DiLoCo peers (and a joiner) while an outsider
process (tests/outsider.py: fresh keys, its own DHT node joined through the coordinator, the
project's gRPC stubs) forges parts under members' ids, sends parts as a non-member, sends a
decompression bomb, floods the owners with streams, publishes manifests of the coming rounds naming
itself the only owner, and has sybil keys vote a φ of their own and advertise a poisoned state.

Every honest peer finishes; no outsider key is ever a participant or a contributor; every round's φ
hashes agree; every part the outsider sent is refused, each with its reason in a `reject` event of
the peer it reached; nobody loads the outsider's state; no peer waits for a sybil's record in more
than two rounds. Assertions are on records and the outsider's log of answers, never on durations;
the outsider runs in its own process group, every wait has a deadline.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from lowcomm.config import default_config
from lowcomm.runtime.sim import Simulation

from children import events, wait_until
from outsider_process import start_outsider, stop_outsider

H, ROUNDS, PEERS = 3, 8, 3  # the joiner (round 3) has rounds to get in before the run ends
PARTS = ("forged", "nonmember", "bomb", "flood")
# how a stream still open when the run ended, or one beyond a cap, is answered
BUSY = {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED"}


def answers(run_dir: Path) -> list[dict]:
    path = run_dir / "outsider.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def rejects(records: list[dict], needle: str) -> list[dict]:
    return [e for e in events(records, "reject") if needle in (e.get("error") or e.get("reason") or "")]


@pytest.mark.timeout(480)
def test_outsiders_are_refused_by_a_live_swarm_and_change_nothing(tmp_path):
    config = default_config().override({
        "run.steps": H * ROUNDS, "diloco.inner_steps": H, "data.eval_every_tokens": 1 << 40,
        "data.eval_batches": 2, "sync.reduce_timeout_s": 8.0, "sync.announce_s": 3.0, "sync.manifest_s": 3.0,
        "checkpoint.every_rounds": 2, "checkpoint.every_s": 0, "checkpoint.max_share": 0, "churn.spec": "join:1@r3"})
    run_dir = tmp_path / "run"
    outsider = start_outsider(run_dir, 400)
    try:
        sim = Simulation(config, PEERS, run_dir, progress=False, timeout_s=360)
        report = sim.run()  # raises if any process group outlived the run
        wait_until(lambda: {"forged", "nonmember", "bomb", "flood", "manifest", "sybil"}
                   <= {a["attack"] for a in answers(run_dir)}, 60, "one answer to every attack")
    finally:
        stop_outsider(outsider, run_dir)
    records, said = sim.records(), answers(run_dir)
    ids = json.loads((run_dir / "outsider-ids.json").read_text())
    strangers = {ids["outsider"], *ids["sybils"], *ids["flood"]}

    assert report["failed_peers"] == []
    assert all(p.popen.returncode == 0 for p in sim.processes if p.name.startswith("peer-"))
    assert not [a for a in said if a["attack"] == "error"], [a for a in said if a["attack"] == "error"]
    rows = {row["round"]: row for row in report["rounds"]}
    assert sorted(rows) == list(range(ROUNDS))
    ids_by_index = sim.peer_ids(records)
    first = {ids_by_index[i] for i in range(PEERS)}
    for row in rows.values():
        assert not strangers & (set(row["participants"]) | set(row["contributors"])), row
        assert len(row["phi_hashes"]) == 1, row  # every peer that applied the round holds the same φ
        assert first <= set(row["contributors"]), row  # no outsider kept a member's part out
    for r in records:
        if r["type"] == "round":
            assert not strangers & (set(r.get("participants", [])) | set(r.get("contributors", []))), r

    # every part the outsider sent was refused, never taken into a round
    parts = [a for a in said if a["attack"] in PARTS]
    assert parts and all(a["status"] != "OK" and not a.get("contributors") for a in parts), \
        [a for a in parts if a["status"] == "OK"]
    refused = [a for a in parts if a["status"] == "REJECTED"]
    assert {a["status"] for a in parts} <= {"REJECTED", *BUSY}
    assert all("not the key of" in a["error"] for a in refused if a["attack"] == "forged" and a["signed"])
    assert all("no usable public key" in a["error"] for a in refused if a["attack"] == "forged" and not a["signed"])
    # a non-member's part is refused as such, or, sent for a round its owner has passed, as stale (the
    # outsider's view of the rounds is behind the swarm); the `reject` events below show the former
    assert all("is not a member" in a["error"] or a["error"].startswith("stale round")
               for a in refused if a["attack"] == "nonmember"), [a for a in refused if a["attack"] == "nonmember"]
    assert all("too far ahead" in a["error"] for a in refused if a["attack"] == "flood" and a["far"])
    # ... and each refusal is a `reject` event at the peer it reached, with its reason
    for needle in ("not the key of", "no usable public key", "is not a member", "too far ahead",
                   "a manifest from a peer outside the previous round's members"):
        assert rejects(records, needle), needle
    refused_writers = {e["sender"] for e in rejects(records, "outside the previous round's members")}
    assert refused_writers == {ids["outsider"][:40]}

    # a sybil's record, which names each next round and never announces, is waited for in two rounds at
    # most by each peer (Decision 47), not in every round
    waited = Counter((e["peer"], m) for e in events(records, "timeout") if e.get("stage") == "announce"
                     for m in e.get("missing", []) if m in strangers)
    assert max(waited.values(), default=0) <= 2, waited

    # nobody loaded, resynced to or checkpointed the outsider's state, and φ never followed its votes
    received = events(records, "state_received")
    assert received and not {e["source"] for e in received} & strangers
    assert not events(records, "resync")
    assert all(row["phi_hashes"] != ["f" * 64] for row in rows.values())
    assert list((run_dir / "checkpoints").glob("round-*")), "the coordinator kept no checkpoint"
