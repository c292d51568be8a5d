"""Round membership: peers announce for a round in the DHT and follow one manifest written by a leader.

A writer posts its announcement and manifest to the peers that wait on them (transport.round_posts) and
stores them only where a post did not arrive (Decisions 34, 59); waits read the posts when woken and the
DHT seldom (collectives.round_reads). With `sync.max_contributors` = G > 0, only the first G members in
the order of sha256(run ‖ group ‖ round ‖ peer id) (a rotation across rounds) send contributions.

The leader is the lowest peer id among the announcers that reached the round, the members of the
previous manifest first; if its manifest does not appear within `manifest_s`, the next candidate
writes one, and so on. A manifest counts only from a member of the previous manifest this peer
followed (or learned, `learn`): any other writer is refused (a `reject` event), so a stranger's keys
cannot lead a round. Only once every previous member that reached the round had its turn does a
candidate from outside that list count (all previous members gone: the run goes on). A peer that
knows no previous manifest (a joiner without an anchor) counts the announcers that say they know one
as the previous members (its quorum does not); if none does (the run's first round), it follows the
lowest-id writer. A manifest fixes the ordered member list, which members own a shard (client-mode
peers own none), and how many consecutive rounds it covers (a membership epoch, so per-step
algorithms do not touch the DHT every step).

``admits(peer_id)`` (the run's mode, runtime.admission) says who may be a member at all: the leader leaves
the others out, they are never candidates nor waited for, and a manifest by or naming one is refused.

With ``quorum`` (training peers; collectives.quorum, Decision 27) a peer cut off from the swarm fails
the round (after `quorum_wait_s`, withdrawing its announcement) instead of training alone on its own φ.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from lowcomm.collectives.base import CollectiveError, NotInRound
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest_record import Manifest, bounded_fan_in, first_outsider, first_valid  # noqa: F401
from lowcomm.collectives.quorum import short_of_quorum_read, solo_after_others
from lowcomm.collectives.round_reads import RoundReads
from lowcomm.collectives.silent_records import SilentRecords
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.round_posts import ANNOUNCE, MANIFEST, VOTE
from lowcomm.transport.wakeups import Wakes

logger = logging.getLogger(__name__)
POLL_S = 0.05  # how often a wait reads the DHT without wakes (transport.wakeups: with them, when woken)
QUORUM_POLL_S = 0.5  # how often a writer short of a quorum looks again (announcers and live records)
KNOWN_MANIFESTS = 8  # per group: the manifests remembered for the writer check


class ManifestAgreement:
    """Agrees with the other peers on who takes part in a round."""

    def __init__(self, control: ControlPlane, sync: SyncConfig, endpoint: str, client_mode: bool = False,
                 on_event=None, due_in_group: Callable[[str, PeerRecord], bool] | None = None,
                 admits: Callable[[str], bool] | None = None, quorum: bool = False, wakes: Wakes | None = None):
        """`due_in_group(group, record)`: whether a live peer is expected in the group's rounds (default: every
        training or joining one; pipelines: the replicas of the group's stage). `admits(peer_id)`: whether the
        run lets that peer be a member (default: everyone). `quorum`: write and follow only manifests a majority
        of the previous members' live ones reached. `wakes`: what waits end on (default: a POLL_S poll)."""
        self.wakes = wakes or Wakes.polling(POLL_S)
        self.control, self.sync, self.quorum = control, sync, quorum
        self.admits = admits or (lambda peer_id: True)
        self.due_in_group = due_in_group or (lambda group, record: True)
        self.on_event = on_event or (lambda kind, **fields: None)
        self.endpoint, self.client_mode = endpoint, client_mode
        self.me = control.identity.peer_id
        self._known: dict[str, list[tuple[int, frozenset[str]]]] = {}  # group -> (first round, members), by round
        self._refused: set[tuple[str, int, str, str]] = set()  # (group, round, peer, reason) already counted
        self.silent = SilentRecords(self.wakes)  # whom a gather does not wait for
        self._endpoints: dict[str, dict[str, str]] = {}  # group -> the newest followed manifest's endpoints
        self._vouched: dict[str, tuple[int, frozenset[str] | None]] = {}  # group -> round, its anchored announcers
        self.refused_writers = 0
        self.reads = RoundReads(control, self.wakes, self.on_event, sync.record_ttl_s)  # posted records, and the DHT's

    # ---- which writers count --------------------------------------------------------------------

    def learn(self, group: str, round_: int, members, endpoints: dict[str, str] | None = None) -> None:
        """Remembers the members of the manifest that starts at ``round_``: the next one counts only from
        one of them. A followed manifest is learnt so (with its ``endpoints``: its φ votes go to them); a
        joiner's first from its anchor (runtime.round_anchor). Its members took part: each is due again."""
        members = frozenset(members)
        self.silent.named(group, round_, members)
        known = [k for k in self._known.get(group, []) if k[0] != round_] + [(round_, members)]
        self._known[group] = sorted(known)[-KNOWN_MANIFESTS:]
        if endpoints is not None and round_ >= max(first for first, _ in known):
            self._endpoints[group] = dict(endpoints)

    def trusted(self, group: str, round_: int) -> frozenset[str] | None:
        """The writers whose manifest for ``round_`` counts: the members of the newest manifest known to
        start before it; without one, the announcers of the round that know one (`_vouch`); None when
        neither is known (every writer counts)."""
        previous, vouched = self._previous(group, round_), self._vouched.get(group, (None, None))
        return previous if previous is not None else vouched[1] if vouched[0] == round_ else None

    def _previous(self, group: str, round_: int) -> frozenset[str] | None:
        """The members of the newest manifest this peer knows that starts before ``round_`` (its quorum's)."""
        before = [members for first, members in self._known.get(group, []) if first < round_]
        return before[-1] if before else None

    def _vouch(self, group: str, round_: int, announcers: dict[str, dict]) -> None:
        """Without a previous manifest, the announcers that reached the round saying they know one count as
        its members for leading and writing it (Decision 46); never for the quorum."""
        anchored = frozenset(p for p, info in announcers.items() if info.get("anchored") is True
                             and not info.get("ahead") and p != self.me and self.admits(p))
        self._vouched[group] = (round_, anchored if anchored and self._previous(group, round_) is None else None)

    def _pick(self, manifests: dict[str, dict], group: str, round_: int,
              fallback: frozenset[str] = frozenset()) -> Manifest | None:
        """The manifest to follow: the lowest-id trusted writer's, else (all previous members gone) the
        lowest-id writer's in ``fallback``; every other writer is refused once, as a `reject` event."""
        manifests = self._admitted(manifests, group, round_)
        trusted = self.trusted(group, round_)
        if trusted is None:
            return first_valid(manifests, group, round_)
        for writer in sorted(set(manifests) - trusted - fallback):
            self._refuse(group, round_, writer, "a manifest from a peer outside the previous round's members")
        order = sorted(set(manifests) & trusted) + sorted((set(manifests) & fallback) - trusted)
        return first_valid({w: manifests[w] for w in order}, group, round_, order)

    def _refuse(self, group: str, round_: int, peer: str, reason: str) -> None:
        """A `reject` event, once per peer, round and reason."""
        if (group, round_, peer, reason) not in self._refused:
            self._refused.add((group, round_, peer, reason))
            self.refused_writers += 1
            self.on_event("reject", round=round_, sender=peer[:40], reason=reason)

    def _admitted(self, manifests: dict[str, dict], group: str, round_: int) -> dict[str, dict]:
        """The manifests written by a peer the run admits and naming no other member."""
        out = {}
        for writer, raw in manifests.items():
            outsider = first_outsider(writer, raw, self.admits)
            if outsider is None:
                out[writer] = raw
            else:
                named = "written by a peer" if outsider == writer else f"naming {outsider[:40]}, a peer"
                self._refuse(group, round_, writer, f"a manifest {named} the run does not admit")
        return out

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
        info = {**self._presence, "anchored": True} if self._previous(group, round_) is not None else self._presence
        self._announce(group, round_, {**info, "ahead": True} if ahead else info)

    def publish_vote(self, group: str, round_: int, phi_hash: str, ttl: float) -> None:
        """This peer's φ hash of a round it applied: posted to the members of the last manifest it followed
        and the peers due in the group (their drift checks) and the coordinator (its anchors), as known from
        the last read of the live records. A peer that joined since that read gets no post: it pulls the
        vote from this peer (round_reads.votes). Stored as well only where a post did not arrive, where
        this peer cannot be dialled (client mode: nobody can pull it), or where no coordinator is in the
        run (a download's check then takes the majority of every stored vote) (Decision 39)."""
        records = self.reads.live(cached=True)
        endpoints = [rec.endpoint for rec in self._watchers(group, records)]
        endpoints += [e for p, e in self._endpoints.get(group, {}).items() if p != self.me]
        coordinated = any(rec.state == "coordinator" for rec in records.values())
        self.wakes.publish(endpoints if self.wakes.posting else [], VOTE, group, round_,
                           self.control.record({"hash": phi_hash}),
                           store=lambda: self.control.publish_phi_hash(group, round_, phi_hash, ttl),
                           posted_only=coordinated and not self.client_mode)

    def _watchers(self, group: str, records: dict[str, PeerRecord]) -> list[PeerRecord]:
        """Of ``records``, the other peers due in the group's rounds, and the coordinator (its anchors)."""
        return [rec for p, rec in records.items() if p != self.me and self.admits(p)
                and ((rec.state in ("training", "joining") and self.due_in_group(group, rec))
                     or rec.state in ("coordinator", "holder"))]

    def withdraw(self, group: str, round_: int) -> None:
        """Takes back an announcement ahead (a peer leaving): no manifest written after this counts it."""
        self._announce(group, round_, {"endpoint": None, "gone": True})  # readers drop it

    def _announce(self, group: str, round_: int, info: dict) -> None:
        """Posts it to the live peers due in the group; stores it only if one of them takes no posts or a
        post did not arrive (Decision 34; a withdrawal is always stored).

        It goes at once to the peers of the last read of the live records, however old (a read waiting on
        a DHT node that does not answer never holds it back, Decision 42); the round's own then also to
        those a fresh read adds. A peer that joined since misses one ahead; should it write the round's
        manifest first, it leaves this one out, as a peer that announced late (Decision 8)."""
        posted: set[str] = set()
        for records in [self.reads.live(cached=True)] if info.get("ahead") else self.reads.known_then_fresh():
            due = [rec for p, rec in records.items() if p != self.me and p not in posted
                   and self.admits(p) and rec.state in ("training", "joining") and self.due_in_group(group, rec)]
            if posted and not due:
                return
            posted |= {rec.peer_id for rec in due} | {self.me}
            posted_only = info.get("endpoint") is not None and not any(rec.client_mode for rec in due)
            self.wakes.publish([rec.endpoint for rec in due], ANNOUNCE, group, round_, self.control.record(info),
                               store=lambda: self.control.announce(group, round_, info, self._ttl),
                               posted_only=posted_only)

    def agree(self, group: str, round_: int, epoch_rounds: int, codec: str,
              suspects: frozenset[str] = frozenset()) -> Manifest:
        """The manifest of ``round_`` this peer follows (and remembers: it decides who writes the next)."""
        with self.wakes.watching(group, round_):  # from before the announcement: no wake is missed
            return self._agree(group, round_, epoch_rounds, codec, suspects)

    def _agree(self, group: str, round_: int, epoch_rounds: int, codec: str, suspects: frozenset[str]) -> Manifest:
        self.announce(group, round_)
        announcers, complete, settled = self._gather(group, round_, suspects)
        if settled and self._previous(group, round_) is not None:  # a previous member wrote it (Decision 48)
            return self._follow(settled[0], group, round_, frozenset())  # this peer in it or not (then: catch up)
        self._vouch(group, round_, announcers)
        candidates = sorted(p for p, info in announcers.items() if not info.get("ahead") and self.admits(p))
        trusted = self.trusted(group, round_)
        if trusted is None:
            order, first_outside = candidates, 0
        else:  # the previous members first: a newcomer leads only once each of them had its turn
            order = [p for p in candidates if p in trusted] + [p for p in candidates if p not in trusted]
            first_outside = sum(p in trusted for p in candidates)
        published, short, checked = False, None, float("-inf")
        mine = order.index(self.me) if self.me in order else None
        # nobody can race the first candidate: every due peer reached the round, and it is the lowest previous member
        settled = order[:1] if complete and trusted and order and order[0] == min(trusted) else []
        started = time.monotonic()
        while True:
            now = time.monotonic()
            turn = int((now - started) // self.sync.manifest_s)
            fallback = frozenset(order[first_outside:turn + 1])
            may_write = mine is not None and turn >= mine and not published and now - checked >= QUORUM_POLL_S
            # a writer looks first (the DHT, and the lower candidates' own posts: a late peer was posted none);
            # not the first candidate once every due peer reached the round
            manifests = self.reads.manifests(group, round_, may_write and self.me not in settled, pull=trusted)
            if manifests and self._pick(manifests, group, round_, fallback) is not None:
                return self._follow(manifests, group, round_, fallback, settled)
            if turn >= len(order) and (short is None or now - started >= self.quorum_wait_s):
                try:  # takes back its announcement: a later manifest must not name this peer as an owner
                    self.withdraw(group, round_)
                except Exception as e:  # the DHT may be out of reach (a cut-off peer): the record then expires
                    logger.info("round %d: withdrawing the announcement failed: %s", round_, e)
                raise CollectiveError(f"no manifest for round {round_} after {len(order)} candidate leaders"
                                      + (f": {short}" if short else ""))
            if may_write:
                checked = now
                announcers = {**(self.reads.announcers(group, round_) or announcers), self.me: self._presence}
                reached = [p for p in self._members(group, round_, announcers) if not announcers[p].get("ahead")]
                reason = self.short_of_quorum(group, round_, reached)
                if reason is None:
                    self._publish(group, round_, epoch_rounds, codec, announcers, self._ttl)
                    published = True
                    continue  # read it back at once
                elif short is None:  # the round waits (up to quorum_wait_s) for the others or their records' expiry
                    self.on_event("timeout", round=round_, stage="quorum", reason=reason)
                    logger.info("round %d: no manifest written: %s", round_, reason)
                short = reason
            self.wakes.wait(group, round_, self.wakes.poll_s)

    @property
    def quorum_wait_s(self) -> float:
        """How long a writer short of a quorum waits: long enough for a killed member's record to expire."""
        return self.sync.record_ttl_s + self.sync.heartbeat_s + self.sync.manifest_s

    def short_of_quorum(self, group: str, round_: int, members) -> str | None:
        """Why this peer must not write a manifest of ``round_`` whose ``members`` reached it; None if it may
        (collectives.quorum). Without ``quorum``, or without a previous manifest, anything goes."""
        previous = self._previous(group, round_)
        if not self.quorum or previous is None:
            return None
        return short_of_quorum_read(self.me, previous, members, self.reads.live(),
                                    lambda: self.reads.live(fresh=True))

    def _gather(self, group: str, round_: int,
                suspects: frozenset[str]) -> tuple[dict[str, dict], bool, tuple[dict, Manifest] | None]:
        """Announcers, once every live peer due in this round has reached it or `announce_s` passed, whether
        every due peer had, and the (manifests, manifest) that ended the wait, if one did. The first look
        wakes the due peers (they may wait on this one).

        A peer that only announced ahead (still training towards the round) is waited for up to
        `announce_s` like one that has not announced, but then stays a member, without a shard.
        A manifest already written settles the round: it ends the wait once every due peer announced, at
        once if it names this peer (a joiner no announcement post reached), and at once if a previous
        member wrote it (a peer a round behind: it is not in it, and catches the round up, Decision 48).
        It is looked for (posted, and in the DHT at its poll) once every due peer announced, once one is
        posted here, at the deadline, and once a previous member's record or posted announcement names a
        later round (the run moved past the round: the DHT at once, one read). A live record that missed a
        round and stayed silent since is not waited for (collectives.silent_records)."""
        deadline, read_past = time.monotonic() + self.sync.announce_s, False
        while True:
            late = time.monotonic() >= deadline  # the round may go on without a peer: the DHT's records too
            announcers = {p: info for p, info in self.reads.announcers(group, round_, fresh=late).items()
                          if isinstance(info.get("endpoint"), str)}  # well-formed (withdrawals are dropped)
            records, due = self._due(group, round_, suspects, fresh=late)
            present = {p for p, info in announcers.items() if not info.get("ahead")} | {self.me}
            announced = due <= set(announcers) | {self.me}
            trusted = self.trusted(group, round_)
            past = trusted is not None and (any(records[p].round > round_ for p in trusted & records.keys())
                                            or bool(trusted & self.wakes.posted(ANNOUNCE, group, round_ + 1).keys()))
            look = not due <= present and (announced or late or past or self.wakes.posted(MANIFEST, group, round_))
            fresh, read_past = past and not read_past, read_past or past
            manifests, settled = self._settled(group, round_, fresh) if look else ({}, None)
            if due <= present or late or (settled is not None and (announced or self.me in settled.members
                                                                    or trusted is not None)):
                missing = due - set(announcers) - {self.me} - set(settled.members if settled else ())
                if missing:  # a live record that never announced (dead, or late): the round goes on without it
                    self.on_event("timeout", round=round_, stage="announce", missing=sorted(missing),
                                  **({} if late else {"settled": True}))  # no wait: the manifest was there
                self.silent.close(group, round_, records, announcers, missing, self.reads.read_at)
                announcers[self.me] = self._presence
                return announcers, due <= present, (manifests, settled) if settled is not None else None
            self.wakes.wait(group, round_, deadline - time.monotonic())

    def _due(self, group: str, round_: int, suspects: frozenset[str], fresh: bool) -> tuple[dict, set[str]]:
        """The live records, and the peers due in ``round_`` they name, less ``suspects`` and silent ones; read
        again (``fresh``) where a silent one's record is from the read its miss was judged on."""
        def named(records):
            return {p for p, rec in records.items()
                    if rec.state in ("training", "joining") and rec.round <= round_ and p not in suspects
                    and self.due_in_group(group, rec) and self.admits(p)}
        records = self.reads.live(fresh=fresh)
        if self.silent.stale(group, self.silent.silent(group, round_, named(records), records), self.reads.read_at):
            records = self.reads.live(fresh=True)
        due = named(records)
        return records, due - self.silent.silent(group, round_, due, records)

    def _settled(self, group: str, round_: int, fresh: bool = False) -> tuple[dict[str, dict], Manifest | None]:
        """The round's manifests from previous members (any writer's without one) and the one to follow, if
        one exists: a stranger's does not end the wait, nor is it refused here (a fallback writer's counts
        later in `_agree`)."""
        trusted = self.trusted(group, round_)
        manifests = {w: m for w, m in self.reads.manifests(group, round_, fresh, pull=trusted).items()
                     if trusted is None or w in trusted}
        return manifests, self._pick(manifests, group, round_) if manifests else None

    def _members(self, group: str, round_: int, announcers: dict[str, dict]) -> list[str]:
        """The members a manifest of these announcers names: the well-formed ones the run admits."""
        members = sorted(p for p, v in announcers.items() if isinstance(v.get("endpoint"), str))
        for outsider in [p for p in members if not self.admits(p)]:
            self._refuse(group, round_, outsider, "an announcement from a peer the run does not admit")
            members.remove(outsider)
        return members

    def _publish(self, group, round_, epoch_rounds, codec, announcers, ttl) -> None:
        """Writes the manifest (owners: members that reached the round), posted to the members, the other due
        peers (a late one's look) and the coordinator; stored only where a post did not arrive, or where a
        recipient takes none (Decision 59)."""
        members = self._members(group, round_, announcers)
        owners = [p for p in members if not announcers[p].get("client_mode") and not announcers[p].get("ahead")]
        manifest = Manifest(self.control.run, group, round_, epoch_rounds, self.me, members,
                            {p: announcers[p]["endpoint"] for p in members}, owners, codec,
                            bounded_fan_in(self.control.run, group, round_, members, self.sync.max_contributors))
        due = [r for r in self._watchers(group, self.reads.live(cached=True)) if r.peer_id not in manifest.endpoints]
        if self.me not in (self.trusted(group, round_) or ()):  # a reader past the round may need to see why it counts
            self.control.announce(group, round_, announcers[self.me], self._ttl)
        client = any(announcers[p].get("client_mode") for p in members) or any(r.client_mode for r in due)
        self.wakes.publish([manifest.endpoints[p] for p in members if p != self.me] + [r.endpoint for r in due],
                           MANIFEST, group, round_, self.control.manifest_record(manifest.to_dict()),
                           store=lambda: self.control.publish_manifest(group, round_, manifest.to_dict(), ttl),
                           posted_only=not client)
        logger.info("round %d: wrote the manifest for %d members", round_, len(members))

    def read(self, group: str, round_: int, fallback: bool = False, fresh: bool = True) -> Manifest | None:
        """The manifest every member of the round follows (this peer a member or not); None if none yet.
        With ``fallback`` (a reader that saw the run move past the round), a writer outside the previous
        members counts too if it announced that it reached the round (all previous members gone)."""
        manifests = self.reads.manifests(group, round_, fresh, pull=self.trusted(group, round_))
        if not manifests:
            return None
        outside = frozenset()
        if fallback:
            outside = frozenset(p for p, info in self.reads.announcers(group, round_, fresh=True).items()
                                if isinstance(info.get("endpoint"), str) and not info.get("ahead"))
        manifest = self._pick(manifests, group, round_, outside)
        if manifest is not None:
            self.learn(group, round_, manifest.members, manifest.endpoints)
        return manifest

    def _follow(self, manifests: dict[str, dict], group: str, round_: int, fallback: frozenset[str],
                settled: list[str] = ()) -> Manifest:
        """``settled``: the first candidate leader once every due peer reached the round: no second look."""
        manifest = self._pick(manifests, group, round_, fallback)
        if manifest is None or manifest.leader not in settled:
            # A brief second look lets a lower-id leader's manifest that raced this one win everywhere.
            time.sleep(POLL_S * 2)
            manifests = {**manifests, **self.reads.manifests(group, round_, fresh=True,  # a thin read drops none
                                                             pull=self.trusted(group, round_))}
            manifest = self._pick(manifests, group, round_, fallback)
        if manifest is None:
            raise CollectiveError(f"round {round_}: every manifest that counts was malformed")
        previous = self._previous(group, round_)
        if (self.quorum and previous is not None and set(manifest.members) <= {self.me}
                and solo_after_others(self.me, previous, manifest.members, self.reads.live(fresh=True))):
            raise CollectiveError(f"round {round_}: a manifest naming only this peer after a round with others")
        self.learn(group, round_, manifest.members, manifest.endpoints)
        if self.me not in manifest.members:
            raise NotInRound(f"round {round_}: this peer is not in the manifest (announced too late)", manifest)
        return manifest

