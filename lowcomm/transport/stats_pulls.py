"""A peer's stats pulled from its data plane (`PeerService.GetPost`, kind `stats`; Decision 60).

What a peer has done so far (runtime.peer_stats: tokens, bytes, the rounds it contributed to, rejects,
resyncs, its last round) is read by status pages (runtime.observer) and by the coordinator's checkpoint
budget (runtime.checkpoint_budget); training never reads it. So a peer does not store it in the DHT for
readers that may never come: a reader asks each peer it can dial for its stats when it needs them, and
the peer answers with them signed by its key. A peer others cannot dial (client mode) still stores its
stats in the DHT (`RUN.stats`, transport.control), and a reader reads that key only for such peers.

An answer is a round post (transport.round_posts) of kind STATS, group "" and round 0: kept only if its
sender is a peer whose record names the endpoint asked, its writer's signature and record check out
(`checked_record`) and the stats pass `clean_stats`; anything else is refused and counted (`on_reject`). A stats post is never pushed
(`RoundPosts.accept` refuses one). The writer signs anew at most once per SIGN_EVERY_S, so a flood of
pulls costs it one signature a second.

Bounded: at most MAX_PULLS peers per read (the rest are left out), each endpoint once, the run's
admitted peers only, PULL_THREADS at once, each within PULL_TIMEOUT_S and all within READ_DEADLINE_S,
an answer of at most round_posts.MAX_VALUE_BYTES of record on channels of their own that carry at most
CHANNEL_BYTES a message, MAX_CHANNELS of them kept.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from lowcomm.proto import wire_pb2
from lowcomm.transport.post_pulls import get_post
from lowcomm.transport.record_fields import clean_stats
from lowcomm.transport.round_posts import STATS, PostRefused, checked_record, post_request
from lowcomm.transport.signing import Signer, Verifier
from lowcomm.transport.wire import Channels, Traffic

logger = logging.getLogger(__name__)
PULL_TIMEOUT_S = 2.0
READ_DEADLINE_S = 8.0  # a whole read: what has not answered by then is left out of it
PULL_THREADS = 16
MAX_PULLS = 1000  # runtime.observer keeps at most this many peers
MAX_CHANNELS = 1024  # the pulls' channels kept open, to the endpoints asked last
CHANNEL_BYTES = 1 << 20  # the largest message on those channels (an answer is at most MAX_VALUE_BYTES of record)
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


def checked_stats(verifier: Verifier, run: str, asked: set[str], reply: wire_pb2.WakeRequest) -> dict:
    """The stats in ``reply`` to a pull from an endpoint whose records name the peers ``asked``, cleaned
    (record_fields.clean_stats); PostRefused unless the reply is one of them's own signed stats post of
    this run."""
    if reply.sender not in asked or (reply.kind, reply.group, reply.round) != (STATS, "", 0):
        raise PostRefused(f"asked {len(asked)} peer(s) at an endpoint for their stats, got "
                          f"{reply.sender[:40]}'s {reply.kind[:32]} post of round {reply.round}")
    value = checked_record(verifier, run, reply)
    try:
        return clean_stats(value.get("stats"))
    except ValueError as e:
        raise PostRefused(str(e)) from None


class LiveStats:
    """peer id -> its checked stats, for the live peer records given: pulled from the peers that can be
    dialled, read from the DHT (``control.live_stats``) for those in client mode, when there are any.

    A read asks each endpoint once (the records naming one endpoint share its answer: it counts for the
    one whose peer signed it), the run's admitted peers only, MAX_PULLS endpoints, and ends by
    READ_DEADLINE_S whatever the endpoints do: a pull still running then is left out. Its channels are
    its own, with a small message cap, MAX_CHANNELS of them kept (the least recently used is closed)."""

    def __init__(self, control, traffic: Traffic, admits: Callable[[str], bool] = lambda peer_id: True,
                 on_reject: Callable[[str, str], None] = lambda peer_id, reason: None):
        """``control``: a transport.control.ControlPlane (its run, and its stats key for client-mode peers)."""
        self.control, self.traffic, self.admits, self.on_reject = control, traffic, admits, on_reject
        self.channels = Channels(CHANNEL_BYTES, max_channels=MAX_CHANNELS)
        self.verifier = Verifier()
        self._lock = threading.Lock()
        self.pulls = 0  # pulls asked, in all
        self.refused = 0  # answers refused, in all

    def __call__(self, records: dict) -> dict[str, dict]:
        """``records``: peer id -> PeerRecord (ControlPlane.live_peers)."""
        admitted = {peer_id: r for peer_id, r in sorted(records.items()) if self.admits(peer_id)}
        asked: dict[str, set[str]] = {}  # endpoint -> the peers whose records name it
        for peer_id, r in admitted.items():
            if r.endpoint and not r.client_mode and (r.endpoint in asked or len(asked) < MAX_PULLS):
                asked.setdefault(r.endpoint, set()).add(peer_id)
        out = self._pull(asked)
        if any(r.client_mode for r in admitted.values()):
            out.update({peer_id: stats for peer_id, stats in self.control.live_stats().items()
                        if peer_id in admitted and admitted[peer_id].client_mode})
        return out

    def close(self) -> None:
        self.channels.close()

    def _refuse(self, endpoint: str, reason: str) -> None:
        with self._lock:
            self.refused += 1
        logger.debug("refused the stats answered at %s: %s", endpoint[:80], reason[:200])
        self.on_reject(endpoint[:80], "refused stats")

    def _pull(self, asked: dict[str, set[str]]) -> dict[str, dict]:
        if not asked:
            return {}
        request = wire_pb2.PostRequest(run=self.control.run, group="", round=0, kind=STATS)

        def pull(endpoint: str) -> tuple[str, dict] | None:
            reply = get_post(self.channels, self.traffic, endpoint, request, PULL_TIMEOUT_S)
            if reply is None or not reply.sender:
                return None  # no answer, or it serves none (a coordinator, a peer that holds no stats)
            try:
                return reply.sender, checked_stats(self.verifier, self.control.run, asked[endpoint], reply)
            except PostRefused as e:
                self._refuse(endpoint, str(e))
            except Exception as e:  # anything else an answer makes the checks raise is the answer's fault
                self._refuse(endpoint, f"{type(e).__name__}: {e}")
            return None

        with self._lock:
            self.pulls += len(asked)
        pool = ThreadPoolExecutor(max_workers=min(PULL_THREADS, len(asked)), thread_name_prefix="stats")
        try:
            futures = [pool.submit(pull, endpoint) for endpoint in asked]
            done, _ = wait(futures, timeout=READ_DEADLINE_S)
            return dict(answer for answer in (f.result() for f in done) if answer is not None)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
