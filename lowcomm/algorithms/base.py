"""The one interface between the training loop and an algorithm: a `Replica` owns its sync schedule.

The loop knows nothing about rounds (as torchft's local_sgd):

    loss = forward_backward()
    if not replica.on_gradients(step): continue          # ddp, DeMo: this step's round
    if replica.steps_inner_optimizer: optimizer.step()   # DeMo's own update replaces it
    step += 1
    replica.after_inner_step(step)                       # DiLoCo & co.: start / land rounds due now
    ...
    replica.finish()                                     # the end of training: land what is in flight

The runtime gives every replica a `SyncHooks`: ``gate(round)`` runs before a round starts (the
drift check and the test hooks; False: the peer replaced its state and the round must not run),
``landed(result)`` is told of every applied round at once (records, counters, evaluation), and
``meter()`` reads the bytes sent so far. A round that fails raises `RoundFailed`; a round this
replica was left out of is caught up inside (``result.info["caught_up"]``) where the algorithm can.
After a state download the runtime calls ``enter(round)``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from lowcomm.collectives.base import Collective, CollectiveError, GroupKey, NotInRound, RoundResult


class RoundFailed(CollectiveError):
    """A round produced no aggregate this replica can trust: the runtime resyncs its state."""

    def __init__(self, round_: int, reason: object):
        super().__init__(f"round {round_}: {reason}")
        self.round = round_


class RoundDropped(CollectiveError):
    """The last round in flight at the end of training never landed; φ stands without it."""

    def __init__(self, round_: int, reason: object):
        super().__init__(str(reason))
        self.round = round_


@dataclass
class SyncHooks:
    gate: Callable[[int], bool] = lambda round_: True
    landed: Callable[[RoundResult], None] = lambda result: None
    meter: Callable[[], int] = lambda: 0
    timeout_s: float | None = None
    total_steps: int = 1 << 62


@dataclass
class ReplicaSpec:
    """What a builder of the registry gets to make a replica."""

    model: nn.Module
    config: object  # the run config: its sections by name (run, diloco, sparseloco, ...)
    collective: Collective
    key: GroupKey
    tokens_per_step: int = 1
    optimizer: torch.optim.Optimizer | None = None  # the inner optimizer (ddp steps it on the mean gradient)
    lr_at: Callable[[int], float] | None = None  # the inner lr schedule (DeMo follows its warm-up)
    manifest_of: Callable[[int], object] = lambda round_: None  # the overlap: a round's manifest
    hooks: SyncHooks = field(default_factory=SyncHooks)


class Replica(ABC):
    shared_phi = True  # every replica holds the same φ after a round: its hash is published and checked
    per_step = False  # the round is the optimizer step (ddp, DeMo): membership epochs
    announces_ahead = False  # the next round is announced as soon as a round is applied (runtime.peer)
    steps_inner_optimizer = True  # False: the replica's own update replaces the inner optimizer's step
    catches_up = True  # a round this replica was left out of can be fetched from its members

    def __init__(self, model: nn.Module, collective: Collective, key: GroupKey, tokens_per_step: int = 1,
                 hooks: SyncHooks | None = None):
        self.model = model
        self.collective = collective
        self.key = key
        self.tokens_per_step = tokens_per_step
        self.hooks = hooks or SyncHooks()
        self.names = [name for name, _ in model.named_parameters()]
        self.round = 0  # the next round to run: the label of the state this replica holds
        self._ahead: int | None = None

    # ---- the schedule ------------------------------------------------------------------------

    def on_gradients(self, step: int) -> bool:
        """After the backward of step ``step``: per-step algorithms sync here. False: state replaced."""
        return True

    def after_inner_step(self, step: int) -> bool:
        """After ``step`` inner steps: start and land the rounds due now. False: state replaced."""
        return True

    def finish(self) -> bool:
        """The end of training: lands what is still in flight; True when anything was."""
        return False

    def in_flight(self) -> bool:
        """Whether a round is still to land at ``finish``."""
        return False

    def take_ahead(self) -> int | None:
        """The round to announce ahead of its start now, at most once (None: nothing to announce)."""
        ahead, self._ahead = self._ahead, None
        return ahead

    def enter(self, round_: int, wait_s: float = 0.0) -> bool:
        """After a state download labelled ``round_``; False when a round in flight there was dropped. A
        replica that announces ahead announces ``round_`` at once, as after an applied round: the members
        count this peer from its post, whatever their last read of its record (Decision 53)."""
        self.round, self._ahead = round_, round_ if self.announces_ahead else None
        return True

    def global_model(self):
        """A context in which the model holds the global parameters (evaluation)."""
        return nullcontext(self.model)

    # ---- state for joiners, resyncs and checkpoints ------------------------------------------

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def expected_shapes(self) -> dict[str, tuple[int, ...]]: ...

    @abstractmethod
    def phi_hash(self) -> str: ...

    def catch_up(self, round_: int, manifest) -> RoundResult:
        raise CollectiveError(f"{type(self).__name__} cannot catch up a round")

    # ---- helpers for the schedules ------------------------------------------------------------

    def _await(self, round_: int, wait: Callable[[], RoundResult]) -> RoundResult:
        """``wait()`` → the applied result; a round this replica was left out of is caught up."""
        try:
            return wait()
        except NotInRound as late:
            if not self.catches_up or late.manifest is None:
                raise RoundFailed(round_, late) from late
            try:
                result = self.catch_up(round_, late.manifest)
            except (CollectiveError, TimeoutError) as e:
                raise RoundFailed(round_, f"{late}; catching up failed: {e}") from e
            result.info["caught_up"] = True
            return result
        except (CollectiveError, TimeoutError) as e:
            raise RoundFailed(round_, e) from e

    def _landed(self, round_: int, result: RoundResult, weight: float, t0: float, bytes_sent: int,
                sync_s: float | None = None, **record) -> None:
        """Labels an applied round for the runtime and tells it (``hooks.landed``)."""
        result.info.update(round=round_, weight=weight, t0=t0, bytes=bytes_sent,
                           sync_s=time.time() - t0 if sync_s is None else sync_s)
        if record:
            result.info["record"] = {**result.info.get("record", {}), **record}
        self.round = round_ + 1
        self.hooks.landed(result)


class PerStepReplica(Replica):
    """ddp and DeMo: the round is the optimizer step, synced on the gradients before it."""

    per_step = True
    catches_up = False  # a step missed is a state download at the next membership epoch

    def on_gradients(self, step: int) -> bool:
        if not self.hooks.gate(step):
            return False
        t0, bytes_before = time.time(), self.hooks.meter()
        result = self._await(step, lambda: self.sync(step, self.tokens_per_step, self.hooks.timeout_s))
        self._landed(step, result, self.tokens_per_step, t0, self.hooks.meter() - bytes_before)
        return True

    @abstractmethod
    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult: ...
