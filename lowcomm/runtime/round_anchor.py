"""Who counts for φ: the agreed hash of a round, and the coordinator's signed anchor of it.

Round R's agreed hash (φ once round R − 1 is applied) is the hash most of round R − 1's voters
published; a tie goes to the hash of the smallest voter id (`agreed_hash`), so every reader settles
a split the same way. Votes from anyone else are ignored: an outsider with any number of fresh keys
cannot move it.

- A training peer's voters are the contributors of the last round it applied (runtime.state_sync).
- A peer that knows no previous round (a joiner, a peer resyncing) and the coordinator's
  checkpointer take the hash from the **anchor**: the coordinator, whose key signed the run config,
  follows the manifests as every peer does (collectives.manifest: each counts only from a member
  of the previous one) and, once the members of the manifest covering round R − 1 voted (or
  `settle_s` passed), signs {R, the agreed hash of those members' votes, those members}
  (`RoundFollower`) and keeps it as its own round post of kind `anchor`: a peer that downloads a
  state pulls the anchor of its round from the coordinator's data plane (transport.post_pulls).
  While a peer record is joining, the coordinator also stores each anchor under
  `<run>.anchor.<group>.<R>` in the DHT, and the newest again once half their life passed, for a
  joiner that cannot reach the coordinator's data plane (Decision 55). The votes count as complete
  once every one of those members that is still training voted, or one hash holds more than half of
  them.
- With no coordinator in the run, a joiner falls back to the majority of every vote published for
  the round (`agreed_hash` over all of them): that fallback is not defended against sybils.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.round_reads import POSTED_RECORDS_POLL_S
from lowcomm.transport.control import ControlPlane

logger = logging.getLogger(__name__)
WALK_BUDGET = 64  # manifests the follower reads per tick at most
KEPT_ANCHORS = 256  # the newest anchors the coordinator keeps in memory
RECENT_ANCHORS = 4  # the newest anchors kept in the DHT while a peer joins (a download takes the newest round's state)


@dataclass(frozen=True)
class Anchor:
    round: int  # φ once round - 1 is applied
    phi_hash: str
    members: tuple[str, ...]  # the members of the manifest covering round - 1: the voters


def agreed_hash(votes: dict[str, str]) -> str | None:
    """The hash most of ``votes`` (voter -> hash) hold; a tie goes to the smallest voter id's. None: no vote."""
    if not votes:
        return None
    counts = Counter(votes.values())
    most = max(counts.values())
    return votes[min(p for p, h in votes.items() if counts[h] == most)]


def _decided(votes: dict[str, str], members: frozenset[str], training: set[str]) -> bool:
    """Whether no vote still to come can change ``agreed_hash``: every member that is training
    (``training``: the ids of the live training records; a member resyncing or gone votes no more)
    voted, or one hash holds more than half of all the members."""
    if not votes:
        return False
    return not (members & training) - votes.keys() or max(Counter(votes.values()).values()) * 2 > len(members)


class FollowedRecords:
    """The live peer records the coordinator follows rounds by (Decision 51): the ids in state training
    (whose votes a round waits for), the highest round one holds, and whether a record is joining (the
    newest anchors are then kept in the DHT).

    Read once per POSTED_RECORDS_POLL_S (or a record's life, if longer) while every voter of the next
    round to settle is training, since the rounds and votes come by post (Decision 56). A voter that the
    last read did not show training (a run's first rounds, a joiner's first, a member whose record
    expired) has them read again ``heartbeat_s`` after that read once it is named, and then every half
    life while one is left or a record is joining, so that its vote is waited for once it trains."""

    def __init__(self, control: ControlPlane, heartbeat_s: float, life_s: float, admits=lambda peer: True):
        self.control, self.admits = control, admits
        self.heartbeat_s, self.life_s = heartbeat_s, max(heartbeat_s, life_s)
        self._read_at = float("-inf")
        self._unseen: frozenset[str] = frozenset()  # voters named when the last read did not show them training
        self.training: set[str] = set()
        self.newest = 0
        self.joiners = False

    def refresh(self, voters: frozenset[str]) -> None:
        """Reads the records again if they are due (the class says when) for a round with ``voters``."""
        missing = voters - self.training
        if missing - self._unseen:  # a voter named since the last read
            due = self.heartbeat_s
        elif missing or self.joiners:
            due = max(self.heartbeat_s, self.life_s / 2)
        else:
            due = max(self.life_s, POSTED_RECORDS_POLL_S)
        if time.monotonic() - self._read_at < due:
            return
        self._read_at = time.monotonic()
        records = self.control.live_peers()
        training = [r for r in records.values() if r.state == "training" and self.admits(r.peer_id)]
        self.training = {r.peer_id for r in training}
        self._unseen = voters - self.training
        self.newest = max((r.round for r in training), default=0)
        self.joiners = any(r.state == "joining" for r in records.values())


def anchor_fields(anchor: Anchor) -> dict:
    """What an anchor's record holds (in the DHT and as a post), its signer's ``peer_id`` aside."""
    return {"round": anchor.round, "phi_hash": anchor.phi_hash, "members": list(anchor.members)}


def publish_anchor(control: ControlPlane, group: str, anchor: Anchor, ttl: float) -> None:
    control.publish_anchor(group, anchor.round, anchor_fields(anchor), ttl)


