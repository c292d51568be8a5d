"""Round posts (transport.round_posts): a writer's announcement, manifest or φ vote pushed to the peers
waiting on it, signed by the writer's key. Forged, relabelled, oversized, malformed and foreign posts are
refused through a real gRPC server (each a `reject`); replayed and reordered posts never move an
announcement back; the posts held are bounded; four peers agree on a round from posts alone,
reading no announcement from the DHT; and posted votes spare the drift check its DHT reads."""

from __future__ import annotations

import json
import threading
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest

from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.proto import wire_pb2
from lowcomm.transport import round_posts
from lowcomm.transport.control import PeerRecord
from lowcomm.collectives.round_reads import RoundReads
from lowcomm.transport.round_posts import (ANNOUNCE, MANIFEST, VOTE, PostRefused, RoundPosts, merge_announcements,
                                           post_request)
from lowcomm.transport.signing import Signer, sign_message
from lowcomm.transport.wakeups import Wakes, Wakeups
from lowcomm.transport.wire import Traffic
from rpc_fuzz import WatchedService, served
from unit.test_who_counts import MemoryControl

TIMEOUT_S = 20.0  # a bound only a hung server reaches; never asserted as a duration
WAIT_S = 60.0
NEVER_S = 3600.0  # no poll and no deadline comes within the test


@pytest.fixture(scope="module")
def signers():
    return [Signer.generate() for _ in range(4)]


def record(signer: Signer, **info) -> dict:
    return {"peer_id": signer.peer_id, "endpoint": "10.0.0.1:5000", "client_mode": False, **info}


def test_a_signed_post_is_kept_and_forged_or_foreign_ones_are_refused(signers, monkeypatch):
    monkeypatch.setattr(round_posts, "MAX_VALUE_BYTES", 4096)  # below this test server's message limit
    alice, mallory = signers[0], signers[1]
    service = WatchedService("posted-peer")
    service.posts = RoundPosts("run")
    with served(service) as (stub, _):
        good = post_request(alice, "run", ANNOUNCE, "0-0", 3, record(alice))
        stub.Wake(good, timeout=TIMEOUT_S)
        assert service.posts.records(ANNOUNCE, "0-0", 3) == {alice.peer_id: record(alice)}

        def forged(edit):
            request = post_request(alice, "run", ANNOUNCE, "0-0", 4, record(alice))
            edit(request)
            return request

        relabelled = forged(lambda r: setattr(r, "round", 9))  # signed for round 4
        not_alices = post_request(mallory, "run", ANNOUNCE, "0-0", 4, record(alice))  # mallory signs alice's record
        claims_alice = forged(lambda r: (setattr(r, "sender_key", mallory.key)))
        other_run = post_request(alice, "other-run", ANNOUNCE, "0-0", 4, record(alice))
        unsigned = forged(lambda r: r.ClearField("signature"))
        huge = post_request(alice, "run", MANIFEST, "0-0", 4,
                            {"peer_id": alice.peer_id, "manifest": "x" * round_posts.MAX_VALUE_BYTES})
        unknown = post_request(alice, "run", "gossip", "0-0", 4, record(alice))
        not_json = forged(lambda r: setattr(r, "value", b"\xff{"))  # the digest no longer matches either
        list_value = post_request(alice, "run", ANNOUNCE, "0-0", 4, record(alice))
        list_value.value = b"[1]"
        sign_message(alice, round_posts.SIGNED_KIND, list_value)  # well signed, but not a record
        cases = {"relabelled": (relabelled, "bad signature"), "not_alices": (not_alices, "not its sender's"),
                 "claims_alice": (claims_alice, "not the key of"), "other_run": (other_run, "not this run"),
                 "unsigned": (unsigned, "not signed"), "huge": (huge, "bytes (at most"),
                 "unknown": (unknown, "unknown kind"), "not_json": (not_json, "bad signature"),
                 "list_value": (list_value, "not its sender's")}
        for name, (request, why) in cases.items():
            errors = service.errors
            with pytest.raises(grpc.RpcError) as caught:
                stub.Wake(request, timeout=TIMEOUT_S)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert why in caught.value.details(), (name, caught.value.details())
            assert service.errors == errors + 1 and service.events[-1]["method"] == "Wake", name
            service.settle()
        assert service.posts.records(ANNOUNCE, "0-0", 4) == {} and service.posts.records(MANIFEST, "0-0", 4) == {}

        woken = []  # a post for the round a waiter watches ends its wait, as a bare wake does
        with service.wakeups.watching("0-0", 5):
            waiter = threading.Thread(target=lambda: woken.append(service.wakeups.wait("0-0", 5, WAIT_S)))
            waiter.start()
            stub.Wake(post_request(alice, "run", ANNOUNCE, "0-0", 5, record(alice)), timeout=TIMEOUT_S)
            waiter.join(WAIT_S + 5)
        assert woken == [True]


