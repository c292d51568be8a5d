"""The owner's side of the sharded reduce: collect contributions for my shard, reduce, reply encoded.

An owner opens a slot for (group, round) when it starts that round. Contributions that arrive before
the slot opens wait for it (within their own deadline); contributions for a round the owner has left
behind are refused as stale; a second contribution from the same sender is refused as a replay.
"Left behind" is two rounds below the newest slot: with the one-step-delay overlap a peer runs round
t's reduce in the background while round t+1's starts, and either may open its slot first, so round
t's parts wait for their slot even after round t+1's opened. The slot closes when every member has
contributed or its deadline passes; the reduced shard is encoded once and the same bytes go to every
caller, so every replica applies identical values. Every received shard (own or others') is kept
(collectives.held_shards) so holes can be filled and a late member or a joiner can catch up. A slot
aborted before it closes (`abort`: its group gave up, e.g. an in-process run whose peer failed) wakes
its callers with a CollectiveError instead of a reply.

Hostile parts are refused, never raised into the owner's own round: a remote part that claims the
owner's own id (`add` with `own=False`), a non-finite part (the owner's own included: the owner then
leaves itself out, `leave_out`), a weight above the round's bound (`validate_weight`), and a part for
a round more than `AHEAD_ROUNDS` past the owner's newest slot (`wait_slot` refuses it at once instead
of holding a server thread for it); a wait for a slot ends when the caller's call ends (`active`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.held_shards import KEEP_ROUNDS, HeldShards
from lowcomm.compress import CodecError, get_codec
from lowcomm.compress.finite import all_finite

logger = logging.getLogger(__name__)
EXPIRED = "round forgotten here"  # held(): a round more than KEEP_ROUNDS below the newest, not held
AHEAD_ROUNDS = 2  # a part may name a round this far past the owner's newest slot (the overlap's reach)
MAX_WEIGHT = 1e12  # hard bound on a contribution's weight (tokens), whatever the round's own bound
WAIT_SLICE_S = 1.0  # a waiting server thread looks at its call's state at least this often


class ContributionRejected(ValueError):
    """A contribution failed validation; the message goes back to its sender."""


@dataclass
class Slot:
    group: str
    round: int
    shard: int
    members: frozenset[str]
    bounds: tuple[int, int]  # the shard's range of the flat payload
    combiner: object  # collectives.combiners: accept / close / finish
    deadline: float  # time.monotonic()
    items: dict[str, tuple[object, float]] = field(default_factory=dict)
    blob: bytes | None = None
    aborted: str | None = None  # why the slot will never close (abort); its callers get a CollectiveError
    cond: threading.Condition = field(default_factory=threading.Condition)
    owner: str | None = None  # the owner's own id: no remote part may claim it
    run: str = ""  # the run the slot's round belongs to
    manifest: bytes = b""  # the digest of the manifest the slot's round follows: another one's parts are refused

    @property
    def codec_name(self) -> str:
        return self.combiner.name

    @property
    def numel(self) -> int:
        return self.bounds[1] - self.bounds[0]

    @property
    def contributors(self) -> set[str]:
        return set(self.items)

    def add(self, sender: str, item: object, weight: float, own: bool = False) -> None:
        """Adds ``sender``'s part; ``own``: the owner's own part, the one part that may carry its id."""
        with self.cond:
            if not own and self.owner is not None and sender == self.owner:
                raise ContributionRejected(f"a remote part claims this owner's own id {sender[:40]!r}")
            if self.blob is not None:
                raise ContributionRejected(f"round {self.round} shard {self.shard} already closed")
            if sender in self.items:
                raise ContributionRejected(f"replay: {sender} already contributed to round {self.round}")
            self.items[sender] = (item, weight)
            if set(self.items) >= self.members:
                self.cond.notify_all()

    def leave_out(self, sender: str) -> None:
        """Closes the slot without waiting for ``sender`` (e.g. the owner whose own part was refused)."""
        with self.cond:
            self.members = self.members - {sender}
            self.cond.notify_all()

    def abort(self, reason: str) -> None:
        """Wakes every caller of `result` with a CollectiveError, unless the slot already closed."""
        with self.cond:
            if self.blob is None:
                self.aborted = reason
                self.cond.notify_all()

    def result(self) -> tuple[bytes, list[str]]:
        """Waits for every member or the deadline, then returns the owner's reply bytes."""
        with self.cond:
            while self.blob is None and self.aborted is None and not set(self.items) >= self.members:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
            if self.blob is None and self.aborted is not None:
                raise CollectiveError(f"round {self.round} shard {self.shard} aborted: {self.aborted}")
            if self.blob is None:
                self.blob = self.combiner.close(self.items, self.bounds)
                self.items = {sender: (None, weight) for sender, (_, weight) in self.items.items()}  # free memory
                self.cond.notify_all()
            return self.blob, sorted(self.items)


