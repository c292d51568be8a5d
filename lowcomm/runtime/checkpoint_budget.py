"""The share of the swarm's wire the coordinator's checkpoint downloads may take (`checkpoint.max_share`).

A checkpoint is a download of the whole state from one peer, and its spacing (`checkpoint.every_s`)
is a time: where the link is the bound, the same model's state is a larger part of what a run moves,
and a slower run fits more downloads into the same rounds. So a download is due only once it keeps
the checkpoints' bytes within ``max_share`` of every byte of the run:

    downloaded + next <= max_share * (sent + downloaded + next)

``sent``: the sum of what the peers say they sent in their stats, pulled from them
(transport.stats_pulls; the data plane's bytes, checkpoints not among them). A peer's figure counts
at its largest seen, so a peer that left keeps its part. ``next``: the last download's size, or the
model's fp32 parameters before the first. The stats are a stranger's claim: a peer that inflates
them makes the downloads come sooner, never sooner than `checkpoint.every_s` apart; one that shrinks
its own only delays them. They are read when a download would otherwise be due, and again when the
swarm, at the rate it sent since the last read, should have sent enough (at least `STATS_READ_S`
apart).
"""

from __future__ import annotations

import time
from collections.abc import Callable

STATS_READ_S = 30.0  # the least time between two reads (each pulls every live peer's stats)
MAX_PEERS = 100_000  # peers whose largest figure is remembered


class CheckpointBudget:
    def __init__(self, max_share: float, read_stats: Callable[[], dict[str, dict]],
                 admits: Callable[[str], bool] = lambda peer_id: True, first_bytes: int = 0,
                 most_wait_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        """``read_stats``: peer_id -> its checked stats (ControlPlane.live_stats); ``first_bytes``: the
        expected size of the first download; ``most_wait_s``: the longest a projection defers a read."""
        self.max_share, self.read_stats, self.admits = max_share, read_stats, admits
        self.next_bytes, self.most_wait_s, self.clock = first_bytes, most_wait_s, clock
        self.downloaded = 0
        self.sent: dict[str, int] = {}  # peer_id -> the largest `sent` it claimed
        self._read_at: float | None = None
        self._read_sent = 0  # the swarm's `sent` at that read
        self._next_read = float("-inf")

    def swarm_sent(self) -> int:
        return sum(self.sent.values())

    def needed(self) -> int:
        """The swarm's `sent` at which the next download fits."""
        if self.max_share <= 0:
            return 0
        spend = self.downloaded + self.next_bytes
        return max(0, int(spend / self.max_share) - spend)

    def allows(self) -> bool:
        """Whether a download fits now: the stats are read at most when a read could change the answer."""
        if self.max_share <= 0 or self.swarm_sent() >= self.needed():
            return True
        now = self.clock()
        if now < self._next_read:
            return False
        self._take(self.read_stats())
        sent, needed = self.swarm_sent(), self.needed()
        if sent >= needed:
            return True
        rate = (sent - self._read_sent) / (now - self._read_at) if self._read_at is not None and now > self._read_at \
            else 0.0
        wait = (needed - sent) / rate if rate > 0 else STATS_READ_S
        self._read_at, self._read_sent = now, sent
        self._next_read = now + min(self.most_wait_s, max(STATS_READ_S, wait))
        return False

    def spent(self, nbytes: int) -> None:
        """A download of ``nbytes`` was made: it counts, and sizes the next one."""
        self.downloaded += nbytes
        self.next_bytes = nbytes

    def _take(self, stats: dict[str, dict]) -> None:
        for peer_id, figures in stats.items():
            if not self.admits(peer_id):
                continue
            sent = int(figures.get("sent", 0))
            if peer_id in self.sent or len(self.sent) < MAX_PEERS:
                self.sent[peer_id] = max(self.sent.get(peer_id, 0), sent)
