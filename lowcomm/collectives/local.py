"""In-process collectives for unit tests: N members in one process, no gRPC.

``LocalGroup`` runs the sharded reduce's exact sequence of combiner calls (collectives.combiners,
the same objects ``ShardedReduce`` uses), so a replica's real network code path, dense or sparse,
runs in a unit test:

    member:  part_j = combiner.encode(payload, bounds[j])      (own shard: combiner.own)
    owner j: slot.add(sender, combiner.accept(part_j), weight) → slot.result() = combiner.close(...)
    member:  combiner.finish(combiner.complete(combiner.reply_for(blob, me), me, part_j), bounds[j])

Members are sorted and every member owns a shard, as in a manifest without client-mode peers.
The round's deadline runs from its first ``start``; a member that has not started by then is left
out of every shard's contributors and the round completes for the others. Unlike the network,
a shard whose owner never started is still reduced here (``ShardedReduce`` would lose it).
``abort(reason)`` fails the open rounds and every later one at once (an in-process run whose peer
failed: the others must not wait out the deadline, round after round).

``InProcessGroup`` is the older, simpler one (a round completes when every replica started it;
the codec, if any, is applied to the mean only).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lowcomm.collectives.base import Collective, CollectiveError, FutureHandle, GroupKey, NotInRound, RoundResult
from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.reduce_owner import ContributionRejected, Slot, validate_weight

KEEP_ROUNDS = 8  # rounds a member can still catch up on


@dataclass(frozen=True)
class LocalManifest:
    """What ``NotInRound.manifest`` carries here: the round's members (every one an owner)."""

    round: int
    members: list[str]

    @property
    def owners(self) -> list[str]:
        return self.members

    @property
    def leader(self) -> str:
        return self.members[0]


class _LocalRound:
    def __init__(self, group: str, round_: int, members: list[str], bounds: list[tuple[int, int]], combiner,
                 deadline: float):
        self.manifest = LocalManifest(round_, members)
        self.bounds = bounds
        self.slots = [Slot(group, round_, j, frozenset(members), b, combiner, deadline) for j, b in enumerate(bounds)]


