"""The coordinator's anchors pulled from its data plane (runtime.round_anchor, Decision 55): the follower
keeps each settled anchor as its own signed post and stores it in the DHT only while a peer record is
joining; a peer checking a downloaded state pulls the anchor of its round from the coordinator over a
real gRPC server and reads no DHT anchor; a forged answer is refused and the DHT's anchor counts instead;
a pushed anchor is refused.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from lowcomm.collectives.manifest import Manifest, ManifestAgreement
from lowcomm.config import RunConfig
from lowcomm.runtime.progress import Progress
from lowcomm.runtime.round_anchor import Anchor, RoundFollower, anchor_fields, publish_anchor
from lowcomm.runtime.state_sync import StateSync
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import ANCHOR, PostRefused, RoundPosts, post_request
from lowcomm.transport.signing import Signer
from lowcomm.transport.wakeups import Wakes, WakeSender, Wakeups
from lowcomm.transport.wire import Channels, Traffic
from rpc_fuzz import WatchedService, served
from unit.test_who_counts import SYNC, FakeReplica, MemoryControl

NEVER_S = 3600.0  # no DHT poll comes within the test


class CountedAnchors(MemoryControl):
    """The in-memory DHT, counting the reads of anchors."""

    anchor_reads = 0

    def anchors(self, group, round_):
        CountedAnchors.anchor_reads += 1
        return super().anchors(group, round_)


@pytest.fixture(autouse=True)
def _reads():
    CountedAnchors.anchor_reads = 0


def follower(coordinator: Signer, store: dict, live: dict, posts: RoundPosts, rounds: int) -> RoundFollower:
    """The coordinator's follower of a run whose peers a and b wrote the manifests and votes of ``rounds``."""
    control = CountedAnchors(coordinator.peer_id, store, live)

    def serve(anchor: Anchor) -> None:  # as runtime.coordinator's
        fields = {"peer_id": coordinator.peer_id, **anchor_fields(anchor)}
        posts.keep_own(post_request(coordinator, "run", ANCHOR, "0-0", anchor.round, fields))
    manifest = Manifest("run", "0-0", 0, 1, "a", ["a", "b"], {"a": "a:1", "b": "b:1"}, ["a", "b"], "fp32").to_dict()
    for round_ in range(rounds):
        MemoryControl("a", store, live).publish_manifest("0-0", round_, {**manifest, "round": round_}, 60)
        for peer in ("a", "b"):
            MemoryControl(peer, store, live).publish_phi_hash("0-0", round_ + 1, f"h{round_ + 1}", 60)
    return RoundFollower(control, ManifestAgreement(control, SYNC, ""), "0-0", settle_s=5.0, ttl=60, serve=serve)


def checker(coordinator: str, store: dict, live: dict, stack: contextlib.ExitStack) -> StateSync:
    """A peer that downloaded a state and checks it: posts on, a sender to pull with."""
    channels = Channels(1 << 20)
    stack.callback(channels.close)
    control = CountedAnchors("me", store, live)
    wakes = Wakes(Wakeups(), WakeSender(channels, Traffic(None)), NEVER_S, posts=RoundPosts("run"),
                  signer=Signer.generate(), dht_poll_s=NEVER_S)
    config = RunConfig()
    config.sync.announce_s = 0.3
    ctx = SimpleNamespace(me="me", control=control, stop=threading.Event(), config=config,
                          log=SimpleNamespace(event=lambda kind, **f: None),
                          service=SimpleNamespace(checkpointer=coordinator))
    agreement = ManifestAgreement(control, SYNC, "me:1", wakes=wakes)
    return StateSync(ctx, SimpleNamespace(set=lambda **f: None), FakeReplica(), Progress(), agreement)


