"""Which pipeline stage calls a stage peer serves: signed ones, for its run, from a peer of the run.

A StageBackward runs an optimizer step's worth of gradient on the serving replica, so a stranger's
call would train the stage on the stranger's objective. Every call is signed by its driver's key
(transport.signing) and its sender must hold a live record of the run (any state: a driver's
record moves through parked, joining and training while it places itself) and be admitted by the
run's mode (runtime.admission). The set of such peers is read from the DHT at most every
`refresh_s`, and once more, at most every `MISS_REFRESH_S`, when an unknown sender appears (a peer
that joined since): a flood of unknown senders costs one DHT read per `MISS_REFRESH_S`, not one per
call. A refused call is a `reject` event, reported here with its sender (the gRPC service counts a
`Refused` call no second time). A signed call from a sender not in the last read is answered RETRY:
the sender may have joined since, and a call `MISS_REFRESH_S` later is checked against a new read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from lowcomm.transport.service import Refused
from lowcomm.transport.signing import Unauthenticated, Verifier, verify_message

MISS_REFRESH_S = 0.25


class StageCallRefused(Refused):
    """A stage call this peer does not serve (the message goes back to the caller)."""


class UnknownSender(StageCallRefused):
    """A signed call from a peer this peer's last DHT read does not hold: it may have joined since."""

    retry = True


class StageCallGuard:
    def __init__(self, run: str, members: Callable[[], set[str]], refresh_s: float,
                 on_event: Callable[..., None], admits: Callable[[str], bool] = lambda peer_id: True):
        """``members()``: the ids of the run's peers that serve or drive a stage (a DHT read);
        ``admits(peer_id)``: whether the run's mode lets that peer take part (runtime.admission)."""
        self.run, self.members, self.refresh_s, self.on_event = run, members, refresh_s, on_event
        self.admits = admits
        self.verifier = Verifier()
        self._known: set[str] = set()
        self._read_at = -float("inf")
        self._reading = False
        self._lock = threading.Lock()

    def __call__(self, method: str, call) -> None:
        try:
            if call.run_id != self.run:
                raise StageCallRefused(f"stage call for run {call.run_id[:80]!r}, this peer serves {self.run!r}")
            try:
                verify_message(self.verifier, method, call)
            except Unauthenticated as e:
                raise StageCallRefused(str(e)) from None
            if call.sender not in self._peers(call.sender):
                raise UnknownSender(f"{call.sender[:40]!r} is not a peer of run {self.run!r} as this peer last read "
                                    f"the DHT; it reads again within {MISS_REFRESH_S} s: retry")
            if not self.admits(call.sender):
                raise StageCallRefused(f"{call.sender[:40]!r} is not admitted to run {self.run!r} (its run.mode)")
        except StageCallRefused as e:
            self.on_event("reject", method=method, sender=call.sender[:40], error=str(e)[:200])
            raise

    def _peers(self, sender: str) -> set[str]:
        """The run's stage peers as last read; read again (outside the lock) when due."""
        with self._lock:
            age = time.monotonic() - self._read_at
            due = not self._reading and (age >= self.refresh_s or (sender not in self._known and age >= MISS_REFRESH_S))
            if not due:
                return self._known
            self._reading, self._read_at = True, time.monotonic()
        try:
            fresh = set(self.members())
        except Exception:  # the DHT did not answer: keep what was known
            fresh = None
        with self._lock:
            self._reading = False
            if fresh is not None:
                self._known = fresh
            return self._known
