"""Votes pulled from their voters (transport.post_pulls, `PeerService.GetPost`; Decision 39): a reader
that no post reached asks the voters it misses for their own signed votes over real gRPC servers and
reads no DHT once they are in; a forged, relabelled, foreign or empty answer, and a dead voter, leave
the voter missing (the DHT is read for it); a hostile request is answered empty, or refused and
counted when malformed. A round's manifest, posted and not stored (Decision 59), is pulled the same
way by a fresh look from the lowest-id writers that could lead the round."""

from __future__ import annotations

import contextlib
import json

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowcomm.collectives.round_reads import RoundReads
from lowcomm.proto import wire_pb2, wire_pb2_grpc
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import ANNOUNCE, MANIFEST, VOTE, RoundPosts, post_request
from lowcomm.transport.signing import Signer
from lowcomm.transport.wakeups import MAX_GROUP_CHARS, Wakes, WakeSender, Wakeups
from lowcomm.transport.wire import Channels, Traffic
from rpc_fuzz import WatchedService, fuzz_settings, served
from unit.test_round_posts import CountedControl, PostingControl

NEVER_S = 3600.0  # no poll comes within the test: a look pulls only when it is `fresh`


@pytest.fixture(scope="module")
def signers():
    return [Signer.generate() for _ in range(3)]


def voter(signer: Signer, stack: contextlib.ExitStack, votes=(), service_cls=WatchedService):
    """A peer serving its posts, having published ``votes`` ((group, round, hash)); (service, endpoint)."""
    service = service_cls(signer.peer_id)
    service.posts = RoundPosts("run")
    wakes = Wakes(Wakeups(), None, NEVER_S, posts=service.posts, signer=signer)
    for group, round_, phi_hash in votes:
        wakes.publish([], VOTE, group, round_, {"peer_id": signer.peer_id, "hash": phi_hash})
    _, endpoint = stack.enter_context(served(service))
    return service, endpoint


def reader(live: dict[str, PeerRecord], store: dict):
    """A peer that joined after the votes were posted: its RoundReads, posts and DHT (counting reads)."""
    channels, traffic = Channels(1 << 20), Traffic(None)
    posts = RoundPosts("run")
    control = CountedControl("reader", store, live)
    wakes = Wakes(Wakeups(), WakeSender(channels, traffic), NEVER_S, posts=posts, signer=Signer.generate(),
                  dht_poll_s=NEVER_S)
    return RoundReads(control, wakes), control, posts, channels


def test_a_missing_vote_is_pulled_from_its_voter_and_the_dht_is_not_read(signers):
    alice, bob = signers[:2]
    with contextlib.ExitStack() as stack:
        _, a_end = voter(alice, stack, [("0-0", 3, "h3")])
        _, b_end = voter(bob, stack, [("0-0", 3, "h3"), ("0-0", 4, "h4")])
        live = {alice.peer_id: PeerRecord(alice.peer_id, a_end, state="training"),
                bob.peer_id: PeerRecord(bob.peer_id, b_end, state="training")}
        reads, control, posts, channels = reader(live, {})
        stack.callback(channels.close)
        voters = {alice.peer_id, bob.peer_id}
        assert reads.votes("0-0", 3, voters) == {}  # before its poll: neither pulled nor read
        assert reads.votes("0-0", 3, voters, fresh=True) == {alice.peer_id: "h3", bob.peer_id: "h3"}
        assert control.vote_reads == 0
        assert reads.votes("0-0", 3, voters) == {alice.peer_id: "h3", bob.peer_id: "h3"}  # now among the posts
        assert set(posts.records(VOTE, "0-0", 4)) == set()  # only the round asked for


