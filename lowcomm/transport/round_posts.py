"""Round records pushed over the data plane: a writer sends its announcement, manifest or φ vote straight
to the peers that wait on it, so a round settles, and is checked, without reading the DHT.

A post is the same JSON record the writer stores in the DHT, with the same proof: the writer's key
signs the whole message (run, group, round, kind and record, transport.signing.sign_message), that
key must hash to the sender id, and the sender must be the record's ``peer_id``. So a post is trusted
exactly as far as the DHT's copy, and agreement (collectives.manifest) merges the two: it reads the
posts at every wake and the DHT only at a slow fallback poll, and once more before it leaves a peer
out of a round.

A peer keeps its own signed posts of the newest rounds, so a reader that no post reached (it joined
after the writer posted) can pull one from the writer (transport.post_pulls) and check it as a post.
The coordinator's anchors are only kept that way: a peer that downloads state pulls the anchor of
its round from the coordinator.

A replayed or reordered post changes nothing: an announcement only moves forward (announced ahead,
then reached, then withdrawn) whatever order its posts arrive in, and a writer's manifest or vote of a
round is the first one it posted. The posts held are bounded: MAX_VALUE_BYTES each, MAX_POSTS_PER_ROUND
writers per round and kind, MAX_ROUNDS rounds (the round first posted to is dropped first). A post
that fails a check, or comes from a peer the run does not admit, is refused with the reason (the
service counts it, a `reject` event).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Callable

from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import Signer, Unauthenticated, Verifier, sign_message, verify_message

ANNOUNCE, MANIFEST, VOTE = "announce", "manifest", "phi"  # VOTE: a peer's φ hash of a round it applied
ANCHOR = "anchor"  # the coordinator's anchor of a round (runtime.round_anchor): kept to be pulled, never pushed
STATS = "stats"  # what a peer has done so far (transport.stats_pulls): pulled from it, never pushed or kept
KINDS = (ANNOUNCE, MANIFEST, VOTE, ANCHOR, STATS)
SIGNED_KIND = "round-post"  # what the signature's kind field says (transport.signing.signed_bytes)
MAX_VALUE_BYTES = 256 * 1024  # a manifest of ~2,000 members
MAX_POSTS_PER_ROUND = 4096
MAX_ROUNDS = 64
MAX_WRITERS = 4096  # the writers whose first post's time is kept (RoundPosts.newcomers)
MAX_GROUP_CHARS = 256


class PostRefused(ValueError):
    """A post that is malformed, oversized, for another run, or not signed by its writer."""


def announcement_rank(value: dict) -> int:
    """How far along an announcement is: 0 announced ahead, 1 reached the round, 2 withdrawn."""
    return 2 if value.get("gone") else 0 if value.get("ahead") else 1


def merge_announcements(*sources: dict[str, dict]) -> dict[str, dict]:
    """peer -> its announcement furthest along among ``sources`` (the DHT's, the posted), withdrawn ones left out."""
    out: dict[str, dict] = {}
    for source in sources:
        for peer, value in source.items():
            if peer not in out or announcement_rank(value) > announcement_rank(out[peer]):
                out[peer] = value
    return {peer: value for peer, value in out.items() if not value.get("gone")}


def post_request(signer: Signer, run: str, kind: str, group: str, round_: int, value: dict) -> wire_pb2.WakeRequest:
    """The signed post of ``value`` (a record whose ``peer_id`` is the signer's)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    request = wire_pb2.WakeRequest(group=group, round=round_, kind=kind, run=run, sender=signer.peer_id, value=text)
    sign_message(signer, SIGNED_KIND, request)
    return request


def checked_record(verifier: Verifier, run: str, request) -> dict:
    """The record a post carries, once its run, group, size, its writer's signature and the record's
    ``peer_id`` check out; PostRefused says which did not. Whom the run admits is the caller's to check."""
    if request.run != run:
        raise PostRefused(f"a round post for run {request.run[:64]!r}, not this run")
    if len(request.group) > MAX_GROUP_CHARS or not request.group.isprintable():
        raise PostRefused(f"a round post's group is not a printable name of at most {MAX_GROUP_CHARS} characters")
    if len(request.value) > MAX_VALUE_BYTES:
        raise PostRefused(f"a round post of {len(request.value)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        verify_message(verifier, SIGNED_KIND, request)
    except Unauthenticated as e:
        raise PostRefused(str(e)) from None
    try:
        value = json.loads(request.value)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        raise PostRefused("a round post whose record is not JSON") from None
    if not isinstance(value, dict) or value.get("peer_id") != request.sender:
        raise PostRefused("a round post whose record is not its sender's")
    return value


class RoundPosts:
    """The round records posted to this peer (and its own), by (kind, group, round) and writer."""

    def __init__(self, run: str, admits: Callable[[str], bool] = lambda peer_id: True):
        """``admits(peer_id)``: whether the run lets that peer take part (runtime.admission); another's
        posts are refused at the door."""
        self.run, self.admits = run, admits
        self.verifier = Verifier()
        self._lock = threading.Lock()
        self._rounds: OrderedDict[tuple[str, str, int], dict[str, dict]] = OrderedDict()
        self._own: OrderedDict[tuple[str, str, int], wire_pb2.WakeRequest] = OrderedDict()  # as signed and sent
        self._first: OrderedDict[str, float] = OrderedDict()  # writer -> when its first post here came, in order
        self.accepted = 0

    def accept(self, request, pulled: bool = False) -> tuple[str, int]:
        """Checks a posted record (``pulled``: one this peer asked its writer for) and keeps it; its (group,
        round). PostRefused says why one is refused; an anchor is only taken pulled, stats never."""
        if request.kind not in KINDS:
            raise PostRefused(f"a round post of unknown kind {request.kind[:32]!r}")
        if request.kind == ANCHOR and not pulled:
            raise PostRefused("an anchor is pulled from the coordinator, never posted")
        if request.kind == STATS:
            raise PostRefused("a peer's stats are pulled from it (transport.stats_pulls), never posted")
        value = checked_record(self.verifier, self.run, request)
        if not self.admits(request.sender):
            raise PostRefused(f"a round post from {request.sender[:40]}, a peer the run does not admit")
        self.add(request.kind, request.group, request.round, request.sender, value)
        return request.group, request.round

    def add(self, kind: str, group: str, round_: int, writer: str, value: dict) -> None:
        """Keeps ``writer``'s record (already checked, or this peer's own)."""
        key = (kind, group, int(round_))
        with self._lock:
            posts = self._rounds.get(key)
            if posts is None:
                posts = self._rounds[key] = {}
                while len(self._rounds) > MAX_ROUNDS:
                    self._rounds.popitem(last=False)
            held = posts.get(writer)
            if held is None and len(posts) >= MAX_POSTS_PER_ROUND:
                raise PostRefused(f"round {round_} holds {MAX_POSTS_PER_ROUND} posts already")
            if held is None or (kind == ANNOUNCE and announcement_rank(value) > announcement_rank(held)):
                posts[writer] = value
            self.accepted += 1
            if writer not in self._first:
                self._first[writer] = time.monotonic()
                while len(self._first) > MAX_WRITERS:
                    self._first.popitem(last=False)

    def newcomers(self, since: float) -> set[str]:
        """The writers whose first post here came after ``since`` (time.monotonic), of the last MAX_WRITERS."""
        out = set()
        with self._lock:
            for writer, first in reversed(self._first.items()):
                if first <= since:
                    break
                out.add(writer)
        return out

    def keep_own(self, request: wire_pb2.WakeRequest) -> None:
        """Keeps this peer's own signed post (post_request) to answer a pull (transport.post_pulls); the
        first one of a (kind, group, round), for the newest MAX_ROUNDS of them."""
        key = (request.kind, request.group, int(request.round))
        with self._lock:
            self._own.setdefault(key, request)
            while len(self._own) > MAX_ROUNDS * len(KINDS):
                self._own.popitem(last=False)

    def own(self, kind: str, group: str, round_: int) -> wire_pb2.WakeRequest | None:
        """This peer's own signed post of (kind, group, round), if it made one lately."""
        with self._lock:
            return self._own.get((kind, group, int(round_)))

    def records(self, kind: str, group: str, round_: int) -> dict[str, dict]:
        """writer -> record posted for (kind, group, round); withdrawn announcements included."""
        with self._lock:
            return dict(self._rounds.get((kind, group, int(round_)), {}))