class OwnerSlots:
    """All slots and held shards of one peer, by (group, round)."""

    def __init__(self):
        self._slots: dict[tuple[str, int], Slot] = {}
        self._held = HeldShards()  # the landed rounds' replies, for hole filling and catch-up
        self._newest: dict[str, int] = {}
        self._cond = threading.Condition()
        self.rejected = 0
        self.waiting = 0  # calls inside wait_slot

    def open(self, slot: Slot) -> Slot:
        with self._cond:
            key = (slot.group, slot.round)
            if key not in self._slots:
                self._slots[key] = slot
            self._newest[slot.group] = max(self._newest.get(slot.group, -1), slot.round)
            to_spool, freed = self._forget_old(slot.group)
            self._cond.notify_all()
            opened = self._slots[key]
        self._held.spool(to_spool, trim=freed)
        return opened

    def reach(self, group: str, round_: int) -> None:
        """This peer runs (or caught up) ``round_``, a slot of its own there or not: parts up to
        AHEAD_ROUNDS past it wait for their slot (after a resync or a round without a shard, the newest
        slot opened is older, and a member's part for the round in hand read as too far ahead)."""
        with self._cond:
            self._newest[group] = max(self._newest.get(group, -1), round_)
            to_spool, freed = self._forget_old(group)
            self._cond.notify_all()
        self._held.spool(to_spool, trim=freed)

    def wait_slot(self, group: str, round_: int, timeout: float, active=None) -> Slot:
        """The slot of (group, round), waiting up to ``timeout`` for it to open, while ``active()`` holds
        (the caller's call is alive; ``wake`` makes a wait look at it at once)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self.waiting += 1
            try:
                return self._wait_slot(group, round_, deadline, active)
            finally:
                self.waiting -= 1

    def _wait_slot(self, group: str, round_: int, deadline: float, active) -> Slot:
        """wait_slot's loop; the caller holds ``self._cond``."""
        while (group, round_) not in self._slots:
            newest = self._newest.get(group, -1)
            if newest > round_ + 1:
                raise ContributionRejected(f"stale round {round_}: this owner is at round {newest}")
            if newest >= 0 and round_ > newest + AHEAD_ROUNDS:
                raise ContributionRejected(f"round {round_} is too far ahead: this owner is at round {newest}")
            if active is not None and not active():
                raise ContributionRejected(f"round {round_}: the call ended while waiting for the slot")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"round {round_} not opened here within the deadline")
            self._cond.wait(min(remaining, WAIT_SLICE_S))
        return self._slots[(group, round_)]

    def wake(self) -> None:
        """Makes every wait look at its call's state (a gRPC call-ended callback)."""
        with self._cond:
            self._cond.notify_all()

    def hold(self, group: str, round_: int, shard: int, blob: bytes, contributors: list[str],
             manifest: bytes) -> None:
        """Keeps a shard's reply (own or another owner's) for the members that lost it; ``manifest``: the
        digest of the manifest it was reduced under."""
        self._held.put(group, round_, shard, blob, contributors, manifest)
        with self._cond:
            self._cond.notify_all()

    def settle(self, group: str, round_: int) -> None:
        """The round's aggregate goes to its caller: held values that are slices of it are copied first."""
        self._held.settle(group, round_)

    def held_resident_bytes(self) -> int:
        """Bytes of held replies in memory: about one round's shards (collectives.held_shards)."""
        return self._held.resident_bytes()

    def held(self, group: str, round_: int, shard: int, timeout: float, manifest: bytes,
             active=None) -> tuple[bytes, list[str]] | str:
        """The shard held under ``manifest``, waiting up to ``timeout`` for it while ``active()`` holds;
        else why not: a round forgotten or held under another manifest answers at once."""
        deadline, key = time.monotonic() + timeout, (group, round_, shard)
        with self._cond:
            while key not in self._held:
                if round_ < self._newest.get(group, -1) - KEEP_ROUNDS:
                    return EXPIRED
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (active is not None and not active()):
                    return "shard not held here"
                self._cond.wait(min(remaining, WAIT_SLICE_S))
        held = self._held.get(key)  # a spooled one is read back: outside the lock
        if held is None:
            return EXPIRED
        blob, contributors, held_under = held
        if held_under != manifest:
            return f"round {round_} shard {shard} is held here under another manifest"
        return blob, contributors

    def _forget_old(self, group: str) -> tuple[list[tuple[str, int]], bool]:
        """Drops the slots KEEP_ROUNDS below the newest, the pieces of those two below, and forgets held
        rounds: (the rounds to spool, whether a slot's memory was freed)."""
        floor, freed = self._newest[group] - KEEP_ROUNDS, False
        for key in [k for k in self._slots if k[0] == group and k[1] < floor]:
            del self._slots[key]
            freed = True
        for key, slot in self._slots.items():  # their replies went out a round ago: a late member asks GetShard
            if key[0] == group and key[1] < self._newest[group] - 1 and not getattr(slot, "released", True):
                freed = slot.release() or freed
        return self._held.forget(group, self._newest[group]), freed


def decode_contribution(blob: bytes, codec_name: str, numel: int) -> torch.Tensor:
    """Decodes a blob from the network, insisting on the expected size and finite values.

    The codec is bounded by ``numel`` before anything is decompressed: a zstd frame declaring more
    than ``numel`` elements can hold (a decompression bomb) is refused from its header.
    """
    try:
        values = get_codec(codec_name, check_finite=True, max_elements=max(numel, 1)).decode(blob)
    except CodecError as e:
        raise ContributionRejected(f"undecodable payload: {e}") from None
    if values.numel() != numel:
        raise ContributionRejected(f"payload has {values.numel()} elements, the shard has {numel}")
    values = values.reshape(-1).to(torch.float32)
    if not all_finite(values):
        raise ContributionRejected("payload contains NaN or Inf")
    return values


def validate_weight(weight: float, cap: float | None = None) -> float:
    """``weight`` when it is a positive finite number of tokens within ``cap`` (what one round can
    produce; None: no bound of its own) and within MAX_WEIGHT; else ContributionRejected."""
    if not math.isfinite(weight) or weight <= 0 or weight > MAX_WEIGHT:
        raise ContributionRejected(f"weight {weight} is not a positive finite number of tokens")
    if cap is not None and weight > cap:
        raise ContributionRejected(f"weight {weight} exceeds the {cap:g} tokens one round can produce")
    return float(weight)


def check_finite(values: torch.Tensor) -> torch.Tensor:
    """``values`` when every entry is finite; else ContributionRejected."""
    if not all_finite(values):
        raise ContributionRejected("payload contains NaN or Inf")
    return values
