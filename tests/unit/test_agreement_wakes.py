"""Agreement without polling (transport.wakeups): peers whose slow poll never comes within the test
(an hour) still settle every round, because each announcement and the manifest wake the peers that
wait on them; and the DHT reads a round costs a peer stay within a bound of the design: a look per
wake (each other peer's announcement, the manifest) and a few of its own, not one per 50 ms. An
announcement ahead reads no records; a φ vote is posted to the due peers, the members and the
coordinator; a round's announcements are stored only where a post cannot reach (Decision 34), and
reach the peers already known while a fresh read of the records is held (Decision 42); so is its
manifest, posted to the members, the other due peers and the coordinator (Decision 59)."""

from __future__ import annotations

import json
import threading
from collections import Counter

from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import VOTE, RoundPosts
from lowcomm.transport.signing import Signer
from lowcomm.transport.wakeups import Wakes, Wakeups
from unit.test_who_counts import MemoryControl

NEVER_S = 3600.0  # no poll and no deadline comes within the test
WAIT_S = 60.0  # a bound only a lost wake reaches; never asserted as a duration
SYNC = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S)


class CountedControl(MemoryControl):
    """Counts the reads a peer makes (each would be a DHT get)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = Counter()

    def announcers(self, group, round_):
        self.reads["announce"] += 1
        return super().announcers(group, round_)

    def live_peers(self):
        self.reads["peers"] += 1
        return super().live_peers()

    def manifests(self, group, round_):
        self.reads["manifest"] += 1
        return super().manifests(group, round_)


class MemorySender:
    """Delivers a wake straight to the Wakeups of the peer at that endpoint."""

    def __init__(self, by_endpoint: dict[str, Wakeups]):
        self.by_endpoint = by_endpoint

    def wake(self, endpoints, group, round_):
        for endpoint in endpoints:
            self.by_endpoint[endpoint].notify(group, round_)


def agree_all(ids: list[str], round_: int, previous: list[str] | None):
    store, by_endpoint = {}, {f"{p}:1": Wakeups() for p in ids}
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=round_) for p in ids}
    controls = [CountedControl(p, store, live) for p in ids]
    agreements = [ManifestAgreement(c, SYNC, f"{p}:1", quorum=True,
                                    wakes=Wakes(by_endpoint[f"{p}:1"], MemorySender(by_endpoint), poll_s=NEVER_S))
                  for p, c in zip(ids, controls)]
    if previous is not None:
        for agreement in agreements:
            agreement.learn("0-0", round_ - 1, previous)
    results = [None] * len(ids)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, agreements[i].agree("0-0", round_, 1, "fp32")))
               for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results, controls


def test_a_round_settles_on_wakes_alone_with_a_bounded_number_of_reads():
    ids = ["a", "b", "c", "d"]
    for previous in (None, ids):  # the run's first round, and a round after one with the same members
        results, controls = agree_all(ids, 5, previous)
        assert all(m is not None and m.leader == "a" and m.members == ids for m in results)
        for control in controls:  # 2 per look of the gather (one per wake), the quorum check's 2, a few manifest reads
            assert sum(control.reads.values()) <= 2 * len(ids) + 6, control.reads


class RecordingSender:
    """Remembers whom each wake went to."""

    def __init__(self):
        self.woken: list[set[str]] = []

    def wake(self, endpoints, group, round_):
        self.woken.append(set(endpoints))


def test_an_announcement_ahead_goes_to_the_records_last_read_and_reads_none():
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ("a", "b")}
    control, sender = CountedControl("a", {}, live), RecordingSender()
    # a poll of 0: every look that may read the records reads them again
    agreement = ManifestAgreement(control, SYNC, "a:1", wakes=Wakes(Wakeups(), sender, poll_s=0.0))
    agreement.announce("0-0", 5)
    live["c"] = PeerRecord("c", "c:1", state="training", round=5)  # joined since that read
    agreement.announce("0-0", 6, ahead=True)
    assert control.reads["peers"] == 1 and sender.woken == [{"b:1"}, {"b:1"}]
    # the round's own announcement goes to b at once (no read before it: Decision 42), then reads them
    # again: c hears of it
    agreement.announce("0-0", 6)
    assert control.reads["peers"] == 2 and sender.woken[-2:] == [{"b:1"}, {"c:1"}]


class PostRecorder(RecordingSender):
    """Remembers whom each post went to, and what it carried; ``fail``: every post is lost (on_failed runs)."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.posted: list[tuple[set[str], str, dict]] = []
        self.fail = fail

    def send(self, endpoints, request, on_failed=None):
        self.posted.append((set(endpoints), request.kind, json.loads(request.value)))
        if self.fail and endpoints and on_failed is not None:
            on_failed()


