"""Wake hints: a peer that changed a round's DHT records tells the peers waiting on them to read now.

Agreement (collectives.manifest) reads the DHT when it is woken, and otherwise every
`FALLBACK_POLL_S`: a writer sends a `Wake(group, round)` to the peers that wait on what it wrote
(its announcement, its manifest), so a round settles as fast as the records travel while an idle
wait costs a DHT read per `FALLBACK_POLL_S`, not one per 50 ms.

A wake proves nothing and carries nothing the receiver uses but the (group, round) it names; the
records it points at are signed and checked when read. So a stranger's wakes cost at most extra DHT
reads, and `Wakeups.wait` bounds those: it returns early at most once per `MIN_READ_S`. A wake for
a round nobody here waits on is dropped, so wakes hold no memory. A peer out of reach (behind a
NAT, a client-mode peer, a dead one) only loses the hint: it finds the records at its next poll.

With round posts (transport.round_posts) the wake carries the record itself, signed: a writer posts
its announcement or manifest to the peers that wait on it, agreement reads the posts at each wake,
and the DHT only every `POSTED_DHT_POLL_S` (`Wakes.dht_due`) and before it decides without a peer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from lowcomm.proto import wire_pb2
from lowcomm.transport.post_pulls import pull_posts
from lowcomm.transport.round_posts import RoundPosts, post_request
from lowcomm.transport.signing import Signer
from lowcomm.transport.wire import Channels, Traffic, deadline_after

logger = logging.getLogger(__name__)
FALLBACK_POLL_S = 0.5  # how often a waiter reads the DHT when nobody wakes it
MIN_READ_S = 0.05  # a waiter reads at most this often, however many wakes come (the old poll's rate)
WAKE_TIMEOUT_S = 1.0  # one wake call; a peer that does not answer in time only loses the hint
MAX_GROUP_CHARS = 256
MAX_PENDING_WAKES = 256  # wakes queued to send at once; beyond that one is dropped (the poll covers it)
MAX_QUEUED_PER_PEER = 16  # of those, waiting for one peer while a call to it is in flight
WAKE_BACKOFF_S = 2.0  # after a call to a peer timed out, what is sent to it this long fails at once (POSTED_DHT_POLL_S)
FAILED_PEERS_KEPT = 1024  # the peers whose last timed-out call is remembered
# a call that held a thread for all of WAKE_TIMEOUT_S; a refusal is an answer, and a refused connection (UNAVAILABLE)
# costs no wait and may be a busy peer's, so neither starts the backoff
_UNREACHED = (grpc.StatusCode.DEADLINE_EXCEEDED,)
POSTED_DHT_POLL_S = 2.0  # with round posts: how often a waiter reads the round's records from the DHT too
DHT_READS_KEPT = 64  # the records (kind, group, round) whose last DHT read is remembered


class Wakeups:
    """The (group, round) pairs this peer waits on, and the wakes that came for them."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: dict[tuple[str, int], int] = {}  # (group, round) -> waiters
        self._woken: set[tuple[str, int]] = set()
        self.received = 0  # wakes for a round this peer waited on

    def notify(self, group: str, round_: int) -> bool:
        """Marks a wake for (group, round); False (dropped) when nobody here waits on it."""
        key = (group, int(round_))
        with self._cond:
            if key not in self._waiting:
                return False
            self.received += 1
            self._woken.add(key)
            self._cond.notify_all()
            return True

    def wait(self, group: str, round_: int, timeout: float) -> bool:
        """Waits up to ``timeout`` for a wake of (group, round) (at least MIN_READ_S: a flood of wakes
        costs one read per MIN_READ_S); True when woken. Call between reads of the round's records,
        inside ``watching`` so that a wake that comes during a read is not lost."""
        key = (group, int(round_))
        start = time.monotonic()
        deadline = start + max(timeout, MIN_READ_S)
        with self._cond:
            while True:
                now = time.monotonic()
                if key in self._woken and now - start >= MIN_READ_S:
                    self._woken.discard(key)
                    return True
                if now >= deadline:
                    return False
                wake_at = deadline if key not in self._woken else start + MIN_READ_S
                self._cond.wait(max(0.0, min(deadline, wake_at) - now))

    def watching(self, group: str, round_: int) -> "_Watch":
        """A context in which wakes of (group, round) are kept for ``wait`` (outside one they are dropped)."""
        return _Watch(self, (group, int(round_)))

    def _enter(self, key: tuple[str, int]) -> None:
        with self._cond:
            self._waiting[key] = self._waiting.get(key, 0) + 1

    def _exit(self, key: tuple[str, int]) -> None:
        with self._cond:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
                self._woken.discard(key)


