"""An owner's slot for a streamed dense shard: the token-weighted mean, reduced piece by piece.

Piece c is reduced, encoded once and released to every caller as soon as each member still in
the round has delivered its piece c (collectives.pieces). A member leaves the round when its part
is refused, its stream breaks, or the slot's deadline passes before its last piece arrived; the
pieces it delivered (each checked) keep its values, the others do not (as hivemind's butterfly
reduces each part over the senders it has), and the contributor list, sent with the last piece,
names only the members whose every piece is in. Every caller gets the same bytes, so replicas
agree exactly. Parts are summed in sender order, whatever order they arrived in.

A clipping slot (`clip`: the median-clipped mean, collectives.robust) scales each part by
min(1, median / norm) before the mean, as `median_clip` does with the whole parts, from the norms
the senders declare in their signed headers: the median is taken over the senders of piece 0 when
that piece is reduced. A declared norm is a claim, so the owner sums each part's squares as its
pieces arrive and refuses the piece that takes it past the declared norm (and a last piece that
leaves it short of it): what a liar got into the pieces already reduced is within its declared
norm, so its share of the mean stays within the median norm, as with whole parts.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.pieces import Pieces, piece_bounds
from lowcomm.collectives.reduce_owner import WAIT_SLICE_S, ContributionRejected
from lowcomm.collectives.robust import CLIP_EPS, weighted_mean
from lowcomm.compress import get_codec

NORM_RTOL = 1e-3  # how far a part's measured norm may stray from the one it declared (float32 sums)
NORM_ATOL = 1e-6
MAX_NORM = float(torch.finfo(torch.float32).max)


def check_norm(norm: float) -> float:
    """A declared norm, when it is a finite non-negative float32; else ContributionRejected."""
    if not (math.isfinite(norm) and 0 <= norm <= MAX_NORM):
        raise ContributionRejected(f"declared norm {norm} is not a finite non-negative float32")
    return float(norm)


class StreamedSlot:
    """Collects members' pieces of one shard of (group, round) and reduces them as they complete."""

    def __init__(self, group: str, round_: int, shard: int, members: frozenset[str], bounds: tuple[int, int],
                 codec: str, zstd_level: int, elems: int, deadline: float, owner: str, run: str,
                 clip: bool = False, manifest: bytes = b""):
        self.group, self.round, self.shard, self.run, self.owner = group, round_, shard, run, owner
        self.manifest = manifest  # the digest of the manifest the round follows (as Slot's)
        self.members = frozenset(members)
        self.bounds = bounds
        self.codec_name = codec
        self.elems = elems
        self.deadline = deadline
        self.pieces = piece_bounds(bounds[1] - bounds[0], elems)
        self._codec = get_codec(codec, zstd_level=zstd_level)
        self._weights: dict[str, float] = {}
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in self.pieces]
        self._next: dict[str, int] = {}  # the piece each sender sends next
        self._left: set[str] = set()
        self._reduced: list[bytes] = []
        self.released = False  # the reduced pieces were dropped (release)
        self._replying = 0  # members' calls still being replied to
        self._taken = False  # the owner took its own shard (result)
        self._waiting = 0  # members' decoded pieces waiting for the others' same piece
        self.most_waiting = 0  # the most at once (a slower member holds the others' pieces here)
        self.aborted: str | None = None
        self.clip = clip
        self._norms: dict[str, float] = {}  # declared
        self._sumsq: dict[str, float] = {}  # measured so far
        self._scale: dict[str, torch.Tensor] = {}  # set when piece 0 is reduced
        self.cond = threading.Condition()

    @property
    def numel(self) -> int:
        return self.bounds[1] - self.bounds[0]

    def begin(self, sender: str, weight: float, own: bool = False, norm: float = 0.0) -> None:
        """``sender``'s part starts (its header checked): ``own``, the owner's own, the one that may carry its id;
        ``norm``, the norm it declares (a clipping slot)."""
        if self.clip:
            check_norm(norm)
        with self.cond:
            if not own and sender == self.owner:
                raise ContributionRejected(f"a remote part claims this owner's own id {sender[:40]!r}")
            if sender in self._weights or sender in self._left:
                raise ContributionRejected(f"replay: {sender} already contributed to round {self.round}")
            if self._done():
                raise ContributionRejected(f"round {self.round} shard {self.shard} already closed")
            self._weights[sender] = weight
            self._next[sender] = 0
            self._norms[sender], self._sumsq[sender] = float(norm), 0.0

    def add(self, sender: str, c: int, values: torch.Tensor) -> None:
        """``sender``'s piece ``c`` (its pieces come in order)."""
        with self.cond:
            if sender in self._left:
                raise ContributionRejected(f"{sender[:40]} left round {self.round} before its piece {c}")
            if self._next.get(sender) != c or c < len(self._reduced):
                raise ContributionRejected(f"piece {c} of {sender[:40]} out of order")
            if self.clip:
                self._measure(sender, c, values)
            self._pending[c][sender] = values
            if sender != self.owner:  # the owner's own pieces are views of its payload
                self._waiting += 1
                self.most_waiting = max(self.most_waiting, self._waiting)
            self._next[sender] = c + 1
            self._advance()

    def leave_out(self, sender: str) -> None:
        """The round goes on without ``sender``'s pieces from the first it did not deliver."""
        with self.cond:
            if sender in self.members and sender not in self._left and not self._done():
                self._left.add(sender)
                self._advance()

    def abort(self, reason: str) -> None:
        with self.cond:
            if not self._done():
                self.aborted = reason
                self.cond.notify_all()

    def release(self) -> bool:
        """Drops the reduced pieces once the round is two behind (reduce_owner.OwnerSlots): the members hold
        the shard, and a caller this late is answered with an error and fills the hole from them. Whether
        they were dropped (a slot still reducing keeps them)."""
        with self.cond:
            return self._release()

    def replying(self) -> None:
        """A member's call is being replied to: the reduced pieces stay until it ends (``replied``)."""
        with self.cond:
            self._replying += 1

    def replied(self) -> None:
        """A member's call ended; once none is left, the owner has taken its shard and every piece is
        reduced, nobody reads the pieces again: they go (a new call finds the slot closed)."""
        with self.cond:
            self._replying -= 1
            self._release_if_served()

    def piece(self, c: int, active=None) -> bytes:
        """Reduced piece ``c``, waiting for it until the deadline (then the late members are left out),
        while ``active()`` holds."""
        with self.cond:
            while len(self._reduced) <= c:
                if self.aborted is not None:
                    raise CollectiveError(f"round {self.round} shard {self.shard} aborted: {self.aborted}")
                if active is not None and not active():
                    raise ContributionRejected(f"round {self.round}: the call ended while its shard was reduced")
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self._expire()
                    continue
                self.cond.wait(min(remaining, WAIT_SLICE_S))
            if self.released:
                raise CollectiveError(f"round {self.round} shard {self.shard}: its reply left this owner's memory, "
                                      "ask a member for it")
            return self._reduced[c]

    def contributors(self) -> list[str]:
        """The members whose every piece is in the reduced shard (once it is all reduced)."""
        with self.cond:
            return sorted(self._active()) if self._done() else []

    def result(self, active=None) -> tuple[Pieces, list[str]]:
        """Waits for every piece (see `piece`), then returns the reduced shard and its contributors."""
        self.piece(len(self.pieces) - 1, active)
        with self.cond:
            result = Pieces(self._reduced), sorted(self._active())
            self._taken = True
            self._release_if_served()  # the owner's Pieces keep what it reads
            return result

    # ---- under self.cond ----

    def _measure(self, sender: str, c: int, values: torch.Tensor) -> None:
        """Adds piece ``c``'s squares to ``sender``'s sum; refuses it if the sum breaks the declared norm."""
        self._sumsq[sender] += float(values.double().pow(2).sum())
        measured, declared = math.sqrt(self._sumsq[sender]), self._norms[sender]
        if measured > declared * (1 + NORM_RTOL) + NORM_ATOL:
            raise ContributionRejected(f"piece {c} takes the part's norm to {measured:.6g}, past the {declared:.6g} "
                                       "its sender declared")
        if c == len(self.pieces) - 1 and measured < declared * (1 - NORM_RTOL) - NORM_ATOL:
            raise ContributionRejected(f"the part's norm is {measured:.6g}, short of the {declared:.6g} its sender "
                                       "declared")

    def _clip_scales(self, senders: list[str]) -> None:
        """Each sender's factor min(1, median / norm), the median over ``senders`` (piece 0's), as median_clip."""
        norms = torch.tensor([self._norms[s] for s in senders], dtype=torch.float64)
        median = norms.median() if senders else torch.tensor(0.0)  # the lower middle value for an even count
        self._scale = {s: torch.clamp(median / (norm + CLIP_EPS), max=1.0).float() for s, norm in zip(senders, norms)}

    def _release(self) -> bool:
        if self._done() and not self.released:
            self._reduced = [None] * len(self._reduced)
            self.released = True
            return True
        return False

    def _release_if_served(self) -> None:
        if self._taken and self._replying == 0:
            self._release()

    def _active(self) -> set[str]:
        return set(self.members) - self._left

    def _done(self) -> bool:
        return len(self._reduced) == len(self.pieces)

    def _expire(self) -> None:
        """The deadline passed: every member whose last piece is not in leaves."""
        for sender in sorted(self._active()):
            if self._next.get(sender, 0) < len(self.pieces):
                self._left.add(sender)
        self._advance()

    def _advance(self) -> None:
        while not self._done():
            c = len(self._reduced)
            if any(sender not in self._pending[c] for sender in self._active()):
                return
            start, end = self.pieces[c]
            senders = sorted(self._pending[c])
            if self.clip and c == 0:
                self._clip_scales(senders)
            parts = [(self._pending[c][s] * self._scale[s] if self.clip else self._pending[c][s], self._weights[s])
                     for s in senders]
            mean = weighted_mean(parts) if parts else torch.zeros(end - start)
            self._reduced.append(self._codec.encode(mean))
            self._waiting -= sum(1 for sender in self._pending[c] if sender != self.owner)
            self._pending[c] = {}
            self.cond.notify_all()
