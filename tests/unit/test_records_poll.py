"""The live peer records under posts (collectives.round_reads, docs/round-protocol.md, Decision 53): rounds
that settle from posts share one read of the records for POSTED_RECORDS_POLL_S; a round that goes on
without a peer reads them fresh; a peer a round behind learns that the run moved on from a member's
posted announcement of the next round, not from that member's record; a peer that downloaded a
state announces its round ahead at once; and the shared read hides no peer that is back: a parked
joiner's first post, or a silent peer judged on that very read, has the records read again."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from torch import nn

from lowcomm.collectives.base import GroupKey, InProcessGroup, NotInRound
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.manifest_record import Manifest
from lowcomm.algorithms.diloco import DiLoCo, DilocoConfig
from lowcomm.algorithms.overlapped import Overlapped
from lowcomm.collectives import round_reads
from lowcomm.collectives.round_reads import POSTED_RECORDS_POLL_S
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import MANIFEST, RoundPosts
from lowcomm.transport.signing import Signer
from lowcomm.transport.wakeups import POSTED_DHT_POLL_S, Wakes, Wakeups
from unit.test_round_posts import Delivery, PostingControl

WAIT_S = 60.0  # a bound only a lost post reaches; never asserted as a duration
NEVER_S = 3600.0  # no poll and no deadline comes within the test
GROUP = "0-0"


@pytest.fixture(scope="module")
def signers():
    return sorted((Signer.generate() for _ in range(4)), key=lambda s: s.peer_id)


def swarm(signers, sync: SyncConfig, poll_s: float = NEVER_S, dht_poll_s: float = NEVER_S, live=None):
    """One agreement per signer, posting to each other (Delivery), over one shared store and records."""
    ids = [s.peer_id for s in signers]
    boards = {f"{p}:1": (RoundPosts("run"), Wakeups()) for p in ids}
    delivery = Delivery(boards)
    store = {}
    live = live if live is not None else {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ids}
    events = {p: [] for p in ids}
    controls = {s.peer_id: PostingControl(s.peer_id, store, live) for s in signers}
    agreements = {s.peer_id: ManifestAgreement(
        controls[s.peer_id], sync, f"{s.peer_id}:1", quorum=True,
        wakes=Wakes(boards[f"{s.peer_id}:1"][1], delivery, poll_s=poll_s, posts=boards[f"{s.peer_id}:1"][0],
                    signer=s, dht_poll_s=dht_poll_s),
        on_event=lambda kind, p=s.peer_id, **f: events[p].append((kind, f))) for s in signers}
    return ids, agreements, controls, store, events


def agree_all(agreements: dict, round_: int) -> dict:
    results = {}

    def agree(p):
        results[p] = agreements[p].agree(GROUP, round_, 1, "fp32").members
    threads = [threading.Thread(target=agree, args=(p,)) for p in agreements]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results


def test_rounds_that_settle_from_posts_share_one_read_of_the_records(signers, monkeypatch):
    sync = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S)
    ids, agreements, controls, _, _ = swarm(signers, sync, poll_s=0.05, dht_poll_s=POSTED_DHT_POLL_S)
    for agreement in agreements.values():
        agreement.learn(GROUP, 4, ids)
    later = [0.0]  # the records' clock, moved on between the rounds: past the DHT's poll, short of the records'
    monkeypatch.setattr(round_reads, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + later[0]))
    for round_ in (5, 6):
        assert agree_all(agreements, round_) == {p: ids for p in ids}
        later[0] += (POSTED_DHT_POLL_S + POSTED_RECORDS_POLL_S) / 2
    for control in controls.values():
        assert control.reads["peers"] == 1, control.reads


def test_a_round_that_goes_on_without_a_peer_reads_the_records_fresh(signers):
    # two previous members are gone (their records too, after the first read); b announces late
    sync = SyncConfig(announce_s=4.0, manifest_s=NEVER_S)
    ids, agreements, controls, _, events = swarm(signers, sync, poll_s=0.05, dht_poll_s=0.2)
    a, b, c, d = ids
    for agreement in agreements.values():
        agreement.learn(GROUP, 4, ids)
        assert set(agreement.reads.live()) == set(ids)  # the records as they were: all four training
    for gone in (c, d):
        del controls[a].live[gone]
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(members=agreements[a].agree(GROUP, 5, 1, "fp32").members))
    thread.start()
    deadline = time.monotonic() + WAIT_S  # b is late: it announces once a polled the DHT 3 times (0.2 s apart)
    while controls[a].reads["announce"] < 3 and time.monotonic() < deadline:
        thread.join(0.05)
    agreements[b].announce(GROUP, 5)
    thread.join(WAIT_S)
    assert outcome == {"members": [a, b]}
    # a read them once more at its gather's deadline (and, on a host slow enough, again for the quorum),
    # not at every poll of the DHT (0.2 s) before it; the quorum counted that read (2 of 2 live previous
    # members, not 2 of 4)
    assert 2 <= controls[a].reads["peers"] <= 3, controls[a].reads
    assert not [f for kind, f in events[a] if kind == "timeout" and f.get("stage") == "quorum"]


def left_out(agreement: ManifestAgreement, round_: int) -> dict:
    """What ``agreement.agree(round_)`` ends with, on a thread of its own (bounded by WAIT_S): the members of
    the manifest it is not in ({"not_in_round": members}), or {} if it ended otherwise or not at all."""
    outcome = {}

    def agree():
        try:
            agreement.agree(GROUP, round_, 1, "fp32")
        except NotInRound as e:
            outcome["not_in_round"] = e.manifest.members
    thread = threading.Thread(target=agree)
    thread.start()
    thread.join(WAIT_S)
    return dict(outcome)


def test_a_peer_a_round_behind_learns_it_from_a_members_posted_announcement_of_the_next_round(signers):
    sync = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S)
    ids, agreements, controls, store, events = swarm(signers, sync, poll_s=0.05)
    a, b, c, d = ids
    for agreement in agreements.values():
        agreement.learn(GROUP, 4, ids)
        agreement.reads.live()  # every record names round 5, and keeps naming it (it is not read again)
    # b led round 5 without a (a's posts never reached the others) and, having applied it, announces
    # round 6 ahead, to a too
    members = [b, c, d]
    controls[b].publish_manifest(GROUP, 5, Manifest("run", GROUP, 5, 1, b, members, {p: f"{p}:1" for p in members},
                                                    members, "fp32").to_dict(), NEVER_S)
    agreements[b].announce(GROUP, 6, ahead=True)
    # its announce_s and DHT poll never come: only b's post ends the wait
    assert left_out(agreements[a], 5) == {"not_in_round": members}
    assert not [f for kind, f in events[a] if kind == "timeout"]


def test_a_peer_no_post_reached_pulls_the_manifest_its_leader_posted_before_it_writes_its_own(signers):
    """Decision 59: a manifest reaches the DHT only where a post did not arrive, so a peer its leader did not
    know of (a joiner the members' records predate) finds it by pulling it from the lower candidates."""
    sync = SyncConfig(announce_s=0.3, manifest_s=NEVER_S)  # its wait for the others' announcements ends
    ids, agreements, controls, store, events = swarm(signers, sync, poll_s=0.05)
    a, b, c, d = ids
    for agreement in agreements.values():
        agreement.learn(GROUP, 4, ids)
    members = [b, c, d]  # b led round 5 without a, and posted its manifest to c and d only
    manifest = Manifest("run", GROUP, 5, 1, b, members, {p: f"{p}:1" for p in members}, members, "fp32")
    record = controls[b].manifest_record(manifest.to_dict())
    agreements[b].wakes.publish([f"{c}:1", f"{d}:1"], MANIFEST, GROUP, 5, record)
    assert left_out(agreements[a], 5) == {"not_in_round": members}
    assert not [key for key in store if key[0] == "manifest"]  # neither b's (posted only) nor one of a's
    assert not [f for kind, f in events[a] if kind == "timeout" and f.get("stage") == "quorum"]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_replica_that_downloaded_a_state_announces_its_round_ahead_at_once(overlap):
    """Members whose last read predates a joiner's record count it from that post (Decision 53)."""
    model = nn.Sequential(nn.Linear(4, 2))
    replica = DiLoCo(model, DilocoConfig(), InProcessGroup(1).replica(0), GroupKey("test"))
    if overlap:  # no manifest of round 6 to fetch: that round is dropped, round 7 is still announced
        replica = Overlapped(replica, manifest_of=lambda round_: None)
    assert replica.take_ahead() is None
    assert replica.enter(7) is not overlap
    assert replica.round == 7 and replica.take_ahead() == 7 and replica.take_ahead() is None


def test_a_post_from_a_peer_the_last_read_predates_has_the_records_read_again_once(signers, monkeypatch):
    sync = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S)
    ids, agreements, controls, _, _ = swarm(signers, sync, poll_s=0.05, dht_poll_s=POSTED_DHT_POLL_S)
    a, b, c, joiner = ids
    del controls[a].live[joiner]  # not yet in the records when a read them
    member = agreements[a]
    assert set(member.reads.live()) == {a, b, c}
    later = [0.0]  # the records' clock, moved past the DHT's poll, short of the records'
    monkeypatch.setattr(round_reads, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + later[0]))
    later[0] = (POSTED_DHT_POLL_S + POSTED_RECORDS_POLL_S) / 2
    assert set(member.reads.live()) == {a, b, c} and controls[a].reads["peers"] == 1  # nothing new posted
    controls[a].live[joiner] = PeerRecord(joiner, f"{joiner}:1", state="training", round=6)
    agreements[joiner].announce(GROUP, 6, ahead=True)  # just downloaded a state (Decision 53)
    later[0] += POSTED_DHT_POLL_S
    assert set(member.reads.live()) == set(ids) and controls[a].reads["peers"] == 2
    later[0] += POSTED_DHT_POLL_S
    assert set(member.reads.live()) == set(ids) and controls[a].reads["peers"] == 2  # once, not at every poll