def test_an_answer_not_of_the_voter_asked_or_not_of_the_round_asked_is_refused(signers):
    alice, mallory = signers[0], signers[2]
    forged = {"post": None}

    class Lying(WatchedService):
        def GetPost(self, request, context):
            return forged["post"]

    with contextlib.ExitStack() as stack:
        liar, l_end = voter(alice, stack, service_cls=Lying)  # answers as alice's endpoint
        live = {alice.peer_id: PeerRecord(alice.peer_id, l_end, state="training")}
        store = {("phi", "0-0", 3): {alice.peer_id: "stored"}}  # alice's vote stored where its post failed
        for post in (post_request(mallory, "run", VOTE, "0-0", 3, {"peer_id": mallory.peer_id, "hash": "x"}),
                     post_request(alice, "run", VOTE, "0-0", 9, {"peer_id": alice.peer_id, "hash": "old"}),
                     post_request(alice, "run", ANNOUNCE, "0-0", 3, {"peer_id": alice.peer_id}),
                     post_request(alice, "other-run", VOTE, "0-0", 3, {"peer_id": alice.peer_id, "hash": "x"}),
                     wire_pb2.WakeRequest()):  # holds none
            forged["post"] = post
            reads, control, posts, channels = reader(live, store)
            stack.callback(channels.close)
            assert reads.votes("0-0", 3, {alice.peer_id}, fresh=True) == {alice.peer_id: "stored"}
            assert control.vote_reads == 1 and posts.records(VOTE, "0-0", 3) == {}
        # a post whose signature does not cover its record
        tampered = post_request(alice, "run", VOTE, "0-0", 3, {"peer_id": alice.peer_id, "hash": "h"})
        tampered.value = b'{"hash":"forged","peer_id":"' + alice.peer_id.encode() + b'"}'
        forged["post"] = tampered
        reads, control, posts, channels = reader(live, store)
        stack.callback(channels.close)
        assert reads.votes("0-0", 3, {alice.peer_id}, fresh=True) == {alice.peer_id: "stored"}
        assert posts.records(VOTE, "0-0", 3) == {}


def test_a_dead_voter_costs_one_timeout_and_the_dht_is_read_for_it(signers):
    alice = signers[0]
    live = {alice.peer_id: PeerRecord(alice.peer_id, "127.0.0.1:1", state="training")}  # nobody listens
    reads, control, posts, channels = reader(live, {("phi", "0-0", 3): {alice.peer_id: "h3"}})
    try:
        assert reads.votes("0-0", 3, {alice.peer_id}, fresh=True) == {alice.peer_id: "h3"}
        assert control.vote_reads == 1
    finally:
        channels.close()


