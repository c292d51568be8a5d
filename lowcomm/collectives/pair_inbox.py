"""A member's inbox for the pair exchange: contributions pushed to it, by round and sender, bounded.

A channel is one (run, group key). For each channel the inbox knows the newest round this member
*entered* (it enters a round before it announces for it) and the newest it *closed* (took its
result from). The rules, checked under one lock:

- **stale**: a round below the newest entered one, or one already closed, is refused;
- **future**: a round more than ``max_ahead`` past the newest entered one is refused (a partner
  sends only to the members of a round's manifest, and a member enters a round before it
  announces, so a genuine contribution is never for a round its receiver has not entered;
  ``max_ahead`` is slack, not a need);
- **not a mate**: once the round's group is known (``set_mates``), a sender outside it, this
  member included, is refused. Before that, contributions are buffered, at most ``max_pending``
  per round: a full buffer answers ``InboxFull`` (the sender retries until its deadline), and when
  the group becomes known the buffered contributions of non-mates are dropped and reported;
- **replay**: a second contribution from one sender for one round is refused.

``take`` waits until every mate delivered or the deadline passed, whichever comes first, and
closes the round. Nothing waits longer than the deadline it is given.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from lowcomm.collectives.reduce_owner import ContributionRejected

Channel = tuple[str, str]  # (run, group)


class InboxFull(RuntimeError):
    """The round's buffer is full while its members are unknown: the sender should retry."""


@dataclass
class _Round:
    mates: frozenset[str] | None = None
    items: dict[str, object] = field(default_factory=dict)

    def complete(self) -> bool:
        return self.mates is not None and self.mates <= set(self.items)


class Inbox:
    def __init__(self, me: str, max_ahead: int = 1, max_pending: int = 4):
        self.me = me
        self.max_ahead = max_ahead
        self.max_pending = max_pending
        self._rounds: dict[tuple[Channel, int], _Round] = {}
        self._entered: dict[Channel, int] = {}
        self._closed: dict[Channel, int] = {}
        self._cond = threading.Condition()

    def enter(self, channel: Channel, round_: int) -> None:
        """This member starts ``round_`` (call before announcing it): its partners may now push to it."""
        with self._cond:
            self._entered[channel] = max(self._entered.get(channel, -1), round_)
            self._forget(channel, below=self._entered[channel])

    def admit(self, channel: Channel, round_: int, sender: str) -> None:
        """The checks a header alone allows (before the blob is read); raises ContributionRejected/InboxFull."""
        with self._cond:
            self._check(channel, round_, sender)

    def deliver(self, channel: Channel, round_: int, sender: str, item: object) -> bool:
        """Stores a validated contribution; True if the round's group was known (else it is buffered)."""
        with self._cond:
            slot = self._check(channel, round_, sender)
            self._rounds[(channel, round_)] = slot
            slot.items[sender] = item
            if slot.complete():
                self._cond.notify_all()
            return slot.mates is not None

    def set_mates(self, channel: Channel, round_: int, mates: frozenset[str]) -> list[str]:
        """The round's group is known: returns the buffered senders dropped for not being mates."""
        with self._cond:
            slot = self._rounds.setdefault((channel, round_), _Round())
            slot.mates = frozenset(mates) - {self.me}
            dropped = sorted(set(slot.items) - slot.mates)
            for sender in dropped:
                del slot.items[sender]
            self._cond.notify_all()
            return dropped

    def take(self, channel: Channel, round_: int, deadline: float) -> dict[str, object]:
        """The mates' contributions once all arrived or at ``deadline`` (time.monotonic()); closes the round."""
        with self._cond:
            slot = self._rounds.setdefault((channel, round_), _Round())
            while not slot.complete():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            items = {sender: item for sender, item in slot.items.items() if slot.mates and sender in slot.mates}
            self._close(channel, round_)
            return items

    def close(self, channel: Channel, round_: int) -> None:
        """Closes a round whose result is no longer wanted (e.g. this member was left out of it)."""
        with self._cond:
            self._close(channel, round_)

    def buffered(self, channel: Channel, round_: int) -> int:
        with self._cond:
            slot = self._rounds.get((channel, round_))
            return len(slot.items) if slot is not None else 0

    # ---- under the lock ----------------------------------------------------------------------

    def _check(self, channel: Channel, round_: int, sender: str) -> _Round:
        entered = self._entered.get(channel)
        if entered is None:
            raise ContributionRejected(f"unknown run/group {channel}: this peer has entered no round of it")
        if round_ <= self._closed.get(channel, -1) or round_ < entered:
            raise ContributionRejected(f"stale round {round_}: this peer is at round {entered}")
        if round_ > entered + self.max_ahead:
            raise ContributionRejected(f"future round {round_}: this peer is at round {entered}")
        if sender == self.me:
            raise ContributionRejected("a contribution claiming to come from this peer itself")
        slot = self._rounds.get((channel, round_)) or _Round()
        if sender in slot.items:
            raise ContributionRejected(f"replay: {sender[:40]} already delivered round {round_}")
        if slot.mates is not None and sender not in slot.mates:
            raise ContributionRejected(f"{sender[:40]} is not in this peer's group for round {round_}")
        if slot.mates is None and len(slot.items) >= self.max_pending:
            raise InboxFull(f"round {round_}: {len(slot.items)} contributions buffered before its members are known")
        return slot

    def _close(self, channel: Channel, round_: int) -> None:
        self._closed[channel] = max(self._closed.get(channel, -1), round_)
        self._forget(channel, below=self._closed[channel] + 1)
        self._cond.notify_all()

    def _forget(self, channel: Channel, below: int) -> None:
        for key in [k for k in self._rounds if k[0] == channel and k[1] < below]:
            del self._rounds[key]
