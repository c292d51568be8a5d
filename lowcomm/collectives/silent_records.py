"""Whom a round's gather does not wait for: live records that missed a round and stayed silent.

A live record that did not announce the last round it was due in is not waited for again while its peer
stays silent (docs/round-protocol.md, Decisions 32, 45 and 47): it posted no announcement of a round since,
and its record is unchanged (state and round). A dead peer's record until it expires, a cut-off peer's from
before the cut and a forged one that is only refreshed cost one wait, not one per round. A changed record
makes a peer due again, since a slow peer's record names its next round, but only for a peer this agreement
has seen take part (announcing a round, or named in a manifest it learnt) or one that missed fewer than
STRIKES rounds: a forged record that names each next round and never announces (a sybil's) costs two waits,
not one per round. A posted announcement, or a learnt manifest naming the peer, always makes it due again.
An unchanged record says so only when read after the miss: the records a round's looks share may be older
(Decision 53), so a gather that would pass over a peer on the read its miss was judged on reads them again.
"""

from __future__ import annotations

from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import ANNOUNCE
from lowcomm.transport.wakeups import Wakes

SILENT_LOOKBACK = 8  # rounds of posted announcements that show a peer that missed a round is still there
STRIKES = 2  # rounds a never-seen peer misses before a changed record no longer makes it due again

Missed = tuple[int, str, int, int]  # the last round missed, the record's state and round then, rounds missed


class SilentRecords:
    """Per group: the peers that missed a round they were due in, and the peers seen taking part."""

    def __init__(self, wakes: Wakes):
        self.wakes = wakes  # its posted announcements (read at each look: a test may swap `posted`)
        self._missed: dict[str, dict[str, Missed]] = {}
        self._judged_on: dict[str, dict[str, float]] = {}  # per group: peer -> when the read its miss saw was made
        self._seen: dict[str, set[str]] = {}

    def named(self, group: str, round_: int, members) -> None:
        """A manifest starting at ``round_`` names ``members``: each took part, and is due again."""
        missed = self._missed.get(group, {})
        self._missed[group] = {p: m for p, m in missed.items() if p not in members or m[0] > round_}
        self._seen.setdefault(group, set()).update(members)

    def silent(self, group: str, round_: int, due: set[str], records: dict[str, PeerRecord]) -> set[str]:
        """The peers of ``due`` not to wait for in ``round_``."""
        missed = self._missed.get(group, {})
        return {p for p in due & missed.keys() if self._silent(group, round_, p, missed[p], records[p])}

    def stale(self, group: str, peers: set[str], read_at: float) -> bool:
        """Whether the records read at ``read_at`` are the ones a miss of one of ``peers`` was judged on (or
        older): they cannot show its record changed since."""
        judged = self._judged_on.get(group, {})
        return any(judged.get(p, float("-inf")) >= read_at for p in peers)

    def close(self, group: str, round_: int, records: dict[str, PeerRecord], announcers, missing,
              read_at: float = float("-inf")) -> None:
        """A gather of ``round_`` ended on the ``records`` read at ``read_at``: ``missing`` (due peers that
        did not announce) missed it; a peer that announced leaves the misses; one whose record is gone is
        forgotten."""
        missed, seen = self._missed.get(group, {}), self._seen.setdefault(group, set())
        seen.intersection_update(records.keys())
        seen.update(announcers)
        kept = {p: m for p, m in missed.items() if p in records and p not in announcers}
        self._missed[group] = {**kept, **{p: (round_, records[p].state, records[p].round,
                                              min(missed[p][3] + 1, STRIKES) if p in missed else 1)
                                          for p in missing}}
        judged = self._judged_on.get(group, {})
        self._judged_on[group] = {**{p: t for p, t in judged.items() if p in kept}, **{p: read_at for p in missing}}

    def _silent(self, group: str, round_: int, peer: str, missed: Missed, record: PeerRecord) -> bool:
        since, state, at, strikes = missed
        trusted_change = strikes < STRIKES or peer in self._seen.get(group, ())
        if trusted_change and (record.state, record.round) != (state, at):
            return False
        return not any(peer in self.wakes.posted(ANNOUNCE, group, r)
                       for r in range(max(since, round_ - SILENT_LOOKBACK), round_ + 1))