def test_a_peer_without_posts_refuses_them(signers):
    service = WatchedService("no-posts")
    with served(service) as (stub, _):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Wake(post_request(signers[0], "run", ANNOUNCE, "0-0", 1, record(signers[0])), timeout=TIMEOUT_S)
        assert "takes no round posts" in caught.value.details() and service.errors == 1


def test_replayed_or_reordered_announcements_never_move_back(signers):
    alice = signers[0]
    posts = RoundPosts("run")
    reached, ahead, gone = record(alice), record(alice, ahead=True), {"peer_id": alice.peer_id, "gone": True}
    for request in [post_request(alice, "run", ANNOUNCE, "0-0", 2, r) for r in (ahead, reached, ahead)]:
        posts.accept(request)
    assert posts.records(ANNOUNCE, "0-0", 2) == {alice.peer_id: reached}
    posts.accept(post_request(alice, "run", ANNOUNCE, "0-0", 2, gone))
    posts.accept(post_request(alice, "run", ANNOUNCE, "0-0", 2, reached))  # a replay after the withdrawal
    assert merge_announcements(posts.records(ANNOUNCE, "0-0", 2)) == {}
    # the DHT's older copy does not bring a withdrawn announcement back, nor an ahead one a reached
    assert merge_announcements({alice.peer_id: reached}, posts.records(ANNOUNCE, "0-0", 2)) == {}
    assert merge_announcements({alice.peer_id: ahead}, {alice.peer_id: reached}) == {alice.peer_id: reached}


def test_the_posts_held_are_bounded(signers, monkeypatch):
    monkeypatch.setattr(round_posts, "MAX_ROUNDS", 3)
    monkeypatch.setattr(round_posts, "MAX_POSTS_PER_ROUND", 2)
    posts = RoundPosts("run")
    for round_ in range(5):
        posts.add(ANNOUNCE, "0-0", round_, signers[0].peer_id, record(signers[0]))
    assert [r for r in range(5) if posts.records(ANNOUNCE, "0-0", r)] == [2, 3, 4]
    posts.add(ANNOUNCE, "0-0", 4, signers[1].peer_id, record(signers[1]))
    with pytest.raises(PostRefused, match="holds 2 posts"):
        posts.add(ANNOUNCE, "0-0", 4, signers[2].peer_id, record(signers[2]))
    posts.add(ANNOUNCE, "0-0", 4, signers[1].peer_id, record(signers[1], ahead=True))  # a known writer: no error


class PostingControl(MemoryControl):
    """The control plane's records as the real one shapes them, counting the reads (each a DHT get)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = Counter()

    def announce(self, group, round_, info, ttl):
        self._put(("announce", group, round_), self.record(info))

    def announcers(self, group, round_):
        self.reads["announce"] += 1
        return super().announcers(group, round_)

    def live_peers(self):
        self.reads["peers"] += 1
        return super().live_peers()

    def manifest_record(self, manifest):
        return self.record({"manifest": json.dumps(manifest)})

    def publish_manifest(self, group, round_, manifest, ttl):
        self._put(("manifest", group, round_), self.manifest_record(manifest))

    def manifests(self, group, round_):
        self.reads["manifest"] += 1
        return self.parse_manifests(super().manifests(group, round_))

    def parse_manifests(self, records):
        return {w: json.loads(v["manifest"]) for w, v in records.items()}


class Delivery:
    """A WakeSender that hands each post to the receiver's RoundPosts and Wakeups (what the service does),
    and answers a pull (GetPost) with the peer's own post, as the service does."""

    def __init__(self, boards: dict[str, tuple[RoundPosts, Wakeups]]):
        self.boards = boards
        self.channels, self.traffic = self, Traffic(None)

    def stub(self, endpoint):
        posts = self.boards[endpoint][0]
        return SimpleNamespace(GetPost=lambda request, timeout: posts.own(request.kind, request.group, request.round)
                               or wire_pb2.WakeRequest())

    def send(self, endpoints, request, on_failed=None):
        for endpoint in endpoints:
            posts, wakeups = self.boards[endpoint]
            group, round_ = posts.accept(request)
            wakeups.notify(group, round_)

    def wake(self, endpoints, group, round_):
        raise AssertionError("with posts, every wake carries its record")


