"""A peer cut off from the swarm (docs/round-protocol.md, Decision 27): it neither writes nor follows a
round it would take alone after a round with others, a minority writes no manifest while the majority
is live, the survivors of a killed majority go on once the dead records expire, a one-peer run still
runs, a reduce in which nothing reached the peer and nothing came back is no round, nor one that lost
a shard and counted only the peer's own part (a round whose other parts were refused goes on), the
parts of two manifests of one round never mix, a peer
back in the swarm awaits the parts of the round it runs, and a resync that no source serves gives up at
its deadline.

Manifest cases run over test_who_counts' in-memory control plane; the reduce case over real gRPC on
loopback (test_sharded_reduce's nodes). No assertion is on a duration.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import Manifest, ManifestAgreement
from lowcomm.collectives.reduce_owner import ContributionRejected, OwnerSlots, Slot
from lowcomm.transport.control import PeerRecord
from unit import test_sharded_reduce
from unit.test_sharded_reduce import KEY, WAIT_S, Board, payload
from unit.test_who_counts import MemoryControl, state_sync

GROUP, ROUND = "0-0", 5
SYNC = SyncConfig(announce_s=0.2, manifest_s=0.2, heartbeat_s=0.1, record_ttl_s=0.2)  # a quorum wait of 0.5 s
nodes = test_sharded_reduce.nodes  # the fixture: real gRPC nodes on loopback


def training(*ids: str) -> dict[str, PeerRecord]:
    return {p: PeerRecord(p, f"{p}:1", state="training", round=ROUND) for p in ids}


def agreement(me: str, store: dict, live: dict, previous: list[str] | None, events: list | None = None,
              quorum: bool = True) -> ManifestAgreement:
    """A training peer's agreement that followed the manifest of round ROUND - 1 with ``previous`` members."""
    on_event = (lambda kind, **f: events.append((me, kind, f))) if events is not None else None
    found = ManifestAgreement(MemoryControl(me, store, live), SYNC, f"{me}:1", on_event=on_event, quorum=quorum)
    if previous is not None:
        found.learn(GROUP, ROUND - 1, previous)
    return found