class _Watch:
    def __init__(self, wakeups: Wakeups, key: tuple[str, int]):
        self.wakeups, self.key = wakeups, key

    def __enter__(self) -> "_Watch":
        self.wakeups._enter(self.key)
        return self

    def __exit__(self, *exc) -> None:
        self.wakeups._exit(self.key)


def valid_wake(request) -> str | None:
    """Why a Wake request is refused; None when it is well-formed."""
    if len(request.group) > MAX_GROUP_CHARS or not request.group.isprintable():
        return f"a wake's group is not a printable name of at most {MAX_GROUP_CHARS} characters"
    return None


class WakeSender:
    """Sends wakes and posts in the background: fire and forget, a few at a time, each bounded by
    WAKE_TIMEOUT_S. One call at a time goes to a peer (the rest wait in its queue of at most
    MAX_QUEUED_PER_PEER, taking turns with other peers' in the pool), and after a call to it timed
    out, what is sent to it for ``backoff_s`` fails at once: a peer that does not answer (cut off, a
    stranger's endpoint that never replies) costs one timeout and one of the pool's threads, not one
    per post, and does not hold back the posts to the peers that answer."""

    def __init__(self, channels: Channels, traffic: Traffic, threads: int = 4, backoff_s: float = WAKE_BACKOFF_S):
        self.channels, self.traffic, self.backoff_s = channels, traffic, backoff_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wake")
        self._lock = threading.Lock()
        self._queues: dict[str, deque] = {}  # endpoint -> what waits for its call in flight
        self._failed_at: OrderedDict[str, float] = OrderedDict()  # endpoint -> when a call to it last timed out
        self._pending = 0  # queued or in flight, bounded by MAX_PENDING_WAKES
        self._closed = False
        self.sent = self.failed = self.dropped = 0  # dropped: never sent (the bounds, or the backoff)

    def wake(self, endpoints, group: str, round_: int) -> None:
        """Wakes the peers at ``endpoints`` (those that are not strings, or empty, are skipped)."""
        self.send(endpoints, wire_pb2.WakeRequest(group=group, round=round_))

    def send(self, endpoints, request: wire_pb2.WakeRequest, on_failed: Callable[[], None] | None = None) -> None:
        """Sends ``request`` (a bare wake or a round post) to the peers at ``endpoints``; ``on_failed()`` runs
        once (on a thread of its own) if it did not reach one of them: refused, timed out or dropped."""
        failure = _OnceFailed(on_failed)
        for endpoint in {e for e in endpoints if isinstance(e, str) and e}:
            with self._lock:
                start = self._admit(endpoint, request, failure)
                if start is None:
                    self.dropped += 1
            if start is None:
                failure()
            elif start and not self._submit(endpoint, request, failure):
                return

    def _admit(self, endpoint: str, request, failure) -> bool | None:
        """Under the lock: True to call ``endpoint`` now, False when queued behind its call in flight,
        None when dropped."""
        failed_at = self._failed_at.get(endpoint)
        if self._closed or (failed_at is not None and time.monotonic() - failed_at < self.backoff_s):
            return None
        queue = self._queues.get(endpoint)
        if self._pending >= MAX_PENDING_WAKES or (queue is not None and len(queue) >= MAX_QUEUED_PER_PEER):
            return None
        self._pending += 1
        if queue is None:
            self._queues[endpoint] = deque()
            return True
        queue.append((request, failure))
        return False

    def _submit(self, endpoint: str, request, failure) -> bool:
        try:
            self._pool.submit(self._send, endpoint, request, failure)
            return True
        except RuntimeError:  # shut down (or no thread could start: the call was queued all the same)
            with self._lock:
                if not self._closed:
                    return True
                self._pending -= 1 + len(self._queues.pop(endpoint, ()))
            return False

    def _send(self, endpoint: str, request: wire_pb2.WakeRequest, failure: "_OnceFailed") -> None:
        deadline = deadline_after(WAKE_TIMEOUT_S)
        outcome = "refused"
        try:
            self.traffic.count_sent(request, deadline)
            reply = self.channels.stub(endpoint).Wake(request, timeout=WAKE_TIMEOUT_S)
            self.traffic.count_received(reply, deadline)
            outcome = "sent"
        except grpc.RpcError as e:
            logger.debug("wake to %s failed: %s", endpoint, e.code())
            if e.code() in _UNREACHED:
                outcome = "unreached"
        except Exception as e:  # a closed channel at shutdown: the hint is lost, nothing else
            logger.debug("wake to %s failed: %s", endpoint, e)
        finally:
            dropped = self._next(endpoint, outcome)
        if outcome != "sent":
            failure()
        for _, queued_failure in dropped:
            queued_failure()

    def _next(self, endpoint: str, outcome: str) -> list:
        """Counts the call and submits the endpoint's next post, at the back of the pool's queue (peers take
        turns). A peer whose call timed out is not called for ``backoff_s``: what is queued for it is
        returned, dropped (the caller runs their fallbacks)."""
        with self._lock:
            self._pending -= 1
            if outcome == "sent":
                self.sent += 1
            else:
                self.failed += 1
            if outcome == "unreached":
                self._failed_at[endpoint] = time.monotonic()
                self._failed_at.move_to_end(endpoint)
                while len(self._failed_at) > FAILED_PEERS_KEPT:
                    self._failed_at.popitem(last=False)
            else:
                self._failed_at.pop(endpoint, None)
            queue = self._queues.get(endpoint, deque())
            dropped = list(queue) if outcome == "unreached" else []
            if dropped:
                queue.clear()
                self._pending -= len(dropped)
                self.dropped += len(dropped)
            upcoming = queue.popleft() if queue else None
            if upcoming is None:
                self._queues.pop(endpoint, None)
        if upcoming is not None:
            self._submit(endpoint, *upcoming)
        return dropped

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


