"""Round membership: peers announce for a round in the DHT and follow one manifest written by a leader.

With `sync.max_contributors` = G > 0 the manifest also bounds the round's fan-in: only G members,
the first G in the order of sha256(run ‖ group ‖ round ‖ peer id) (a fair rotation across rounds),
send contributions; the other members receive the aggregate without adding to it.

The leader is the lowest peer id among the announcers; if its manifest does not appear within
`manifest_s`, the next announcer in id order writes one, and so on. Readers follow the manifest of
the lowest-id writer they see. A manifest fixes the ordered member list, which members own a shard
(client-mode peers own none), and how many consecutive rounds it covers (a membership epoch, so
per-step algorithms do not touch the DHT every step).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from lowcomm.collectives.base import CollectiveError, NotInRound
from lowcomm.collectives.config import SyncConfig
from lowcomm.transport.control import ControlPlane, PeerRecord

logger = logging.getLogger(__name__)
POLL_S = 0.05


@dataclass
class Manifest:
    run: str
    group: str
    round: int  # first round of the epoch
    epoch_rounds: int
    leader: str
    members: list[str]
    endpoints: dict[str, str]
    owners: list[str]
    codec: str
    contributors: list[str] = field(default_factory=list)  # empty: every member contributes

    @property
    def senders(self) -> list[str]:
        """The members whose contributions the round's owners accept."""
        return self.contributors or self.members

    def covers(self, round_: int) -> bool:
        return self.round <= round_ < self.round + self.epoch_rounds

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "Manifest":
        manifest = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k != "contributors"},
                       contributors=list(raw.get("contributors") or []))
        if not set(manifest.contributors) <= set(manifest.members):
            raise ValueError("manifest names a contributor outside its members")
        if not manifest.owners or not set(manifest.owners) <= set(manifest.members):
            raise ValueError("manifest has no owners or an owner outside its members")
        if set(manifest.endpoints) != set(manifest.members):
            raise ValueError("manifest endpoints do not match its members")
        return manifest