def test_the_follower_keeps_each_anchor_to_be_pulled_and_stores_it_only_while_a_peer_joins():
    coordinator, store = Signer.generate(), {}
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=4) for p in ("a", "b")}
    posts = RoundPosts("run")
    follow = follower(coordinator, store, live, posts, rounds=3)
    assert [a.round for a in follow.tick(4, {"a", "b"})] == [1, 2, 3]
    assert [posts.own(ANCHOR, "0-0", r) is not None for r in (1, 2, 3)] == [True, True, True]
    assert not [key for key in store if key[0] == "anchor"]  # nobody joining: no DHT store
    MemoryControl("a", store, live).publish_manifest("0-0", 3, follow.agreement.read("0-0", 2).to_dict()
                                                     | {"round": 3}, 60)
    for peer in ("a", "b"):
        MemoryControl(peer, store, live).publish_phi_hash("0-0", 4, "h4", 60)
    assert [a.round for a in follow.tick(5, {"a", "b"}, joiners=True)] == [4]
    # a peer joins: the settled anchor and the newest ones go to the DHT too
    assert sorted(key[2] for key in store if key[0] == "anchor") == [1, 2, 3, 4]


def test_a_state_is_checked_against_the_anchor_pulled_from_the_coordinator_and_no_dht_anchor_is_read():
    coordinator, store = Signer.generate(), {}
    with contextlib.ExitStack() as stack:
        service = WatchedService(coordinator.peer_id)
        service.posts = RoundPosts("run")
        _, endpoint = stack.enter_context(served(service))
        live = {coordinator.peer_id: PeerRecord(coordinator.peer_id, endpoint, state="coordinator"),
                **{p: PeerRecord(p, f"{p}:1", state="training", round=3) for p in ("a", "b")}}
        follower(coordinator, store, live, service.posts, rounds=3).tick(3, {"a", "b"})
        CountedAnchors.anchor_reads = 0
        sync = checker(coordinator.peer_id, store, live, stack)
        assert sync._agreed(3) == (Anchor(3, "h3", ("a", "b")), "h3") and sync.anchored_by == "pulled"
        assert CountedAnchors.anchor_reads == 0


def test_a_forged_pulled_anchor_is_refused_and_the_dhts_counts(monkeypatch):
    monkeypatch.setattr("lowcomm.runtime.state_sync.ANCHOR_SLACK_S", 0.0)
    coordinator, mallory, store = Signer.generate(), Signer.generate(), {}

    class Forging(WatchedService):  # answers with an anchor of its own hash, under the coordinator's name
        def GetPost(self, request, context):
            fields = {"peer_id": coordinator.peer_id, **anchor_fields(Anchor(3, "evil", ("mallory",)))}
            return post_request(mallory, "run", ANCHOR, "0-0", 3, fields)

    with contextlib.ExitStack() as stack:
        _, endpoint = stack.enter_context(served(Forging(coordinator.peer_id)))
        live = {coordinator.peer_id: PeerRecord(coordinator.peer_id, endpoint, state="coordinator")}
        sync = checker(coordinator.peer_id, store, live, stack)
        assert sync._agreed(3) == (None, None)  # nothing anywhere yet: waited for until announce_s passed
        publish_anchor(MemoryControl(coordinator.peer_id, store, live), "0-0", Anchor(3, "h3", ("a", "b")), 60)
        assert sync._agreed(3) == (Anchor(3, "h3", ("a", "b")), "h3") and sync.anchored_by == "dht"
        assert sync.agreement.wakes.posted(ANCHOR, "0-0", 3) == {}  # the forgery is kept nowhere


def test_a_pushed_anchor_is_refused_even_from_the_coordinator():
    coordinator = Signer.generate()
    posts = RoundPosts("run")
    post = post_request(coordinator, "run", ANCHOR, "0-0", 3,
                        {"peer_id": coordinator.peer_id, **anchor_fields(Anchor(3, "h3", ("a",)))})
    with pytest.raises(PostRefused, match="never posted"):
        posts.accept(post)  # a Wake's post: it would take a slot of the rounds held from the others' posts
    assert posts.records(ANCHOR, "0-0", 3) == {}
    assert posts.accept(post, pulled=True) == ("0-0", 3)  # asked for (transport.post_pulls)