class LocalGroup:
    """``members`` (ids, or a count: ``peer-0`` …) in one process; ``group.member(i)`` is one's collective.

    ``combiner``: a DenseMean (default: ``codec``) or a SparseBundle. ``timeout_s``: each round's
    deadline after its first start. ``membership``: the members of a round (a mapping or a callable
    of the round; default every member); a member outside it gets ``NotInRound``.
    """

    def __init__(self, members: int | Sequence[str], combiner=None, codec: str = "fp32", timeout_s: float = 5.0,
                 membership: Mapping[int, Sequence[str]] | Callable[[int], Sequence[str]] | None = None,
                 zstd_level: int = 1):
        self.ids = [f"peer-{i}" for i in range(members)] if isinstance(members, int) else list(members)
        self.combiner = combiner or DenseMean(codec, zstd_level)
        self.timeout_s = timeout_s
        self._membership = membership
        self._rounds: dict[tuple[GroupKey, int], _LocalRound] = {}
        self._aborted: str | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8 * len(self.ids) + 8, thread_name_prefix="local-reduce")

    def member(self, who: int | str) -> "LocalCollective":
        return LocalCollective(self, who if isinstance(who, str) else self.ids[who])

    def members_of(self, round_: int) -> list[str]:
        if self._membership is None:
            return sorted(self.ids)
        if callable(self._membership):
            return sorted(self._membership(round_))
        return sorted(self._membership.get(round_, self.ids))

    def abort(self, reason: str) -> None:
        """Every member waiting on a round, and every round started later, fails at once with a CollectiveError."""
        with self._lock:
            self._aborted = reason
            rounds = list(self._rounds.values())
        for state in rounds:
            for slot in state.slots:
                slot.abort(reason)

    def _round(self, key: GroupKey, round_: int, numel: int) -> _LocalRound:
        with self._lock:
            if self._aborted is not None:
                raise CollectiveError(f"round {round_}: the group was aborted: {self._aborted}")
            state = self._rounds.get((key, round_))
            if state is None:
                members = self.members_of(round_)
                bounds = self.combiner.shard_bounds(len(members), numel)
                state = _LocalRound(key.group, round_, members, bounds, self.combiner,
                                    time.monotonic() + self.timeout_s)
                self._rounds[(key, round_)] = state
                for old in [k for k in self._rounds if k[0] == key and k[1] < round_ - KEEP_ROUNDS]:
                    del self._rounds[old]  # the network keeps fewer (held_shards.KEEP_ROUNDS)
            return state

    def _run(self, me: str, key: GroupKey, round_: int, payload, weight: float, before_send) -> RoundResult:
        c = self.combiner
        state = self._round(key, round_, c.numel(payload))
        members = state.manifest.members
        if me not in members:
            raise NotInRound(f"round {round_}: {me} is not a member", state.manifest)
        if before_send is not None:
            before_send(round_)
        t0 = time.monotonic()
        bounds = c.shard_bounds(len(state.bounds), c.numel(payload))
        parts = {}
        for j, (owner, slot) in enumerate(zip(members, state.slots)):
            try:  # a refused part (round closed, bad payload) leaves this member out of that shard
                if owner == me:
                    slot.add(me, c.own(payload, bounds[j]), weight)
                else:
                    parts[j] = c.encode(payload, bounds[j])
                    slot.add(me, c.accept(parts[j], slot.bounds), validate_weight(weight))
            except ContributionRejected:
                pass
        values, shard_contributors = [], {}
        for j, (owner, slot) in enumerate(zip(members, state.slots)):
            blob, contributors = slot.result()
            if owner != me:
                blob = c.complete(c.reply_for(blob, me), me, parts.get(j))
            values.append(c.finish(blob, slot.bounds))
            shard_contributors[j] = contributors
        contributors = sorted(set.intersection(*(set(v) for v in shard_contributors.values())))
        return RoundResult(torch.cat(values), contributors, list(members),
                           {"manifest_s": 0.0, "reduce_s": time.monotonic() - t0, "leader": members[0],
                            "epoch": round_, "lost_shards": [], "shard_contributors": shard_contributors})

    def _catch_up(self, key: GroupKey, round_: int) -> RoundResult:
        state = self._rounds.get((key, round_))
        if state is None:
            raise CollectiveError(f"round {round_}: no member holds a result to catch up on")
        replies = [slot.result() for slot in state.slots]  # the bytes every member finished
        contributors = sorted(set.intersection(*(set(c) for _, c in replies)))
        if not contributors:  # as the network's catch-up: nobody holds a reduced shard to fetch
            raise CollectiveError(f"round {round_}: no member's contribution made it; nothing to catch up on")
        aggregate = torch.cat([self.combiner.finish(blob, slot.bounds)
                               for (blob, _), slot in zip(replies, state.slots)])
        return RoundResult(aggregate, contributors, list(state.manifest.members),
                           {"manifest_s": 0.0, "reduce_s": 0.0, "leader": state.manifest.leader, "epoch": round_,
                            "caught_up": True})


class LocalCollective(Collective):
    """Member ``me`` of a ``LocalGroup``: ``start(key, round, payload, weight).result(timeout)``."""

    def __init__(self, group: LocalGroup, me: str):
        self.group = group
        self.me = me
        self.before_send = None

    def start(self, key: GroupKey, round_: int, payload, weight: float = 1.0, donate: bool = False) -> FutureHandle:
        if isinstance(payload, torch.Tensor):
            payload = payload.detach().reshape(-1).to(torch.float32).cpu()
        return FutureHandle(self.group._pool.submit(self.group._run, self.me, key, round_, payload, float(weight),
                                                   self.before_send))

    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest) -> RoundResult:
        return self.group._catch_up(key, round_)


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
            state.payloads[index] = (payload.detach().to("cpu", torch.float32, copy=True), float(weight))
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

    def start(self, key: GroupKey, round_: int, payload: torch.Tensor, weight: float = 1.0, donate: bool = False):
        return self.group._submit(self.index, key, round_, payload, weight)

    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest) -> RoundResult:
        state = self.group._rounds.get((key, round_))
        if state is None or not state.done.is_set():
            raise CollectiveError(f"round {round_} has no result to catch up on")
        return _InProcessHandle(state).result()
