"""What agreement reads of a round (and the drift check of its φ votes): the records posted to this peer
(transport.round_posts) and the DHT's.

The posts are read at every look; the DHT when a look asks for it (``fresh``: before a round goes
on without a peer, before this peer writes a manifest, a second look at racing manifests, a reader
outside the round) and otherwise
once per `Wakes.dht_poll_s`. The cached live peer records are read again once older than that, and with
posts once older than ``records_s`` (a record's lifetime: the posts say who reached a round, Decision
34), or than a poll once an announcement was posted here by a peer they do not hold (a joiner: it is
due, and this peer's own announcements should reach it). Without posts every look reads the DHT.
"""

from __future__ import annotations

import time

from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.round_posts import ANNOUNCE, MANIFEST, VOTE, merge_announcements
from lowcomm.transport.wakeups import Wakes


class RoundReads:
    def __init__(self, control: ControlPlane, wakes: Wakes, records_s: float = 0.0):
        self.control, self.wakes = control, wakes
        self.records_s = records_s if wakes.posting else 0.0
        self._stranger = False  # a peer the live records read do not hold posted an announcement here
        self._records: tuple[float, dict[str, PeerRecord]] = (float("-inf"), {})  # (read at, live records)

    def announcers(self, group: str, round_: int, fresh: bool = False) -> dict[str, dict]:
        """peer -> its announcement of the round, the furthest along of its posted and stored ones;
        withdrawn ones left out."""
        posted = self.wakes.posted(ANNOUNCE, group, round_)
        self._stranger = self._stranger or bool(posted.keys() - self._records[1].keys() - {self.control.identity.peer_id})
        if fresh or self.wakes.dht_due(ANNOUNCE, group, round_):
            return merge_announcements(self.control.announcers(group, round_), posted)
        return merge_announcements(posted)

    def manifests(self, group: str, round_: int, fresh: bool = False) -> dict[str, dict]:
        """writer -> its manifest of the round, posted or stored."""
        posted = self.wakes.posted(MANIFEST, group, round_)
        out = self.control.parse_manifests(posted) if posted else {}
        if fresh or self.wakes.dht_due(MANIFEST, group, round_):
            out = {**out, **self.control.manifests(group, round_)}
        return out

    def votes(self, group: str, round_: int, voters=frozenset(), fresh: bool = False) -> dict[str, str]:
        """peer -> its φ hash of the round, posted or stored: the DHT is not read once every one of
        ``voters`` posted its vote, and otherwise at its poll (or now: ``fresh``)."""
        posted = {p: v["hash"] for p, v in self.wakes.posted(VOTE, group, round_).items()
                  if isinstance(v.get("hash"), str)}
        if voters and set(voters) <= posted.keys():
            return posted
        if fresh or self.wakes.dht_due(VOTE, group, round_):
            return {**posted, **self.control.phi_hashes(group, round_)}
        return posted

    def live(self, cached: bool = False, fresh: bool = False) -> dict[str, PeerRecord]:
        """The live peer records, read again once older than ``records_s`` (a round's looks share one read);
        ``cached``: the last ones read, whatever their age (read now only if none were); ``fresh``: read
        again once older than a poll (a quorum's count, which waits for a killed member's record to expire)."""
        age = time.monotonic() - self._records[0]
        poll = max(self.wakes.poll_s, self.wakes.dht_poll_s)
        if age >= (poll if fresh or self._stranger else max(poll, self.records_s)) and not (cached and age < float("inf")):
            self._records = (time.monotonic(), self.control.live_peers())
            self._stranger = False
        return self._records[1]
