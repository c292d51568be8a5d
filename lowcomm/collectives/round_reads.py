"""What agreement reads of a round (and the drift check of its φ votes): the records posted to this peer
(transport.round_posts), the votes and manifests pulled from their writers (transport.post_pulls) and
the DHT's.

The posts are read at every look; the DHT when a look asks for it (``fresh``: before a round goes
on without a peer, before this peer writes a manifest, a second look at racing manifests, a reader
outside the round) and otherwise
once per `Wakes.dht_poll_s`. Without posts every look reads the DHT.

The live peer records a round's looks share are read again once older than a poll without posts (or
with a `dht_poll_s` of 0: a peer nobody can post to), and with them once older than
POSTED_RECORDS_POLL_S: the posts say who reached a round, so the records only say whom to expect,
and a peer that posts is counted whatever the last read said. A post from a peer the last read did
not hold (or held as not training: a parked joiner), whose first post came after that read, has them
read again a poll after it.
Where a decision rests on a record's absence or state (going on without a peer, the quorum, a
manifest naming only this peer) the caller asks for them ``fresh``: read again once older than a
poll, as without posts (docs/round-protocol.md, Decision 53).

A read of the live peer records that lacks this peer's own record, after one that held it, missed
what it asked for: the records a read returns are held until they expire (transport.held_records),
so this peer's own stores have not landed for a record's life, or the nodes that hold them do not
answer, while this peer is alive. The peers such a read lacks may be as live as this one, so for
up to ``keep_s`` from the first such read, those of the last read that held this peer's record stay
in the view (not those that were `joining`: a peer taken as resyncing lets this one take a round
alone); what the read has is taken (docs/round-protocol.md, Decision 44). An `own_record_missing`
event marks the first such read and, with nothing kept, the first after ``keep_s``; the reads that
kept peers are counted (``own_record_missing``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.round_posts import ANNOUNCE, MANIFEST, VOTE, merge_announcements
from lowcomm.transport.wakeups import Wakes

POSTED_RECORDS_POLL_S = 30.0  # with posts: how old the live records a round's looks share may get
PULLED_WRITERS = 3  # a fresh look at a round's manifests asks at most this many likely writers for theirs


class RoundReads:
    def __init__(self, control: ControlPlane, wakes: Wakes, on_event=None, keep_s: float = 10.0):
        """``keep_s``: how long from the first read that lacks this peer's own record the peers of the last
        read that held it stay in the view (the module says why)."""
        self.control, self.wakes, self.keep_s = control, wakes, keep_s
        self.on_event = on_event or (lambda kind, **fields: None)
        self.me = control.identity.peer_id
        self._records: tuple[float, dict[str, PeerRecord]] = (float("-inf"), {})  # (read at, live records)
        self._whole: dict[str, PeerRecord] = {}  # the last read that held this peer's own record
        self._missing_since: float | None = None  # the first of the reads since then that lack it
        self._lapsed = False  # whether keep_s has passed since that one
        self.own_record_missing = 0  # the reads that lacked this peer's own record and kept peers

    def announcers(self, group: str, round_: int, fresh: bool = False) -> dict[str, dict]:
        """peer -> its announcement of the round, the furthest along of its posted and stored ones;
        withdrawn ones left out."""
        posted = self.wakes.posted(ANNOUNCE, group, round_)
        if fresh or self.wakes.dht_due(ANNOUNCE, group, round_):
            return merge_announcements(self.control.announcers(group, round_), posted)
        return merge_announcements(posted)

    def manifests(self, group: str, round_: int, fresh: bool = False,
                  pull: frozenset[str] | None | bool = False) -> dict[str, dict]:
        """writer -> its manifest of the round, posted or stored. A ``fresh`` look with ``pull`` (the writers
        whose manifest counts, or None: anyone's) first asks the PULLED_WRITERS lowest-id of them the live
        records show able to lead it, below the lowest whose manifest is posted here, for their own
        (transport.post_pulls): a manifest is stored only where a post of it did not arrive (Decision 59),
        so a peer its writer did not know of when it posted has it from none but its writer."""
        posted = self.wakes.posted(MANIFEST, group, round_)
        if fresh and pull is not False:
            records = self.live(cached=True)
            able = sorted(p for p, rec in records.items() if p != self.me and (pull is None or p in pull)
                          and rec.state in ("training", "joining") and rec.endpoint and not rec.client_mode)
            lowest = min((w for w in posted if pull is None or w in pull), default=None)
            asked = [p for p in able if lowest is None or p < lowest][:PULLED_WRITERS]
            if asked and self.wakes.pull(MANIFEST, group, round_, {p: records[p].endpoint for p in asked}):
                posted = self.wakes.posted(MANIFEST, group, round_)
        out = self.control.parse_manifests(posted) if posted else {}
        if fresh or self.wakes.dht_due(MANIFEST, group, round_):
            out = {**out, **self.control.manifests(group, round_)}
        return out

    def votes(self, group: str, round_: int, voters=frozenset(), fresh: bool = False) -> dict[str, str]:
        """peer -> its φ hash of the round, posted, pulled or stored: nothing more is read once every one
        of ``voters`` posted its vote; otherwise at the DHT's poll (or now: ``fresh``) the voters still
        missing are asked for their votes (transport.post_pulls: a vote is stored only where a post did
        not reach, Decision 39), and the DHT is read if one is still missing."""
        posted = self._posted_votes(group, round_)
        if voters and set(voters) <= posted.keys():
            return posted
        if not (fresh or self.wakes.dht_due(VOTE, group, round_)):
            return posted
        missing = set(voters) - posted.keys()
        if missing:
            records = self.live(cached=True)
            if self.wakes.pull(VOTE, group, round_, {p: records[p].endpoint for p in missing if p in records
                                                     and records[p].endpoint and not records[p].client_mode}):
                posted = self._posted_votes(group, round_)
                if set(voters) <= posted.keys():
                    return posted
        return {**posted, **self.control.phi_hashes(group, round_)}

    def _posted_votes(self, group: str, round_: int) -> dict[str, str]:
        return {p: v["hash"] for p, v in self.wakes.posted(VOTE, group, round_).items()
                if isinstance(v.get("hash"), str)}

    def known_then_fresh(self) -> Iterator[dict[str, PeerRecord]]:
        """The live records of the last read, however old (read now if none was), then, unless that read
        was just made, those of a newer read (one once the last is older than ``live``'s age)."""
        read_at = self._records[0]
        yield self.live(cached=True)
        if self._records[0] == read_at:
            yield self.live()

    @property
    def read_at(self) -> float:
        """When (time.monotonic) the live records ``live`` returns were read."""
        return self._records[0]

    @property
    def poll_s(self) -> float:
        """How old the live records may get where a decision rests on them (``fresh``)."""
        return max(self.wakes.poll_s, self.wakes.dht_poll_s)

    def live(self, cached: bool = False, fresh: bool = False) -> dict[str, PeerRecord]:
        """The live peer records, read again once older than a poll without posts and than
        POSTED_RECORDS_POLL_S with them (a round's looks share one read); ``fresh``: once older than a poll
        (the module says when); ``cached``: the last ones read, whatever their age (read now only if none
        were)."""
        read_at = self._records[0]
        age = time.monotonic() - read_at
        posted = self.wakes.posting and self.wakes.dht_poll_s > 0  # (a peer nobody posts to reads at every look)
        max_age = max(self.poll_s, POSTED_RECORDS_POLL_S) if posted and not fresh else self.poll_s
        expected = {p for p, rec in self._records[1].items() if rec.state in ("training", "joining")}
        if max_age > age >= self.poll_s and self.wakes.newcomers(read_at) - expected - {self.me}:
            max_age = self.poll_s  # a peer that read did not hold, or held parked, posted here since: read again
        if age >= max_age and not (cached and age < float("inf")):
            self._records = (time.monotonic(), self._complete(self.control.live_peers()))
        return self._records[1]

    def _complete(self, read: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """``read``, with the peers of the last read that held this peer's own record if ``read`` lacks it,
        for up to ``keep_s`` (the module says why)."""
        now = time.monotonic()
        if self.me in read:
            self._whole, self._missing_since, self._lapsed = read, None, False
            return read
        if self.me not in self._whole:
            return read
        kept = {p: rec for p, rec in self._whole.items() if p not in read and rec.state != "joining"}
        if self._missing_since is None:
            self._missing_since = now
            self.on_event("own_record_missing", seen=sorted(read), kept=sorted(kept))
        if now - self._missing_since > self.keep_s:
            if not self._lapsed:
                self._lapsed = True
                self.on_event("own_record_missing", seen=sorted(read), kept=[], after_s=round(self.keep_s, 1))
            return read
        self.own_record_missing += 1
        return {**kept, **read}
