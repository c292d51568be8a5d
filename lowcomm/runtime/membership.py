"""A peer's presence in the run: its DHT record, the heartbeat that refreshes it, announcing ahead, leaving.

The record (transport.control.PeerRecord) says where the peer listens, what it does (`parked`,
`joining`, `training`, `leaving`), its round, step and throughput; ``fill(record)`` (the owner's
callback) refreshes the numbers before each publication. The stats its records add up to
(runtime.peer_stats) are pulled from its data plane by whoever reads them (transport.stats_pulls,
Decision 60); a peer in client mode, which nobody can dial, stores them in the DHT instead, every
STATS_EVERY heartbeats' time on a thread of its own, under their own key. A record expires
`sync.record_ttl_s` after its last heartbeat, so a killed peer vanishes by itself; a peer that
leaves expires it at once and withdraws the round it announced ahead, so that round's leader need not wait for it.

With ``quiet`` (the data-parallel peers: nobody acts on their step, loss or throughput, only on where
they are, what they do and whether they are past the run's first round) a heartbeat stores the record
only when a field others act on changed (`acted_on`) or half its lifetime passed since it was last
stored; the round it holds and the status pages' numbers are then up to that old. A round's agreement
learns who reached it from the posted announcements, so a record is not stored at every round
(Decision 58): a due peer's record may name an older round, which keeps it due all the same. Stage
peers (quiet off) store every heartbeat: their routes weigh the throughput and count the steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lowcomm.collectives.base import Collective, GroupKey
from lowcomm.runtime.context import PeerContext
from lowcomm.transport.control import PeerRecord

logger = logging.getLogger(__name__)
START_BARRIER_S = 3600.0
STATS_EVERY = 15  # heartbeats between two publications of the stats (30 s at the default heartbeat_s)


class Membership:
    def __init__(self, ctx: PeerContext, record: PeerRecord, fill: Callable[[PeerRecord], None] = lambda r: None,
                 quiet: bool = False):
        self.ctx = ctx
        self.quiet = quiet
        self._stored: tuple[float, tuple] = (float("-inf"), ())  # (when, acted_on) of the last record stored
        self.record = record
        record.token = ctx.options.token or ""  # token runs: every peer checks it before counting this one
        record.link = str(ctx.options.link) if ctx.options.link is not None else ""
        self.fill = fill
        self.announced = -1  # the last round announced ahead of its start (withdrawn if the peer leaves)
        self._collective: Collective | None = None
        self._key: GroupKey | None = None
        self._stop = threading.Event()

    def start_heartbeat(self) -> None:
        """The record every heartbeat and, in client mode, the stats every STATS_EVERY-th, each on a thread
        of its own: a stats store held up by a DHT node that does not answer never delays the record's refresh."""
        every = self.ctx.config.sync.heartbeat_s

        def beat():
            while not self._stop.wait(every):
                self.publish(beat=True)

        def stats():
            self.publish_stats()
            while not self._stop.wait(every * STATS_EVERY):
                self.publish_stats()
        self.publish()
        threading.Thread(target=beat, daemon=True, name="heartbeat").start()
        if self.record.client_mode:  # the others pull theirs (transport.stats_pulls)
            threading.Thread(target=stats, daemon=True, name="stats").start()

    def publish(self, beat: bool = False) -> None:
        """Stores the record; a quiet peer's heartbeat (``beat``) only when it must (the module says when)."""
        ttl = self.ctx.config.sync.record_ttl_s
        try:
            self.fill(self.record)
            now, seen = time.monotonic(), acted_on(self.record)
            if beat and self.quiet and seen == self._stored[1] and now - self._stored[0] < ttl / 2:
                return
            self.ctx.control.publish_peer(self.record, ttl)
            self._stored = (now, seen)
        except Exception as e:  # a heartbeat must never kill training
            logger.warning("heartbeat failed: %s", e)

    def publish_stats(self) -> None:
        sync = self.ctx.config.sync
        try:
            self.ctx.control.publish_stats(self.ctx.stats.summary(), 3 * STATS_EVERY * sync.heartbeat_s)
        except Exception as e:  # status pages only: never a reason to stop
            logger.info("could not publish the stats: %s", e)

    def set(self, **fields) -> None:
        """Updates record fields and publishes at once (a state change others must see now); a change of
        ``state`` is also a `state` event."""
        changed = "state" in fields and fields["state"] != self.record.state
        for name, value in fields.items():
            setattr(self.record, name, value)
        self.publish()
        if changed:
            self.ctx.log.event("state", state=self.record.state, round=self.record.round)

    def announce_ahead(self, collective: Collective, key: GroupKey, round_: int) -> None:
        collective.announce_ahead(key, round_)
        self.announced, self._collective, self._key = round_, collective, key

    def leave(self, current_round: int) -> None:
        """Stops the heartbeat, expires the record and withdraws an announcement of a round not yet run."""
        self._stop.set()
        try:
            self.record.state = "leaving"
            self.ctx.control.expire_peer(self.ctx.config.sync.record_ttl_s)
            if self._collective is not None and self.announced >= current_round:
                self._collective.withdraw_ahead(self._key, self.announced)  # its leader need not wait for us
        except Exception as e:
            logger.info("could not expire the peer record: %s", e)

    def wait_for_start(self) -> None:
        """Parks a simulated peer, fully started, until the launcher releases all peers at once."""
        start_file = self.ctx.options.start_file
        if start_file is None:
            return
        self.ctx.log.event("ready")
        deadline = time.monotonic() + START_BARRIER_S
        while not start_file.exists() and not self.ctx.stop.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError(f"start barrier {start_file} never appeared")
            self.ctx.stop.wait(0.05)
        self.set(state="joining")  # at once: the first round waits for every peer whose record is due


def acted_on(record: PeerRecord) -> tuple:
    """The fields of a record other peers and the coordinator act on at once: where it is, what it does,
    and whether it left round 0 (a joiner that sees only round-0 records starts from φ_0 instead of
    downloading the state: runtime.state_sync)."""
    return (record.endpoint, record.state, record.round > 0, record.client_mode, record.stage, record.stage_state,
            record.rollback_to, record.rollback_at, record.token, record.device, record.link)