def agree_all(agreements: list[ManifestAgreement]) -> list:
    """Each agreement's manifest of ROUND, or the CollectiveError it raised, from threads run together."""
    results = [None] * len(agreements)

    def agree(i):
        try:
            results[i] = agreements[i].agree(GROUP, ROUND, 1, "fp32")
        except CollectiveError as e:
            results[i] = e

    threads = [threading.Thread(target=agree, args=(i,)) for i in range(len(agreements))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results


@pytest.mark.parametrize("others_live", [True, False])  # cut off for less, or for longer, than a record lives
def test_a_peer_that_sees_only_itself_after_a_round_with_others_writes_no_manifest(others_live):
    store, events = {}, []
    live = training("a", "b", "x") if others_live else training("x")
    x = agreement("x", store, live, ["a", "b", "x"], events)
    with pytest.raises(CollectiveError, match="alone"):
        x.agree(GROUP, ROUND, 1, "fp32")
    assert MemoryControl("a", store, live).manifests(GROUP, ROUND) == {}
    assert any(kind == "timeout" and f.get("stage") == "quorum" for _, kind, f in events)
    assert x.trusted(GROUP, ROUND + 1) == frozenset({"a", "b", "x"})  # no solo round remembered


def test_members_announced_only_ahead_make_no_quorum_and_the_failed_round_is_withdrawn():
    store, live = {}, training("a", "b", "x")
    for peer in ("a", "b"):  # announced ahead before x's link went down: x still reads them
        agreement(peer, store, live, None).announce(GROUP, ROUND, ahead=True)
    x = agreement("x", store, live, ["a", "b", "x"])
    with pytest.raises(CollectiveError, match="alone"):
        x.agree(GROUP, ROUND, 1, "fp32")
    assert MemoryControl("a", store, live).manifests(GROUP, ROUND) == {}
    assert "x" not in MemoryControl("a", store, live).announcers(GROUP, ROUND)  # no later manifest names it


def test_a_manifest_naming_only_this_peer_after_a_round_with_others_is_not_followed():
    store, live = {}, training("x")
    solo = Manifest("run", GROUP, ROUND, 1, "x", ["x"], {"x": "x:1"}, ["x"], "fp32")
    MemoryControl("x", store, live).publish_manifest(GROUP, ROUND, solo.to_dict(), 60)  # as a writer without quorum
    x = agreement("x", store, live, ["a", "b", "x"])
    with pytest.raises(CollectiveError, match="only this peer"):
        x.agree(GROUP, ROUND, 1, "fp32")
    assert x.trusted(GROUP, ROUND + 1) == frozenset({"a", "b", "x"})


def test_a_one_peer_run_still_runs():
    store, live = {}, training("x")
    assert agreement("x", store, live, None).agree(GROUP, ROUND, 1, "fp32").members == ["x"]  # its first round
    assert agreement("x", {}, live, ["x"]).agree(GROUP, ROUND, 1, "fp32").members == ["x"]  # alone before too


def test_the_majority_goes_on_without_the_cut_off_peer():
    store, live = {}, training("a", "b", "x")  # x's record is still live: the majority waits announce_s for it
    results = agree_all([agreement(p, store, live, ["a", "b", "x"]) for p in ("a", "b")])
    assert all(isinstance(m, Manifest) and m.members == ["a", "b"] and m.leader == "a" for m in results)


def test_the_side_that_wins_a_tied_phi_vote_goes_on_while_the_other_resyncs():
    """A 2-2 tie of the φ vote: the losing side resyncs (its records `joining`); the winners are the
    whole of the previous round's members still training, so they write the round the losers then
    download. A pair's winner goes on alone while its only other member resyncs."""
    store, previous = {}, ["a", "b", "c", "d"]
    live = training("a", "b") | {p: PeerRecord(p, f"{p}:1", state="joining", round=ROUND + 1) for p in ("c", "d")}
    results = agree_all([agreement(p, store, live, previous) for p in ("a", "b")])
    assert all(isinstance(m, Manifest) and m.members == ["a", "b"] for m in results), results
    store = {}
    live = training("a") | {"b": PeerRecord("b", "b:1", state="joining", round=ROUND + 1)}
    assert agreement("a", store, live, ["a", "b"]).agree(GROUP, ROUND, 1, "fp32").members == ["a"]


def test_a_minority_writes_no_manifest_while_the_majority_is_live():
    store, previous = {}, ["a", "b", "c", "d", "e"]
    live = training(*previous)
    results = agree_all([agreement(p, store, live, previous) for p in ("d", "e")])
    assert all(isinstance(e, CollectiveError) and "not a majority" in str(e) for e in results)
    assert MemoryControl("a", store, live).manifests(GROUP, ROUND) == {}


def test_the_survivors_of_a_killed_majority_go_on_once_the_dead_records_expire():
    store, previous, events = {}, ["a", "b", "c", "d", "e"], []
    live = training(*previous)  # c, d and e were killed: their records outlive them until they expire
    expired = threading.Event()

    def on_event(me, kind, fields):
        events.append((me, kind, fields))
        if kind == "timeout" and fields.get("stage") == "quorum" and not expired.is_set():
            expired.set()  # the dead records expire at the first shortfall
            for dead in ("c", "d", "e"):
                live.pop(dead, None)

    survivors = []
    for p in ("a", "b"):
        survivor = agreement(p, store, live, previous)
        survivor.on_event = lambda kind, p=p, **f: on_event(p, kind, f)
        survivors.append(survivor)
    results = agree_all(survivors)
    assert expired.is_set()  # they waited for the quorum ...
    assert all(isinstance(m, Manifest) and m.members == ["a", "b"] for m in results)  # ... and went on


def test_without_quorum_a_lone_peer_still_writes_its_own_manifest():
    """Pipeline stages and tools that build an agreement without ``quorum`` keep the old rule."""
    x = agreement("x", {}, training("x"), ["a", "b", "x"], quorum=False)
    assert x.agree(GROUP, ROUND, 1, "fp32").members == ["x"]


def test_a_reduce_in_which_nothing_reached_the_peer_and_nothing_came_back_is_no_round(nodes):
    a, b, x = nodes[:3]
    board = Board(KEY.run, {a.id, b.id, x.id})
    ids = sorted([a.id, b.id, x.id])
    # the round's manifest was agreed before x's link went down: a and b never hear from it again
    board.manifests[(KEY.group, 3)] = Manifest(KEY.run, KEY.group, 3, 1, ids[0], ids,
                                               {n.id: n.endpoint for n in (a, b, x)}, ids, "fp32")
    a.reduce(board), b.reduce(board)  # they serve, but never run round 3 with x
    handle = x.reduce(board).start(KEY, 3, payload(0), 1.0)
    with pytest.raises(CollectiveError, match="cut off"):
        handle.result(WAIT_S)


def test_a_reduce_with_a_lost_shard_in_which_only_the_own_part_counted_is_no_round(nodes):
    """Back from a cut under a manifest of its own, a peer's parts reach owners serving another one:
    one shard never comes, and no other member's part counts in the rest (here a's part is refused
    as non-finite, b never runs the round). Applying it would be its own Δ alone."""
    a, b, x = nodes[:3]
    board = Board(KEY.run, {a.id, b.id, x.id})
    ids = sorted([a.id, b.id, x.id])
    board.manifests[(KEY.group, 3)] = Manifest(KEY.run, KEY.group, 3, 1, ids[0], ids,
                                               {n.id: n.endpoint for n in (a, b, x)}, ids, "fp32")
    b.reduce(board)  # it serves, but never runs round 3
    theirs = a.reduce(board).start(KEY, 3, torch.full_like(payload(0), float("nan")), 1.0)
    mine = x.reduce(board).start(KEY, 3, payload(2), 1.0)
    with pytest.raises(CollectiveError, match="cut off"):
        mine.result(WAIT_S)
    assert theirs.result(WAIT_S).contributors == [x.id]  # a applies x's part: it is not alone


def test_the_parts_of_two_manifests_of_one_round_never_mix(nodes):
    """A split round: a and b follow a's manifest (x announced before its cut, so it is a member), x, back
    from the cut, wrote its own with b. Both have the same owners, so each part fits the other side's
    shard; every part names its manifest, so each side refuses the other's, and x's round is no round."""
    a, b, x = nodes[:3]
    theirs, mine = Board(KEY.run, {a.id, b.id, x.id}), Board(KEY.run, {b.id, x.id})
    owners = sorted([b.id, x.id])
    endpoints = {n.id: n.endpoint for n in (a, b, x)}
    theirs.manifests[(KEY.group, 3)] = Manifest(KEY.run, KEY.group, 3, 1, a.id, sorted([a.id, b.id, x.id]),
                                                endpoints, owners, "fp32")
    mine.manifests[(KEY.group, 3)] = Manifest(KEY.run, KEY.group, 3, 1, x.id, owners,
                                              {p: endpoints[p] for p in owners}, owners, "fp32")
    reduces = [a.reduce(theirs), b.reduce(theirs), x.reduce(mine)]  # every node serves before any part is sent
    handles = [r.start(KEY, 3, payload(i), 1.0) for i, r in enumerate(reduces)]
    with pytest.raises(CollectiveError, match="cut off"):
        handles.pop().result(WAIT_S)
    results = [h.result(WAIT_S) for h in handles]
    assert torch.equal(results[0].aggregate, results[1].aggregate)
    assert all(x.id not in r.contributors and x.id not in sum(r.info["shard_contributors"].values(), [])
               for r in results)
    def refused(owner, sender) -> list[str]:
        return [e["error"] for e in owner.events if e["kind"] == "reject" and e["sender"] == sender.id[:40]]
    assert ["another manifest" in e for e in refused(b, x) + refused(x, b)] == [True, True]
    assert refused(x, a) == [f"{a.id!r} is not a member of round 3"]


def test_a_peer_whose_every_other_part_was_refused_still_applies_the_round(nodes):
    """Every shard came back and only the own part counted (the other member's was refused): that is
    no cut, the round goes on without the refused part (tests/unit/test_streamed_reduce.py)."""
    a, x = nodes[:2]
    board = Board(KEY.run, {a.id, x.id})
    theirs = a.reduce(board).start(KEY, 0, torch.full_like(payload(0), float("nan")), 1.0)
    result = x.reduce(board).start(KEY, 0, payload(2), 1.0).result(WAIT_S)
    assert result.contributors == [x.id] and result.info["lost_shards"] == []
    assert theirs.result(WAIT_S).contributors == [x.id]


@pytest.mark.timeout(120)
def test_a_resync_that_no_source_serves_gives_up_at_its_deadline():
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator")}  # the swarm finished and left
    sync, events = state_sync("me", {}, live)
    sync.config.sync.announce_s = sync.config.sync.manifest_s = sync.config.sync.reduce_timeout_s = 0.1
    sync.config.sync.record_ttl_s = 0.5
    sync.resync("φ hash of round 5 disagrees")
    kinds = [kind for kind, _ in events]
    assert kinds == ["resync", "resync_failed", "run_over"]
    assert sync.progress.step == sync.config.run.steps  # it ends as done, its final evaluation due


def test_a_peer_back_in_the_swarm_awaits_the_parts_of_the_round_it_runs():
    """A peer that resynced or caught up opened its newest slot rounds ago; a member's part for the round
    it runs waits for its slot instead of being refused as too far ahead (the returning peer's refusals)."""
    slots = OwnerSlots()
    slots.open(Slot("g", 1, 0, frozenset({"a", "x"}), (0, 4), None, deadline=0.0))
    slots.reach("g", 4)  # it caught up round 2, resynced to round 4 and agreed round 4's manifest
    waiter = threading.Thread(target=lambda: found.append(slots.wait_slot("g", 4, timeout=WAIT_S)))
    found = []
    waiter.start()
    opened = slots.open(Slot("g", 4, 0, frozenset({"a", "x"}), (0, 4), None, deadline=0.0))
    waiter.join(WAIT_S)
    assert found == [opened]
    with pytest.raises(ContributionRejected, match="too far ahead"):  # beyond the overlap's reach: still refused
        slots.wait_slot("g", 7, timeout=WAIT_S)
