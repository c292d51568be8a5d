"""In-process collectives for unit tests: N members in one process, no gRPC.

``InProcessGroup`` is the older, simpler one (a round completes when every replica started it;
the codec, if any, is applied to the mean only).
"""

from __future__ import annotations

import threading

import torch

from lowcomm.collectives.base import Collective, CollectiveError, GroupKey, RoundResult


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

    def done(self) -> bool:
        return self._state.done.is_set()


class InProcessCollective(Collective):
    def __init__(self, group: InProcessGroup, index: int):
        self.group = group
        self.index = index
        self.me = f"replica-{index}"

    def start(self, key: GroupKey, round_: int, payload: torch.Tensor, weight: float = 1.0):
        return self.group._submit(self.index, key, round_, payload, weight)

    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest) -> RoundResult:
        state = self.group._rounds.get((key, round_))
        if state is None or not state.done.is_set():
            raise CollectiveError(f"round {round_} has no result to catch up on")
        return _InProcessHandle(state).result()
