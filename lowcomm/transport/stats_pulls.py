"""A peer's stats pulled from its data plane (`PeerService.GetPost`, kind `stats`; Decision 60).

What a peer has done so far (runtime.peer_stats: tokens, bytes, the rounds it contributed to, rejects,
resyncs, its last round) is read by status pages (runtime.observer) and by the coordinator's checkpoint
budget (runtime.checkpoint_budget); training never reads it. So a peer does not store it in the DHT for
readers that may never come: a reader asks each peer it can dial for its stats when it needs them, and
the peer answers with them signed by its key. A peer others cannot dial (client mode) still stores its
stats in the DHT (`RUN.stats`, transport.control), and a reader reads that key only for such peers.

An answer is a round post (transport.round_posts) of kind STATS, group "" and round 0: kept only if its
sender is the peer asked, its writer's signature and record check out (`checked_record`) and the stats
pass `clean_stats`; anything else is refused and counted (`on_reject`). A stats post is never pushed
(`RoundPosts.accept` refuses one). The writer signs anew at most once per SIGN_EVERY_S, so a flood of
pulls costs it one signature a second.

Bounded: at most MAX_PULLS peers per read (the rest are left out), PULL_THREADS at once, each within
PULL_TIMEOUT_S, an answer of at most round_posts.MAX_VALUE_BYTES of record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from lowcomm.proto import wire_pb2
from lowcomm.transport.record_fields import clean_stats
from lowcomm.transport.round_posts import STATS, PostRefused, checked_record, post_request
from lowcomm.transport.signing import Signer, Verifier
from lowcomm.transport.wire import Channels, Traffic, deadline_after

logger = logging.getLogger(__name__)
PULL_TIMEOUT_S = 2.0
PULL_THREADS = 16
MAX_PULLS = 1000  # runtime.observer keeps at most this many peers
SIGN_EVERY_S = 1.0


class StatsPost:
    """A peer's answer to a stats pull: its current stats (``summary()``), signed, for its own run only."""

    def __init__(self, signer: Signer, run: str, summary: Callable[[], dict],
                 clock: Callable[[], float] = time.monotonic):
        self.signer, self.run, self.summary, self.clock = signer, run, summary, clock
        self._lock = threading.Lock()
        self._signed: tuple[float, wire_pb2.WakeRequest] | None = None

    def __call__(self, run: str) -> wire_pb2.WakeRequest | None:
        if run != self.run:
            return None
        with self._lock:
            now = self.clock()
            if self._signed is None or now - self._signed[0] >= SIGN_EVERY_S:
                value = {"peer_id": self.signer.peer_id, "stats": self.summary()}
                self._signed = (now, post_request(self.signer, self.run, STATS, "", 0, value))
            return self._signed[1]


def checked_stats(verifier: Verifier, run: str, asked: str, reply: wire_pb2.WakeRequest) -> dict:
    """The stats in ``reply`` to a pull from ``asked``, cleaned (record_fields.clean_stats); PostRefused
    unless the reply is ``asked``'s own signed stats post of this run."""
    if (reply.sender, reply.kind, reply.group, reply.round) != (asked, STATS, "", 0):
        raise PostRefused(f"asked {asked[:40]} for its stats, got {reply.sender[:40]}'s {reply.kind[:32]} post "
                          f"of round {reply.round}")
    value = checked_record(verifier, run, reply)
    try:
        return clean_stats(value.get("stats"))
    except ValueError as e:
        raise PostRefused(str(e)) from None


class LiveStats:
    """peer id -> its checked stats, for the live peer records given: pulled from the peers that can be
    dialled, read from the DHT (``control.live_stats``) for those in client mode, when there are any."""

    def __init__(self, control, channels: Channels, traffic: Traffic,
                 on_reject: Callable[[str, str], None] = lambda peer_id, reason: None):
        """``control``: a transport.control.ControlPlane (its run, and its stats key for client-mode peers)."""
        self.control, self.channels, self.traffic, self.on_reject = control, channels, traffic, on_reject
        self.verifier = Verifier()
        self.pulls = 0  # pulls asked, in all
        self.refused = 0  # answers refused, in all

    def __call__(self, records: dict) -> dict[str, dict]:
        """``records``: peer id -> PeerRecord (ControlPlane.live_peers)."""
        dialled = {peer_id: r.endpoint for peer_id, r in sorted(records.items())
                   if r.endpoint and not r.client_mode}
        out = self._pull(dict(list(dialled.items())[:MAX_PULLS]))
        if any(r.client_mode for r in records.values()):
            out.update({peer_id: stats for peer_id, stats in self.control.live_stats().items()
                        if peer_id in records and records[peer_id].client_mode})
        return out

    def _pull(self, asked: dict[str, str]) -> dict[str, dict]:
        if not asked:
            return {}
        request = wire_pb2.PostRequest(run=self.control.run, group="", round=0, kind=STATS)

        def pull(peer_id: str) -> tuple[str, dict] | None:
            deadline = deadline_after(PULL_TIMEOUT_S)
            try:
                self.traffic.count_sent(request, deadline)
                reply = self.channels.stub(asked[peer_id]).GetPost(request, timeout=PULL_TIMEOUT_S)
                self.traffic.count_received(reply, deadline)
            except grpc.RpcError as e:
                logger.debug("pulling %s's stats failed: %s", peer_id[:20], e.code())
                return None
            if not reply.sender:
                return None  # it serves none (a coordinator, a peer that holds no stats)
            try:
                return peer_id, checked_stats(self.verifier, self.control.run, peer_id, reply)
            except PostRefused as e:
                self.refused += 1
                logger.info("refused %s's stats: %s", peer_id[:40], e)
                self.on_reject(peer_id, "refused stats")
                return None

        self.pulls += len(asked)
        with ThreadPoolExecutor(max_workers=min(PULL_THREADS, len(asked)), thread_name_prefix="stats") as pool:
            return dict(answer for answer in pool.map(pull, asked) if answer is not None)