class ManifestAgreement:
    """Agrees with the other peers on who takes part in a round."""

    def __init__(self, control: ControlPlane, sync: SyncConfig, endpoint: str, client_mode: bool = False,
                 on_event=None, due_in_group: Callable[[str, PeerRecord], bool] | None = None):
        """`due_in_group(group, record)`: whether a live peer is expected in the group's rounds (pipelines:
        only the replicas of the group's stage); by default every training or joining peer is."""
        self.control = control
        self.due_in_group = due_in_group or (lambda group, record: True)
        self.on_event = on_event or (lambda kind, **fields: None)
        self.sync = sync
        self.endpoint = endpoint
        self.client_mode = client_mode
        self.me = control.identity.peer_id

    @property
    def _presence(self) -> dict:
        """This peer's announcement once it has reached the round."""
        return {"endpoint": self.endpoint, "client_mode": self.client_mode}

    @property
    def _ttl(self) -> float:
        return self.sync.record_ttl_s + self.sync.announce_s + self.sync.manifest_s * 4

    def announce(self, group: str, round_: int, ahead: bool = False) -> None:
        """Says this peer takes part in ``round_``; ``agree`` says it again when the round starts.

        Announcing ahead (a peer announces round n + 1 once it applied round n) lets the round's
        leader count a peer that is a few steps behind instead of timing it out after `announce_s`:
        its contribution is awaited until the reduce deadline, as any member's. A member known only
        from such an announcement owns no shard: it may still be far behind, or gone, and a shard
        owner that never replies costs every member that slice of the round.
        """
        info = self._presence
        self.control.announce(group, round_, {**info, "ahead": True} if ahead else info, self._ttl)

    def withdraw(self, group: str, round_: int) -> None:
        """Takes back an announcement ahead (a peer leaving): no manifest written after this counts it."""
        self.control.announce(group, round_, {"endpoint": None, "gone": True}, self._ttl)  # readers drop it

    def agree(self, group: str, round_: int, epoch_rounds: int, codec: str,
              suspects: frozenset[str] = frozenset()) -> Manifest:
        ttl = self._ttl
        self.announce(group, round_)
        announcers = self._gather(group, round_, suspects)
        order = sorted(p for p, info in announcers.items() if not info.get("ahead"))  # candidate leaders
        published = False
        started = time.monotonic()
        while True:
            manifests = self.control.manifests(group, round_)
            if manifests:
                return self._follow(manifests, group, round_)
            turn = int((time.monotonic() - started) // self.sync.manifest_s)
            if turn >= len(order):
                raise CollectiveError(f"no manifest for round {round_} after {len(order)} candidate leaders")
            if order[turn] == self.me and not published:
                announcers = {**(self.control.announcers(group, round_) or announcers), self.me: self._presence}
                self._publish(group, round_, epoch_rounds, codec, announcers, ttl)
                published = True
            time.sleep(POLL_S)

    def _gather(self, group: str, round_: int, suspects: frozenset[str]) -> dict[str, dict]:
        """Announcers, once every live peer due in this round has reached it or `announce_s` passed.

        A peer that only announced ahead (still training towards the round) is waited for up to
        `announce_s` like one that has not announced, but then stays a member, without a shard.
        A manifest already written ends the wait: the round's membership is settled.
        """
        deadline = time.monotonic() + self.sync.announce_s
        while True:
            announcers = {p: info for p, info in self.control.announcers(group, round_).items()
                          if isinstance(info.get("endpoint"), str)}  # well-formed (withdrawals are dropped)
            due = {p for p, rec in self.control.live_peers().items()
                   if rec.state in ("training", "joining") and rec.round <= round_ and p not in suspects
                   and self.due_in_group(group, rec)}
            present = {p for p, info in announcers.items() if not info.get("ahead")} | {self.me}
            announced = due <= set(announcers) | {self.me}
            if (due <= present or time.monotonic() >= deadline
                    or (announced and self.control.manifests(group, round_))):
                missing = due - set(announcers) - {self.me}
                if missing:  # a live record that never announced (dead, or late): the round goes on without it
                    self.on_event("timeout", round=round_, stage="announce", missing=sorted(missing))
                announcers[self.me] = self._presence
                return announcers
            time.sleep(POLL_S)

    def _publish(self, group, round_, epoch_rounds, codec, announcers, ttl) -> None:
        members = sorted(p for p, v in announcers.items() if isinstance(v.get("endpoint"), str))
        # Owners: the members that reached the round (the writer among them), not those announced ahead.
        owners = [p for p in members if not announcers[p].get("client_mode") and not announcers[p].get("ahead")]
        manifest = Manifest(self.control.run, group, round_, epoch_rounds, self.me, members,
                            {p: announcers[p]["endpoint"] for p in members}, owners, codec,
                            bounded_fan_in(self.control.run, group, round_, members, self.sync.max_contributors))
        self.control.publish_manifest(group, round_, manifest.to_dict(), ttl)
        logger.info("round %d: wrote the manifest for %d members", round_, len(members))

    def read(self, group: str, round_: int) -> Manifest | None:
        """The manifest every member of the round follows (this peer a member or not); None if none yet."""
        return _first_valid(self.control.manifests(group, round_), group, round_)

    def _follow(self, manifests: dict[str, dict], group: str, round_: int) -> Manifest:
        # A brief second look lets a lower-id leader's manifest that raced ours win everywhere.
        time.sleep(POLL_S * 2)
        manifests = self.control.manifests(group, round_) or manifests
        manifest = _first_valid(manifests, group, round_)
        if manifest is None:
            raise CollectiveError(f"round {round_}: every manifest was malformed")
        if self.me not in manifest.members:
            raise NotInRound(f"round {round_}: this peer is not in the manifest (announced too late)", manifest)
        return manifest


def bounded_fan_in(run: str, group: str, round_: int, members: list[str], limit: int) -> list[str]:
    """The round's contributors when at most ``limit`` may send (0: no bound, returns [] = everyone)."""
    if limit <= 0 or len(members) <= limit:
        return []
    def key(peer: str) -> bytes:
        return hashlib.sha256(b"\x00".join(x.encode() for x in (run, group, str(round_), peer))).digest()
    return sorted(sorted(members, key=lambda peer: (key(peer), peer))[:limit])


def _first_valid(manifests: dict[str, dict], group: str, round_: int) -> Manifest | None:
    """The lowest-id writer's well-formed manifest for (group, round_): the one all readers follow."""
    for writer in sorted(manifests or {}):
        try:
            manifest = Manifest.from_dict(manifests[writer])
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("ignored a malformed manifest from %s: %s", writer, e)
            continue
        if manifest.round != round_ or manifest.group != group:
            continue
        return manifest
    return None
