"""SWARM stochastic wiring (ALGORITHMS.md §5): which peer of a stage serves the driver's next hop.

Owns, per stage, a min-heap of (expected busy time, random tie-break, peer), each peer's
bias-corrected EMA of measured throughput, and the driver's bans. A pick pops the least busy
eligible peer and pushes it back with load + task_size / throughput, so over many picks each peer
gets a share of the traffic proportional to its throughput. Knows nothing of the DHT or the wire:
the driver feeds in the advertised peers, the measured call times and the bans.
"""

from __future__ import annotations

import heapq
import random
import statistics
import threading
import time
from collections.abc import Callable, Collection

FORWARD, BACKWARD = "forward", "backward"
TASK_SIZE = {FORWARD: 1.0, BACKWARD: 2.5}  # a backward recomputes the forward, then runs backward

HeapEntry = tuple[float, float, str]  # (expected busy time, random tie-break, peer)


def _task_size(task: str) -> float:
    if task not in TASK_SIZE:
        raise ValueError(f"task must be one of {sorted(TASK_SIZE)}, got {task!r}")
    return TASK_SIZE[task]


class StageRouter:
    def __init__(self, rng: random.Random, alpha: float = 0.1, clock: Callable[[], float] = time.monotonic):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha is an EMA weight and must lie in (0, 1], got {alpha}")
        self._rng = rng
        self._alpha = alpha
        self._clock = clock
        self._lock = threading.Lock()
        self._heaps: dict[int, list[HeapEntry]] = {}
        self._stage_of: dict[str, int] = {}
        self._advertised: dict[str, float] = {}
        self._ema: dict[str, tuple[float, int]] = {}  # peer -> (EMA started at 0, measurements)
        self._banned_until: dict[str, float] = {}

    def update_peers(self, stage: int, advertised: dict[str, float]) -> None:
        """Makes `advertised` (peer -> advertised tasks/s, 0 = unknown) the peers serving `stage`."""
        with self._lock:
            heap = self._heaps.pop(stage, [])
            kept = [entry for entry in heap if entry[2] in advertised]
            for _, _, peer in heap:
                if peer not in advertised:
                    self._forget(peer)
            for peer in advertised:
                old_stage = self._stage_of.get(peer)
                if old_stage is not None and old_stage != stage:
                    self._leave(peer, old_stage)
            # Entering at the minimum: a newcomer at load 0 would take all traffic until it caught up.
            entry_load = min((load for load, _, _ in kept), default=0.0)
            heapq.heapify(kept)
            for peer, throughput in advertised.items():
                self._advertised[peer] = throughput
                if self._stage_of.get(peer) != stage:
                    self._stage_of[peer] = stage
                    heapq.heappush(kept, (entry_load, self._rng.random(), peer))
            if kept:
                self._heaps[stage] = kept

    def pick(self, stage: int, task: str = FORWARD, exclude: Collection[str] = ()) -> str | None:
        """The least busy peer of `stage` that is neither banned nor in `exclude`; None if there is none."""
        size = _task_size(task)
        with self._lock:
            heap = self._heaps.get(stage, [])
            skipped = []
            while heap:
                entry = heapq.heappop(heap)
                if entry[2] in exclude or self._is_banned(entry[2]):
                    skipped.append(entry)
                    continue
                load, _, peer = entry
                heapq.heappush(heap, (load + size / self._throughput(peer), self._rng.random(), peer))
                # A skipped peer banks no credit while it cannot serve: it returns at the minimum load.
                for _, _, skipped_peer in skipped:
                    heapq.heappush(heap, (load, self._rng.random(), skipped_peer))
                return peer
            for entry in skipped:
                heapq.heappush(heap, entry)
            return None

    def report(self, peer: str, task: str, seconds: float) -> None:
        """Folds one measured call of `peer` into its throughput EMA (TASK_SIZE[task] / seconds)."""
        size = _task_size(task)
        if seconds <= 0:
            raise ValueError(f"a measured call takes a positive time, got {seconds} s")
        with self._lock:
            if peer not in self._stage_of:
                return  # the call outlived the peer's membership: nobody routes to it any more
            ema, count = self._ema.get(peer, (0.0, 0))
            self._ema[peer] = ((1 - self._alpha) * ema + self._alpha * size / seconds, count + 1)

    def ban(self, peer: str, until: float) -> None:
        """pick() skips `peer` while clock() < until."""
        with self._lock:
            self._banned_until[peer] = until

    def banned(self, peer: str) -> bool:
        with self._lock:
            return self._is_banned(peer)

    def throughput(self, peer: str) -> float:
        """Measured tasks/s, else advertised, else the median of the stage's known values, else 1.0."""
        with self._lock:
            return self._throughput(peer)

    def peers(self, stage: int) -> list[str]:
        with self._lock:
            return sorted(peer for _, _, peer in self._heaps.get(stage, []))

    def _is_banned(self, peer: str) -> bool:
        until = self._banned_until.get(peer)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._banned_until[peer]
        return False

    def _known_throughput(self, peer: str) -> float | None:
        if peer in self._ema:
            ema, count = self._ema[peer]
            return ema / (1 - (1 - self._alpha) ** count)
        advertised = self._advertised.get(peer, 0.0)
        return advertised if advertised > 0 else None

    def _throughput(self, peer: str) -> float:
        known = self._known_throughput(peer)
        if known is not None:
            return known
        stage = self._stage_of.get(peer)
        others = [self._known_throughput(other) for _, _, other in self._heaps.get(stage, []) if other != peer]
        others = [value for value in others if value is not None]
        return statistics.median(others) if others else 1.0

    def _leave(self, peer: str, stage: int) -> None:
        heap = [entry for entry in self._heaps.get(stage, []) if entry[2] != peer]
        heapq.heapify(heap)
        if heap:
            self._heaps[stage] = heap
        else:
            self._heaps.pop(stage, None)
        self._forget(peer)

    def _forget(self, peer: str) -> None:
        # Measurements are dropped with membership: a peer that comes back is measured afresh.
        self._stage_of.pop(peer, None)
        self._advertised.pop(peer, None)
        self._ema.pop(peer, None)