def test_four_peers_agree_from_posts_alone(signers):
    ids = sorted(s.peer_id for s in signers)
    by_id = {s.peer_id: s for s in signers}
    boards = {f"{p}:1": (RoundPosts("run"), Wakeups()) for p in [*ids, "coordinator"]}
    delivery = Delivery(boards)
    store, live = {}, {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ids}
    live["coordinator"] = PeerRecord("coordinator", "coordinator:1", state="coordinator")
    controls = [PostingControl(p, store, live) for p in ids]
    sync = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S)
    agreements = [ManifestAgreement(c, sync, f"{p}:1", quorum=True,
                                    wakes=Wakes(boards[f"{p}:1"][1], delivery, poll_s=NEVER_S,
                                                posts=boards[f"{p}:1"][0], signer=by_id[p], dht_poll_s=NEVER_S))
                  for p, c in zip(ids, controls)]
    for agreement in agreements:
        agreement.learn("0-0", 4, ids)
    results = [None] * len(ids)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, agreements[i].agree("0-0", 5, 1, "fp32")))
               for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert all(m is not None and m.leader == ids[0] and m.members == ids for m in results)
    # one read of the live records each, nothing else from the DHT: not even the leader's look before it
    # writes, as every due peer reached the round and it is the first candidate (nobody can have written)
    for p, control in zip(ids, controls):
        assert control.reads == Counter(peers=1), (p, control.reads)
    # every post arrived: neither the announcements (Decision 34) nor the manifest (Decision 59) went to the DHT
    assert store == {}
    # the coordinator follows the round from the leader's post (its DHT read waits for the poll)
    follower_control = PostingControl("coordinator", store, live)
    follower = ManifestAgreement(follower_control, sync, "", wakes=Wakes(None, None, NEVER_S,
                                                                           posts=boards["coordinator:1"][0]))
    assert follower.read("0-0", 5, fresh=False).members == ids
    assert follower_control.reads == Counter()


def test_an_announcement_is_posted_not_stored_unless_a_due_peer_takes_no_posts(signers):
    ids = sorted(s.peer_id for s in signers[:2])
    by_id = {s.peer_id: s for s in signers}
    boards = {f"{p}:1": (RoundPosts("run"), Wakeups()) for p in ids}
    store, live = {}, {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ids}
    me, other = ids
    wakes = Wakes(boards[f"{me}:1"][1], Delivery(boards), posts=boards[f"{me}:1"][0], signer=by_id[me])
    agreement = ManifestAgreement(PostingControl(me, store, live), SyncConfig(), f"{me}:1", wakes=wakes)
    agreement.announce("0-0", 6, ahead=True)
    assert ("announce", "0-0", 6) not in store  # posted only: the round's leader hears of it so
    assert boards[f"{other}:1"][0].records(ANNOUNCE, "0-0", 6)[me]["ahead"] is True
    agreement.announce("0-0", 6)  # reaching the round: posted only too (Decision 34)
    assert ("announce", "0-0", 6) not in store
    assert boards[f"{other}:1"][0].records(ANNOUNCE, "0-0", 6)[me].get("ahead") is None
    live[other] = PeerRecord(other, f"{other}:1", state="training", round=5, client_mode=True)
    agreement.reads._records = (float("-inf"), {})  # read the records again
    agreement.announce("0-0", 7, ahead=True)  # a due peer others cannot post to: the DHT holds it too
    assert store[("announce", "0-0", 7)][me]["ahead"] is True


def test_a_post_from_a_peer_the_run_does_not_admit_is_refused_at_the_door(signers):
    alice, outsider = signers[0], signers[1]
    posts = RoundPosts("run", admits=lambda peer_id: peer_id != outsider.peer_id)
    with pytest.raises(PostRefused, match=f"from {outsider.peer_id}, a peer the run does not admit"):
        posts.accept(post_request(outsider, "run", ANNOUNCE, "0-0", 1, record(outsider)))
    posts.accept(post_request(alice, "run", ANNOUNCE, "0-0", 1, record(alice)))
    assert list(posts.records(ANNOUNCE, "0-0", 1)) == [alice.peer_id]


class CountedControl(MemoryControl):
    def __init__(self, *args):
        super().__init__(*args)
        self.vote_reads = 0

    def phi_hashes(self, group, round_):
        self.vote_reads += 1
        return super().phi_hashes(group, round_)


def test_posted_votes_are_read_without_the_dht_and_a_missing_one_from_it(signers):
    alice, bob = signers[:2]
    posts, store = RoundPosts("run"), {}
    for phi_hash in ("h1", "h2"):  # the first vote a writer posted for a round stays
        posts.accept(post_request(alice, "run", VOTE, "0-0", 3, {"peer_id": alice.peer_id, "hash": phi_hash}))
    MemoryControl(bob.peer_id, store, {}).publish_phi_hash("0-0", 3, "h1", 60)  # bob's post was lost
    control = CountedControl("me", store, {})
    reads = RoundReads(control, Wakes(None, None, NEVER_S, posts=posts, dht_poll_s=NEVER_S))
    assert reads.votes("0-0", 3, {alice.peer_id}) == {alice.peer_id: "h1"} and control.vote_reads == 0
    assert reads.votes("0-0", 3, {alice.peer_id, bob.peer_id}) == {alice.peer_id: "h1"}  # the DHT at its poll
    assert control.vote_reads == 0
    both = reads.votes("0-0", 3, {alice.peer_id, bob.peer_id}, fresh=True)  # the drift check's last look
    assert both == {alice.peer_id: "h1", bob.peer_id: "h1"} and control.vote_reads == 1
    # without posts (a peer nobody can dial), every look reads the DHT
    polling = RoundReads(control, Wakes(None, None, NEVER_S))
    assert polling.votes("0-0", 3, {bob.peer_id}) == {bob.peer_id: "h1"} and control.vote_reads == 2