def parse_anchor(value: dict | None, round_: int) -> Anchor | None:
    """The anchor of ``round_`` an anchor record holds; None if there is none, or it is malformed."""
    if value is None:
        return None
    phi_hash, members = value.get("phi_hash"), value.get("members")
    if (value.get("round") != round_ or not isinstance(phi_hash, str) or not isinstance(members, list)
            or not all(isinstance(m, str) for m in members)):
        logger.warning("ignored a malformed anchor for round %d", round_)
        return None
    return Anchor(round_, phi_hash, tuple(members))


def read_anchor(control: ControlPlane, coordinator: str, group: str, round_: int) -> Anchor | None:
    """The anchor of ``round_`` signed by ``coordinator``'s key (any other signer's is ignored); None if none."""
    return parse_anchor(control.anchors(group, round_).get(coordinator), round_)


class RoundFollower:
    """The coordinator's view of one group's rounds: the manifest chain and each round's agreed hash.

    ``vote_every``: the rounds whose φ hash peers publish are its multiples (ddp and DeMo vote at
    membership epochs). ``tick(newest)`` (``newest``: the highest round a training peer's record
    holds) reads the manifests as far as they are written, passing a round without one once the
    run is past it, and settles each round whose previous manifest is known once its votes are
    decided (`_decided`) or `settle_s` passed since it was first seen applied.
    """

    def __init__(self, control: ControlPlane, agreement: ManifestAgreement, group: str, settle_s: float,
                 ttl: float, vote_every: int = 1, start: int = 0, serve: Callable[[Anchor], None] | None = None):
        self.control, self.agreement, self.group, self.serve = control, agreement, group, serve
        self.settle_s, self.ttl, self.vote_every = settle_s, ttl, max(1, vote_every)
        self.next_manifest = start  # the next round whose manifest to read
        self.next_vote = start + 1  # the next round to settle
        self.anchors: dict[int, Anchor] = {}
        self._stored: dict[int, float] = {}  # round -> when its anchor was stored in the DHT
        self._first_seen: dict[int, float] = {}

    def tick(self, newest: int, training: set[str] = frozenset(), joiners: bool = False) -> list[Anchor]:
        """``training``: the ids of the live records in state training (the votes that may still come).
        Each anchor is handed to ``serve`` once settled (the coordinator keeps it for peers to pull) and,
        without ``serve``, stored in the DHT. ``joiners`` (a live record is joining: a peer may be
        downloading the state): each settled anchor is stored in the DHT too, and the newest
        RECENT_ANCHORS again once half their life passed, so that a round longer than an anchor's life
        still has one, for a joiner the coordinator's data plane does not answer."""
        self._walk(newest)
        settled = self._settle(newest, set(training))
        for anchor in settled if self.serve is not None else ():
            self.serve(anchor)
        stored = [a.round for a in settled] if joiners or self.serve is None else []
        recent = sorted(self.anchors)[-RECENT_ANCHORS:] if joiners else []
        for round_ in stored + recent:
            if time.monotonic() - self._stored.get(round_, float("-inf")) >= self.ttl / 2:  # none, or expiring
                publish_anchor(self.control, self.group, self.anchors[round_], self.ttl)
                self._stored[round_] = time.monotonic()
        return settled

    def voters(self) -> frozenset[str]:
        """Whose votes the next round to settle waits for: the members of the newest manifest before it."""
        return self.agreement.trusted(self.group, self.next_vote) or frozenset()

    def _walk(self, newest: int) -> None:
        for _ in range(WALK_BUDGET):
            round_ = self.next_manifest
            passed = newest > round_ + 1  # the run is past it: a manifest of it is written, if it has one
            # posted by the round's leader, else from the DHT at its poll; once the run is past it, from the DHT
            if self.agreement.read(self.group, round_, fallback=passed, fresh=passed) is None and not passed:
                return  # not written yet
            self.next_manifest = round_ + 1  # none at all: a round inside an epoch, or one that failed

    def _settle(self, newest: int, training: set[str]) -> list[Anchor]:
        settled = []
        while self.next_manifest >= self.next_vote:  # the manifest of the round before is settled
            round_ = self.next_vote
            if round_ % self.vote_every:
                self.next_vote += 1
                continue
            members = self.agreement.trusted(self.group, round_)  # those of the newest manifest before it
            first = self._first_seen.get(round_)
            late = first is not None and time.monotonic() - first >= self.settle_s
            # posted by the members; the DHT read at most once per poll until every member's is in, and once
            # more before the round is settled without one
            votes = {p: h for p, h in self.agreement.reads.votes(self.group, round_, members or (), fresh=late).items()
                     if p in (members or ())}
            if not votes and newest < round_:
                return settled  # round - 1 is not applied anywhere yet
            first = self._first_seen.setdefault(round_, time.monotonic())
            if members is not None and not _decided(votes, members, training) and time.monotonic() - first < self.settle_s:
                return settled  # a member's vote may still change the outcome
            self._first_seen.pop(round_, None)
            self.next_vote += 1
            if votes:
                anchor = Anchor(round_, agreed_hash(votes), tuple(sorted(members)))
                self.anchors[round_] = anchor
                settled.append(anchor)
        for old in sorted(self.anchors)[:-KEPT_ANCHORS]:
            del self.anchors[old]
            self._stored.pop(old, None)
        return settled
