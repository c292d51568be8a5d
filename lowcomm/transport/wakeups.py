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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from lowcomm.proto import wire_pb2
from lowcomm.transport.wire import Channels, Traffic, deadline_after

logger = logging.getLogger(__name__)
FALLBACK_POLL_S = 0.5  # how often a waiter reads the DHT when nobody wakes it
MIN_READ_S = 0.05  # a waiter reads at most this often, however many wakes come (the old poll's rate)
WAKE_TIMEOUT_S = 1.0  # one wake call; a peer that does not answer in time only loses the hint
MAX_GROUP_CHARS = 256
MAX_PENDING_WAKES = 256  # wakes queued to send at once; beyond that one is dropped (the poll covers it)


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
    """Sends wakes in the background: fire and forget, a few at a time, each bounded by WAKE_TIMEOUT_S."""

    def __init__(self, channels: Channels, traffic: Traffic, threads: int = 4):
        self.channels, self.traffic = channels, traffic
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wake")
        self._pending = threading.BoundedSemaphore(MAX_PENDING_WAKES)
        self.sent = self.failed = self.dropped = 0

    def wake(self, endpoints, group: str, round_: int) -> None:
        """Wakes the peers at ``endpoints`` (those that are not strings, or empty, are skipped)."""
        for endpoint in {e for e in endpoints if isinstance(e, str) and e}:
            if not self._pending.acquire(blocking=False):
                self.dropped += 1
                continue
            try:
                self._pool.submit(self._send, endpoint, group, round_)
            except RuntimeError:  # shut down
                self._pending.release()
                return

    def _send(self, endpoint: str, group: str, round_: int) -> None:
        request = wire_pb2.WakeRequest(group=group, round=round_)
        deadline = deadline_after(WAKE_TIMEOUT_S)
        try:
            self.traffic.count_sent(request, deadline)
            reply = self.channels.stub(endpoint).Wake(request, timeout=WAKE_TIMEOUT_S)
            self.traffic.count_received(reply, deadline)
            self.sent += 1
        except grpc.RpcError as e:
            self.failed += 1
            logger.debug("wake to %s failed: %s", endpoint, e.code())
        except Exception as e:  # a closed channel at shutdown: the hint is lost, nothing else
            self.failed += 1
            logger.debug("wake to %s failed: %s", endpoint, e)
        finally:
            self._pending.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Wakes:
    """What agreement uses: wait on a round (woken, else every ``poll_s``) and wake others on it."""

    def __init__(self, wakeups: Wakeups | None, sender: WakeSender | None, poll_s: float = FALLBACK_POLL_S):
        self.wakeups, self.sender, self.poll_s = wakeups, sender, poll_s

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