def posting_peer(live: dict, store: dict, fail: bool = False, client_mode: bool = False):
    signer = Signer.generate()
    me = signer.peer_id
    live[me] = PeerRecord(me, "me:1", state="training", round=5, client_mode=client_mode)
    sender = PostRecorder(fail)
    agreement = ManifestAgreement(CountedControl(me, store, live), SYNC, "me:1", client_mode=client_mode,
                                  wakes=Wakes(Wakeups(), sender, NEVER_S, posts=RoundPosts("run"), signer=signer))
    return agreement, sender, me


def test_a_vote_is_posted_to_the_due_peers_and_the_coordinator_and_stored_only_where_a_post_cannot_reach():
    live = {"b": PeerRecord("b", "b:1", state="training", round=5),
            "coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "gone": PeerRecord("gone", "gone:1", state="leaving", round=5)}
    store = {}
    agreement, sender, me = posting_peer(live, store)
    agreement.publish_vote("0-0", 5, "h5", 60)
    assert sender.posted == [({"b:1", "coord:1"}, VOTE, {"peer_id": me, "hash": "h5"})]
    assert ("phi", "0-0", 5) not in store  # a peer that joined since pulls it from this one (Decision 39)
    assert agreement.reads.votes("0-0", 5, {me}) == {me: "h5"}  # its own vote, kept among its posts
    lost, _, lost_me = posting_peer(dict(live), store, fail=True)  # its post does not arrive: stored
    lost.publish_vote("0-0", 6, "h6", 60)
    assert store[("phi", "0-0", 6)] == {lost_me: "h6"}
    client, _, client_me = posting_peer(dict(live), store, client_mode=True)  # nobody can dial it to pull it
    client.publish_vote("0-0", 7, "h7", 60)
    assert store[("phi", "0-0", 7)] == {client_me: "h7"}
    alone, _, alone_me = posting_peer({"b": live["b"]}, store)  # no coordinator: a download's check reads them
    alone.publish_vote("0-0", 8, "h8", 60)
    assert store[("phi", "0-0", 8)] == {alone_me: "h8"}


def test_a_vote_goes_to_the_members_of_the_manifest_followed_too():
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator")}
    agreement, sender, me = posting_peer(live, {})
    agreement.learn("0-0", 5, [me, "new"], {me: "me:1", "new": "new:1"})  # a member not in the records read yet
    agreement.publish_vote("0-0", 5, "h5", 60)
    assert sender.posted[-1][0] == {"new:1", "coord:1"}


def test_a_reached_round_is_announced_by_post_and_stored_only_where_a_post_cannot_reach():
    live = {"b": PeerRecord("b", "b:1", state="training", round=5)}
    store = {}
    agreement, sender, me = posting_peer(live, store)
    agreement.announce("0-0", 5)
    assert sender.posted[-1][:2] == ({"b:1"}, "announce") and ("announce", "0-0", 5) not in store
    lost, lost_sender, lost_me = posting_peer(dict(live), store, fail=True)  # its post does not arrive: stored
    lost.announce("0-0", 6)
    assert set(store[("announce", "0-0", 6)]) == {lost_me}
    client = PeerRecord("c", "c:1", state="training", round=5, client_mode=True)  # takes no posts: stored
    beside, _, beside_me = posting_peer({**live, "c": client}, store)
    beside.announce("0-0", 7)
    assert set(store[("announce", "0-0", 7)]) == {beside_me}
    agreement.withdraw("0-0", 8)  # a withdrawal is always stored
    assert set(store[("announce", "0-0", 8)]) == {me}


class StalledReads(CountedControl):
    """A control plane whose second read of the live records waits until ``released`` (a DHT node that
    does not answer holds a read that long)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reading, self.released = threading.Event(), threading.Event()

    def live_peers(self):
        if self.reads["peers"] >= 1:
            self.reading.set()
            assert self.released.wait(WAIT_S), "the read was never released"
        return super().live_peers()


class SignalingSender(RecordingSender):
    def __init__(self):
        super().__init__()
        self.sent = threading.Event()

    def wake(self, endpoints, group, round_):
        super().wake(endpoints, group, round_)
        self.sent.set()


def test_a_stalled_read_of_the_records_does_not_hold_back_the_rounds_announcement_to_the_known_peers():
    """Decision 42: a peer back from a cut made its peers' reads wait on its DHT node for seconds, and
    their announcements, sent after the read, reached each other too late: both took the round alone."""
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ("a", "b")}
    control, sender = StalledReads("a", {}, live), SignalingSender()
    agreement = ManifestAgreement(control, SYNC, "a:1", wakes=Wakes(Wakeups(), sender, poll_s=0.0))
    agreement.announce("0-0", 5, ahead=True)  # the first read: b is known
    sender.sent.clear()
    live["c"] = PeerRecord("c", "c:1", state="training", round=5)
    announcing = threading.Thread(target=agreement.announce, args=("0-0", 6), daemon=True)
    announcing.start()
    assert control.reading.wait(WAIT_S)  # the fresh read has begun and is held
    assert sender.sent.wait(WAIT_S) and sender.woken[-1] == {"b:1"}  # ... and b already has the announcement
    control.released.set()
    announcing.join(WAIT_S)
    assert not announcing.is_alive() and sender.woken[-1] == {"c:1"}  # c, which the read adds, too


def test_a_manifest_goes_to_the_members_due_peers_and_coordinator_stored_only_where_a_post_cannot_reach():
    live = {"b": PeerRecord("b", "b:1", state="training", round=5),
            "late": PeerRecord("late", "late:1", state="training", round=4),  # due, not announced: its look
            "coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "gone": PeerRecord("gone", "gone:1", state="leaving", round=5)}

    def publish(agreement, me, members_client_mode=False):
        announcers = {me: {"endpoint": "me:1", "client_mode": False},
                      "b": {"endpoint": "b:1", "client_mode": members_client_mode}}
        agreement._publish("0-0", 5, 1, "fp32", announcers, 60)

    store = {}
    agreement, sender, me = posting_peer(dict(live), store)
    publish(agreement, me)
    posted_to, kind, manifest = sender.posted[-1]
    assert (posted_to, kind) == ({"b:1", "late:1", "coord:1"}, "manifest") and manifest["members"] == sorted([me, "b"])
    assert ("manifest", "0-0", 5) not in store  # a peer it did not know of pulls it (round_reads.manifests)
    assert set(agreement.wakes.posted("manifest", "0-0", 5)) == {me}  # its own, kept among its posts
    lost, _, lost_me = posting_peer(dict(live), store, fail=True)  # its post does not arrive: stored
    publish(lost, lost_me)
    assert set(store.pop(("manifest", "0-0", 5))) == {lost_me}
    client_member, _, client_me = posting_peer(dict(live), store)  # a member nobody can post to
    publish(client_member, client_me, members_client_mode=True)
    assert set(store.pop(("manifest", "0-0", 5))) == {client_me}
    client_due = {**live, "late": PeerRecord("late", "late:1", state="training", round=4, client_mode=True)}
    beside, _, beside_me = posting_peer(client_due, store)  # a due peer that takes no posts
    publish(beside, beside_me)
    assert set(store.pop(("manifest", "0-0", 5))) == {beside_me}