def test_a_silent_peer_whose_miss_was_judged_on_the_shared_read_has_its_record_read_again(signers, monkeypatch):
    # d misses round 5; its record then names round 6 (it caught the round up), which the read the
    # others' looks share cannot show: round 6's gather reads the records again and waits for d
    sync = SyncConfig(announce_s=0.5, manifest_s=NEVER_S)
    ids, agreements, controls, _, events = swarm(signers, sync, poll_s=0.05, dht_poll_s=POSTED_DHT_POLL_S)
    a, b, c, d = ids
    for agreement in agreements.values():
        agreement.learn(GROUP, 4, ids)
    later = [0.0]  # the records' clock, moved past the DHT's poll between the rounds, short of the records'
    monkeypatch.setattr(round_reads, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + later[0]))
    members = {p: agreements[p] for p in (a, b, c)}
    assert agree_all(members, 5) == {p: [a, b, c] for p in (a, b, c)}
    reads = controls[a].reads["peers"]
    controls[a].live[d] = PeerRecord(d, f"{d}:1", state="training", round=6)
    later[0] += POSTED_DHT_POLL_S * 1.5
    assert agree_all(members, 6) == {p: [a, b, c] for p in (a, b, c)}
    for p in (a, b, c):
        missing = [f["missing"] for kind, f in events[p] if kind == "timeout" and f.get("stage") == "announce"]
        assert missing == [[d], [d]], (p, events[p])
    assert controls[a].reads["peers"] == reads + 1  # once, for round 6's gather


def test_a_post_from_a_peer_the_last_read_held_parked_has_the_records_read_again(signers, monkeypatch):
    # a parked joiner is in the read, but not as a peer to expect: its first post (released, it downloaded
    # a state) has the records read again, so this peer's own posts go to it too
    sync = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S)
    ids, agreements, controls, _, _ = swarm(signers, sync, poll_s=0.05, dht_poll_s=POSTED_DHT_POLL_S)
    a, b, c, joiner = ids
    controls[a].live[joiner] = PeerRecord(joiner, f"{joiner}:1", state="parked", round=0)
    member = agreements[a]
    assert member.reads.live()[joiner].state == "parked"
    later = [0.0]
    monkeypatch.setattr(round_reads, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + later[0]))
    controls[a].live[joiner] = PeerRecord(joiner, f"{joiner}:1", state="training", round=6)
    agreements[joiner].announce(GROUP, 6, ahead=True)
    later[0] += POSTED_DHT_POLL_S
    assert member.reads.live()[joiner].state == "training" and controls[a].reads["peers"] == 2