def test_get_post_answers_only_its_own_posts_of_its_run_and_refuses_a_malformed_request(signers):
    alice, bob = signers[:2]
    with contextlib.ExitStack() as stack:
        service, endpoint = voter(alice, stack, [("0-0", 3, "h3")])
        service.posts.accept(post_request(bob, "run", VOTE, "0-0", 3, {"peer_id": bob.peer_id, "hash": "b"}))
        channel = grpc.insecure_channel(endpoint)
        stack.callback(channel.close)
        stub = wire_pb2_grpc.PeerStub(channel)
        own = stub.GetPost(wire_pb2.PostRequest(run="run", group="0-0", round=3, kind=VOTE), timeout=20)
        assert own.sender == alice.peer_id and own.round == 3  # its own, not bob's that it holds
        for other in (wire_pb2.PostRequest(run="other", group="0-0", round=3, kind=VOTE),
                      wire_pb2.PostRequest(run="run", group="0-0", round=4, kind=VOTE),
                      wire_pb2.PostRequest(run="run", group="0-0", round=3, kind=ANNOUNCE)):
            assert stub.GetPost(other, timeout=20) == wire_pb2.WakeRequest()
        for bad in (wire_pb2.PostRequest(run="run", group="0-0", round=3, kind="state"),
                    wire_pb2.PostRequest(run="run", group="x" * 300, round=3, kind=VOTE)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetPost(bad, timeout=20)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [e["method"] for e in service.events] == ["GetPost", "GetPost"]


def test_hostile_get_post_requests_are_answered_empty_or_refused(signers):
    alice = signers[0]
    with contextlib.ExitStack() as stack:
        service, endpoint = voter(alice, stack, [("0-0", 3, "h3")])
        channel = grpc.insecure_channel(endpoint)
        stack.callback(channel.close)
        stub = wire_pb2_grpc.PeerStub(channel)

        @fuzz_settings(120)
        @given(run=st.sampled_from(["run", "", "x" * 5000]) | st.text(max_size=64),
               group=st.sampled_from(["0-0", "x" * 5000, "a\x00b"]) | st.text(max_size=2 * MAX_GROUP_CHARS),
               round_=st.integers(0, 2**64 - 1), kind=st.sampled_from([VOTE, ANNOUNCE, "", "state"]))
        def check(run, group, round_, kind):
            errors = service.errors
            fine = len(group) <= MAX_GROUP_CHARS and group.isprintable() and kind in (VOTE, ANNOUNCE, "manifest")
            try:
                reply = stub.GetPost(wire_pb2.PostRequest(run=run, group=group, round=round_, kind=kind), timeout=20)
            except grpc.RpcError as e:
                assert not fine and e.code() == grpc.StatusCode.INVALID_ARGUMENT, (group, kind, e.details())
                assert service.errors == errors + 1 and service.events[-1]["method"] == "GetPost"
            else:
                assert fine, (group, kind)
                ours = (run, group, round_, kind) == ("run", "0-0", 3, VOTE)
                assert (reply.sender == alice.peer_id) if ours else reply == wire_pb2.WakeRequest()

        check()


def test_a_manifest_no_post_brought_is_pulled_from_the_lowest_writers_that_could_lead_and_a_dead_one_is_read(signers):
    low, mid, high = sorted(signers, key=lambda s: s.peer_id)
    with contextlib.ExitStack() as stack:
        ends = {}
        for signer in (low, mid, high):  # each wrote a manifest of round 3 (racing leaders)
            service, ends[signer.peer_id] = voter(signer, stack)
            manifest = json.dumps({"leader": signer.peer_id})
            Wakes(Wakeups(), None, NEVER_S, posts=service.posts, signer=signer).publish(
                [], MANIFEST, "0-0", 3, {"peer_id": signer.peer_id, "manifest": manifest})
        live = {p: PeerRecord(p, e, state="training") for p, e in ends.items()}

        def look(live, store=None, pull=False, fresh=True, posted=()):
            channels = Channels(1 << 20)
            stack.callback(channels.close)
            posts, control = RoundPosts("run"), PostingControl("reader", store or {}, live)
            for writer in posted:  # what a post brought here
                posts.accept(post_request(writer, "run", MANIFEST, "0-0", 3, {
                    "peer_id": writer.peer_id, "manifest": json.dumps({"leader": writer.peer_id})}))
            wakes = Wakes(Wakeups(), WakeSender(channels, Traffic(None)), NEVER_S, posts=posts,
                          signer=Signer.generate(), dht_poll_s=NEVER_S)
            return set(RoundReads(control, wakes).manifests("0-0", 3, fresh, pull)), control

        assert look(live, pull=None, fresh=False)[0] == set()  # not a fresh look: nothing asked
        assert look(live)[0] == set()  # nothing to pull from (pull False): the DHT alone
        assert look(live, pull=None)[0] == {low.peer_id, mid.peer_id, high.peer_id}  # anyone's counts
        assert look(live, pull=frozenset({mid.peer_id, high.peer_id}))[0] == {mid.peer_id, high.peer_id}
        # one lower than every posted one is asked; a higher one would not lead the round
        assert look(live, pull=None, posted=[mid])[0] == {low.peer_id, mid.peer_id}
        client = {**live, low.peer_id: PeerRecord(low.peer_id, ends[low.peer_id], state="training", client_mode=True)}
        assert look(client, pull=None)[0] == {mid.peer_id, high.peer_id}  # a client-mode peer cannot be dialled
        # a dead writer (nobody listens) costs its timeout; its manifest is read from the DHT, where it was stored
        dead = {**live, low.peer_id: PeerRecord(low.peer_id, "127.0.0.1:1", state="training")}
        stored = {("manifest", "0-0", 3): {low.peer_id: {"peer_id": low.peer_id,
                                                         "manifest": json.dumps({"leader": low.peer_id})}}}
        found, control = look(dead, stored, pull=frozenset({low.peer_id}))
        assert found == {low.peer_id} and control.reads["manifest"] == 1
