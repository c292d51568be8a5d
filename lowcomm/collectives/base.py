"""The collective interface every algorithm and the runtime talk to.

    handle = collective.start(group_key, round, payload, weight)   # donate=True: payload may hold the result
    aggregate, contributors = handle.result(deadline)

`aggregate` is the weighted mean of the contributions that made it into the round (or what the
collective's combiner makes of them), identical on every participant; `contributors` lists whose
contributions are in it (never trust a sync that does not say who contributed).

Implementations: `sharded_reduce.ShardedReduce` (gRPC, owners per shard), `pair_exchange.PairExchange`
(NoLoCo's groups; its handle returns an `ExchangeResult`), and `local.LocalGroup` (N members in one
process, the same combiners minus gRPC, for unit tests).
"""

from __future__ import annotations

import math

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class CollectiveError(RuntimeError):
    """A round could not produce an aggregate this peer can trust; it must resync state."""


class NotInRound(CollectiveError):
    """This peer is not a member of the round's manifest (it announced too late).

    ``manifest`` is the round's manifest when one was read: a late peer can fetch the round's
    result from its members (``catch_up``) instead of downloading the whole state.
    """

    def __init__(self, message: str, manifest=None):
        super().__init__(message)
        self.manifest = manifest


@dataclass(frozen=True)
class GroupKey:
    run: str
    stage: int = 0
    fragment: int = 0

    @property
    def group(self) -> str:
        return f"{self.stage}-{self.fragment}"


@dataclass
class RoundResult:
    aggregate: torch.Tensor
    contributors: list[str]
    participants: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def __iter__(self):  # allows `aggregate, contributors = handle.result(...)`
        return iter((self.aggregate, self.contributors))

    def norm(self) -> float | None:
        """The aggregate's L2 norm, for the round's record and status pages (None: not finite)."""
        value = float(torch.linalg.vector_norm(self.aggregate.detach().float()))
        return value if math.isfinite(value) else None


class Handle(Protocol):
    """A round in flight: ``result`` waits up to ``deadline`` seconds (None: no limit)."""

    def result(self, deadline: float | None = None) -> Any: ...

    def done(self) -> bool: ...


class FutureHandle:
    """A `Handle` on a concurrent.futures.Future of the round."""

    def __init__(self, future):
        self._future = future

    def result(self, deadline: float | None = None) -> Any:
        return self._future.result(timeout=deadline)

    def done(self) -> bool:
        return self._future.done()


class Collective(ABC):
    """One peer's end of a group's rounds.

    ``me`` is this peer's id. ``before_send`` is a hook for fault injection: when set, it is
    called with the round number after the round's membership is known and before this member
    sends its part (raising or sleeping there simulates a crash or a straggler).
    """

    me: str
    before_send: Callable[[int], None] | None = None

    @abstractmethod
    def start(self, key: GroupKey, round_: int, payload: Any, weight: float = 1.0, donate: bool = False) -> Handle:
        """Contributes ``payload`` (a flat tensor, or what the collective's combiner encodes) with
        ``weight`` (tokens) to ``round_``; the handle's result is the round's aggregate.
        ``donate``: the caller reads ``payload`` no more, so the collective may build the aggregate in its
        memory (as torch.distributed's all_reduce does; ShardedReduce's streamed rounds do, others need not).
        Raises ``NotInRound`` (from the handle) when this peer is not a member of the round."""

    @abstractmethod
    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest) -> RoundResult:
        """The result of a round this peer was left out of (``NotInRound.manifest``), as its
        members got it; raises ``CollectiveError`` when it cannot be had."""

    def announce_ahead(self, key: GroupKey, round_: int) -> None:
        """Says early that this peer will take part in ``round_`` (best effort; default: nothing)."""

    def withdraw_ahead(self, key: GroupKey, round_: int) -> None:
        """Takes back ``announce_ahead`` (the peer leaves; best effort; default: nothing)."""

    def end_epoch(self, key: GroupKey, round_: int | None = None) -> None:
        """Forgets the group's agreed membership so the next round agrees afresh (``round_``: after that
        round's exclusion; default: nothing)."""


def __getattr__(name: str):
    # The in-process test collectives used to live here; they moved to collectives.local.
    if name in ("InProcessGroup", "InProcessCollective"):
        from lowcomm.collectives import local

        return getattr(local, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
