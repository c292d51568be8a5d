"""The collective interface every algorithm talks to, and an in-process implementation for unit tests.

    handle = collective.start(group_key, round, payload, weight)
    aggregate, contributors = handle.result(deadline)

`aggregate` is the weighted mean of the contributions that made it into the round, identical on
every participant; `contributors` lists whose contributions are in it (never trust a sync that
does not say who contributed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

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


class Handle(Protocol):
    def result(self, deadline: float | None = None) -> RoundResult: ...


class Collective(Protocol):
    def start(self, key: GroupKey, round_: int, payload: torch.Tensor, weight: float = 1.0) -> Handle: ...


class _InProcessRound:
    def __init__(self, expected: int):
        self.expected = expected
        self.payloads: dict[int, tuple[torch.Tensor, float]] = {}
        self.done = threading.Event()
        self.result: RoundResult | None = None


class InProcessGroup:
    """R replicas in one process: `group.replica(i)` is replica i's collective.

    A round completes when all R replicas have started it; the aggregate is the weighted mean,
    passed through `codec` (encode then decode) when one is given, like the real transport.
    """

    def __init__(self, replicas: int, codec=None):
        self.replicas = replicas
        self.codec = codec
        self._rounds: dict[tuple, _InProcessRound] = {}
        self._lock = threading.Lock()

    def replica(self, index: int) -> "InProcessCollective":
        return InProcessCollective(self, index)

    def _submit(self, index: int, key: GroupKey, round_: int, payload: torch.Tensor, weight: float):
        with self._lock:
            state = self._rounds.setdefault((key, round_), _InProcessRound(self.replicas))
            state.payloads[index] = (payload.detach().to(torch.float32).clone(), float(weight))
            if len(state.payloads) == state.expected:
                total = sum(w for _, w in state.payloads.values())
                mean = sum(p * (w / total) for p, w in state.payloads.values())
                if self.codec is not None:
                    mean = self.codec.decode(self.codec.encode(mean)).reshape(mean.shape)
                members = [f"replica-{i}" for i in sorted(state.payloads)]
                state.result = RoundResult(mean, members, members)
                state.done.set()
        return _InProcessHandle(state)


class _InProcessHandle:
    def __init__(self, state: _InProcessRound):
        self._state = state

    def result(self, deadline: float | None = None) -> RoundResult:
        if not self._state.done.wait(timeout=deadline):
            raise CollectiveError("in-process round did not complete: not every replica started it")
        return RoundResult(self._state.result.aggregate.clone(), list(self._state.result.contributors),
                           list(self._state.result.participants))


class InProcessCollective:
    def __init__(self, group: InProcessGroup, index: int):
        self.group = group
        self.index = index

    def start(self, key: GroupKey, round_: int, payload: torch.Tensor, weight: float = 1.0):
        return self.group._submit(self.index, key, round_, payload, weight)