class _OnceFailed:
    """Runs a send's ``on_failed`` once, on a daemon thread (it may be a DHT store, seconds long)."""

    def __init__(self, on_failed: Callable[[], None] | None):
        self._on_failed, self._lock = on_failed, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            run, self._on_failed = self._on_failed, None
        if run is not None:
            try:
                threading.Thread(target=_logged, args=(run,), daemon=True, name="post-fallback").start()
            except RuntimeError as e:  # no thread to be had: the record is lost to the peers the post missed
                logger.info("could not start a post's fallback: %s", e)


def _logged(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception as e:  # a DHT out of reach: the record is lost to the peers the post missed
        logger.info("storing a post that did not arrive failed: %s", e)


class Wakes:
    """What agreement uses: wait on a round (woken, else every ``poll_s``), wake others on it, and with
    ``posts`` post its records to them and read theirs (``dht_poll_s``: how often the DHT is read as
    well; 0 or less: at every look, as a peer that others cannot reach must)."""

    def __init__(self, wakeups: Wakeups | None, sender: WakeSender | None, poll_s: float = FALLBACK_POLL_S,
                 posts: RoundPosts | None = None, signer: Signer | None = None,
                 dht_poll_s: float = POSTED_DHT_POLL_S):
        self.wakeups, self.sender, self.poll_s = wakeups, sender, poll_s
        self.posts, self.signer = posts, signer
        self.dht_poll_s = dht_poll_s if posts is not None else poll_s  # without posts every look reads the DHT
        self._dht_reads: OrderedDict[tuple, float] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def polling(cls, poll_s: float) -> "Wakes":
        """No wakes: every wait is a plain ``poll_s`` pause (a control plane without a peer service)."""
        return cls(None, None, poll_s)

    def watching(self, group: str, round_: int):
        return self.wakeups.watching(group, round_) if self.wakeups is not None else contextlib.nullcontext()

    def wait(self, group: str, round_: int, timeout: float) -> bool:
        """Until a wake of the round, ``timeout`` or ``poll_s`` (the first of them); True when woken."""
        timeout = max(0.0, min(timeout, self.poll_s))
        if self.wakeups is None:
            time.sleep(timeout)
            return False
        return self.wakeups.wait(group, round_, timeout)

    def wake(self, endpoints, group: str, round_: int) -> None:
        if self.sender is not None:
            self.sender.wake(endpoints, group, round_)

    def publish(self, endpoints, kind: str, group: str, round_: int, record: dict, store=None,
                posted_only: bool = False) -> None:
        """Makes this peer's round ``record`` known to the peers at ``endpoints``: posted (and kept among its
        own posts), then ``store()``d in the DHT, as the post arrives sooner; without posts, stored and then
        a bare wake (the woken read the DHT). ``posted_only``: stored only if a post did not arrive."""
        if not self.posting:
            if store is not None:
                store()
            self.wake(endpoints, group, round_)
            return
        self.posts.add(kind, group, round_, self.signer.peer_id, record)
        request = post_request(self.signer, self.posts.run, kind, group, round_, record)
        self.posts.keep_own(request)  # for a reader that pulls it (transport.post_pulls)
        fallback = store if posted_only and self.sender is not None else None
        if self.sender is not None:
            self.sender.send(endpoints, request, on_failed=fallback)
        if store is not None and fallback is None:
            store()

    def pull(self, kind: str, group: str, round_: int, writers: dict[str, str]) -> set[str]:
        """Asks ``writers`` (peer id -> endpoint) for their own posts of the round (transport.post_pulls);
        those kept, as if posted. Nothing without posts or a sender."""
        if not (self.posting and self.sender is not None and writers):
            return set()
        return pull_posts(self.sender.channels, self.sender.traffic, self.posts, kind, group, round_, writers)

    @property
    def posting(self) -> bool:
        """Whether this peer posts its round records (and takes others')."""
        return self.posts is not None and self.signer is not None

    def posted(self, kind: str, group: str, round_: int) -> dict[str, dict]:
        """writer -> the record of (kind, group, round) posted here ({} without posts)."""
        return self.posts.records(kind, group, round_) if self.posts is not None else {}

    def newcomers(self, since: float) -> set[str]:
        """The writers whose first post here came after ``since`` (time.monotonic; none without posts)."""
        return self.posts.newcomers(since) if self.posts is not None else set()

    def dht_due(self, kind: str, group: str, round_: int) -> bool:
        """Whether a look at these records reads the DHT too: always without posts (or with ``dht_poll_s``
        ≤ 0); with them once per ``dht_poll_s``, the first look a poll after the records' first look
        (their posts come first)."""
        if self.posts is None or self.dht_poll_s <= 0:
            return True
        key, now = (kind, group, int(round_)), time.monotonic()
        with self._lock:
            last = self._dht_reads.get(key)
            if last is not None and now - last < self.dht_poll_s:
                return False
            self._dht_reads[key] = now
            self._dht_reads.move_to_end(key)
            while len(self._dht_reads) > DHT_READS_KEPT:
                self._dht_reads.popitem(last=False)
            return last is not None
