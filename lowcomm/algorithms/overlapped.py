"""One-step-delay overlap on the real collective: round t's reduce runs during round t+1's inner steps.

Wraps a DiLoCo or SparseLoCo replica (``OuterReplica``) and runs ALGORITHMS.md §1's recurrence
with algorithms.overlap's `OneStepDelay` (the recurrence the golden tests pin):

    sync(t):  Δ_t = s_t − θ (θ = e_t, the end of round t's inner steps);  start the reduce of Δ_t
              wait for round t−1's reduce (if any) → the outer step gives φ_{t−1}
              θ ← s_{t+1} = start_from(φ_{t−1}, Δ_t), the rule `diloco.overlap_update` names
                  (algorithms.overlap: momentum, delayed, eager or projected)
    drain():  wait for the last reduce, θ ← φ (the end of training)

``sync(t)`` returns round t−1's result (None at the first round), so the caller logs and counts a
round when it completes, one round after it started. Error feedback (SparseLoCo) sees Δ_t
unchanged, as ALGORITHMS.md says.

Late and new replicas. A replica left out of round t−1's manifest learns it when it waits for that
round (``NotInRound`` with the manifest): it fetches the round's agreed aggregate from the members
(``fetch_round``), applies the same outer step and stays on the shared φ, losing only its own
Δ_{t−1}. A replica that enters from a state download labelled round r holds φ_{r−2} (what the
members held after launching round r−1), so ``enter(r)`` reads round r−1's manifest at once and
fetches its aggregate the same way, to be applied at the first sync: from then on it holds the
members' φ. That fetch starts at once, in the background: the members keep a round's shards only
while they run the next two rounds. (A state resumed from a checkpoint has no such round: it is
dropped, and said so.) Any other failure of a pending round propagates as ``RoundFailed`` (the peer
resyncs and ``enter``s again).

Applied on arrival (``apply = "arrival"``, the default; Decision 33 in docs/round-protocol.md): after
every inner step the replica looks whether the pending round's aggregate has arrived. When it has,
φ takes its outer step at once and θ moves by φ_t − s_{t+1} (the start the rule estimated, replaced
by the one plain DiLoCo would have used), so the round's remaining inner steps run on from where
plain DiLoCo's would; the round is still logged, voted on and snapshotted at the boundary, so the
φ a boundary shows, and every label, are those of ``apply = "boundary"`` (ALGORITHMS.md §1 as
written, where the aggregate waits for the boundary). A round left out waits for the boundary,
where it is caught up; a failed one fails the step that finds it (at the end of the lead, below,
or the boundary). Each round this replica took part in records ``arrived_after_steps``: the inner
steps run from the estimated start before its aggregate was applied (H where it waited for the
boundary; none for the last round, which lands at the run's end).

The lead (``lead``, `diloco.overlap_lead`, 0.1 by default; Decisions 49, 50): a replica runs at
most ⌈lead·H⌉ of round t+1's inner steps before round t's aggregate is applied; there it waits for
it, as the boundary would. The steps before it arrives run from the estimated start, so a peer
faster than the round's slowest member would otherwise run up to a whole round of them each round,
the boundary's loss (`experiments/RESULTS.md`, "The overlap's lead"), while its waiting changes
little: the run's pace is its slowest peer's. A replica behind the others has no lead: from a state
download until it lands a round it took part in (one it caught up does not count), it waits only
at the boundary, since a wait for a round it will be left out of would only put it further behind.

The schedule (``after_inner_step``): every H steps ``sync(t)``; at the run's last step the final
round lands at once (θ ← φ for the final evaluation), and ``finish`` lands it for a run whose
steps are not a multiple of H. A landed round's bytes are everything sent since the previous
landing, since its reduce ran in the background; its record says whether it was caught up. The
state this replica holds after ``sync(t)`` is labelled round t + 1 (φ up to t − 1): a joiner that
enters there fetches round t's aggregate at its first sync.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from lowcomm.algorithms.base import Replica, RoundDropped, RoundFailed
from lowcomm.algorithms.outer import OuterReplica
from lowcomm.algorithms.overlap import OneStepDelay, start_rule
from lowcomm.collectives.base import CollectiveError, NotInRound, RoundResult

POLL_S = 0.1


class _FetchRound:
    """The round in flight when this replica entered: its aggregate, fetched from the round's members
    in the background from the moment it entered (they keep a round's shards for a bounded while:
    held_shards.KEEP_ROUNDS, HOLD_S), not only once the first sync waits for it."""

    def __init__(self, round_: int, manifest, fetch: Callable[[int, object], RoundResult]):
        self.round = round_
        self._done: Future = Future()
        threading.Thread(target=self._fetch, args=(fetch, manifest), daemon=True, name=f"fetch-round-{round_}").start()

    def _fetch(self, fetch, manifest) -> None:
        try:
            self._done.set_result(fetch(self.round, manifest))
        except BaseException as e:  # raised in the sync that waits for it
            self._done.set_exception(e)

    def result(self, timeout: float | None = None) -> RoundResult:
        try:
            result = self._done.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"round {self.round}: its aggregate did not come within {timeout} s") from None
        result.info["caught_up"] = True
        return result

    def done(self) -> bool:
        return self._done.done()


class _Applied:
    """A pending round whose aggregate was applied as it arrived, during the next round's inner steps:
    at the boundary it lands with nothing left to wait for or apply."""

    def __init__(self, landed: RoundResult):
        self.landed = landed

    def done(self) -> bool:
        return True


APPLY = ("arrival", "boundary")  # when the overlap applies a round's aggregate (`diloco.overlap_apply`)


class Overlapped(Replica):
    announces_ahead = True

    def __init__(self, inner: OuterReplica, manifest_of: Callable[[int], object], update: str = "delayed",
                 apply: str = "arrival", lead: float = 1.0):
        """``manifest_of(round)``: the round's manifest, or None while there is none (the DHT);
        ``update``: the rule for the next round's start, one of algorithms.overlap.UPDATES; ``apply``:
        when an arrived aggregate is applied, one of APPLY; ``lead``: with ``apply = "arrival"``, the
        share of a round's inner steps run before the previous round's aggregate is awaited (1: H)."""
        if apply not in APPLY:
            raise ValueError(f"overlap apply {apply!r}: one of {', '.join(APPLY)}")
        if not 0 < lead <= 1:
            raise ValueError(f"overlap lead {lead!r}: in (0, 1]")
        super().__init__(inner.model, inner.collective, inner.key, inner.tokens_per_step, inner.hooks)
        self.inner = inner
        self.manifest_of = manifest_of
        self.start = self._theta()  # s_1 = φ_0
        self.delay = OneStepDelay()  # the recurrence's bookkeeping: (round, handle) of the reduce in flight
        self.start_from = start_rule(update, inner.preview_outer)
        self.on_arrival = apply == "arrival"
        self.lead_steps = max(1, math.ceil(round(lead * inner.sync_every, 9)))  # awaited there (H: the boundary)
        self._landed_mark: int | None = None  # the meter when a round last landed
        self._steps_in = 0  # the inner steps of this round run so far (``after_inner_step``'s)
        self._behind = False  # the last round landed was caught up, or none since entering: no lead

    @property
    def phi(self):
        return self.inner.phi

    @property
    def pending(self) -> tuple[int, object] | None:
        return self.delay.pending

    @pending.setter
    def pending(self, value: tuple[int, object] | None) -> None:
        self.delay.pending = value

    # ---- the schedule ------------------------------------------------------------------------

    def after_inner_step(self, step: int) -> bool:
        if step % self.inner.sync_every != 0:
            self._steps_in = step % self.inner.sync_every
            if (self.on_arrival and not self.apply_arrived() and self._steps_in >= self.lead_steps
                    and not self._behind):
                self._await_arrival()
            return True
        round_ = self.round
        if not self.hooks.gate(round_):
            return False
        weight, t0 = self.tokens_per_step * self.inner.sync_every, time.time()
        if self._landed_mark is None:
            self._landed_mark = self.hooks.meter()
        timeout = self.hooks.timeout_s
        try:
            landed = [self.sync(round_, weight, timeout)]
            if step >= self.hooks.total_steps:
                landed.append(self.drain(timeout))
        except (CollectiveError, TimeoutError) as e:  # a late round was caught up inside; this is worse
            raise RoundFailed(round_ - 1, e) from e
        self._land(landed, weight, t0)
        self.round = round_ + 1
        self._ahead = self.round
        return True

    def in_flight(self) -> bool:
        return self.pending is not None

    def finish(self) -> bool:
        """The end of a run whose steps are not a multiple of H: the last round lands."""
        if self.pending is None:
            return False
        t0 = time.time()
        try:
            landed = self.drain(self.hooks.timeout_s)
        except (CollectiveError, TimeoutError) as e:  # the final φ misses that round: θ ← φ anyway
            self.inner.load_phi_into_model()
            raise RoundDropped(self.round - 1, e) from e
        self._land([landed], self.tokens_per_step * self.inner.sync_every, t0)
        return True

    def _land(self, landed: list, weight: float, t0: float) -> None:
        for result in filter(None, landed):
            sent = self.hooks.meter()
            mark = sent if self._landed_mark is None else self._landed_mark
            self._landed_mark = sent
            caught_up = bool(result.info.get("caught_up"))
            self._behind = caught_up
            self._landed(result.info["round"], result, weight, t0, sent - mark, caught_up=caught_up)
            t0 = time.time()

    def phi_hash(self) -> str:
        return self.inner.phi_hash()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.inner.state_tensors()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.inner.expected_shapes()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """φ (and the outer state) from a download; θ ← φ; nothing pending until ``enter``."""
        self.inner.load_state_tensors(tensors)
        self.start, self.pending = self._theta(), None
        self.start_from.forget()
        self._behind = True

    def enter(self, round_: int, wait_s: float = 0.0) -> bool:
        """After a download labelled ``round_``: round_ − 1's aggregate is still to be applied.

        Its manifest is read now, while it is fresh in the DHT (it expires before the first sync on
        a slow peer), waiting at most ``wait_s``. False when there is none (a state from a
        checkpoint holder after a resume, whose round ran in another swarm): that round is dropped.
        """
        super().enter(round_, wait_s)
        if round_ <= 0:
            return True
        deadline = time.monotonic() + wait_s
        manifest = self.manifest_of(round_ - 1)
        while manifest is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            manifest = self.manifest_of(round_ - 1)
        if manifest is not None:
            self.pending = (round_ - 1, _FetchRound(round_ - 1, manifest, self.inner.fetch_round))
        return manifest is not None

    # ---- the recurrence ----------------------------------------------------------------------

    @torch.no_grad()
    def apply_arrived(self) -> bool:
        """The pending round's aggregate, if it has arrived: φ_t = OuterOpt(φ_{t−1}, Δ̄_t) now, and θ moves
        by φ_t − s_{t+1}, the start this round's steps took replaced by plain DiLoCo's. True if applied."""
        if self.pending is None or isinstance(self.pending[1], _Applied) or not self.pending[1].done():
            return False
        round_, handle = self.pending
        try:
            result = handle.result(0)
        except Exception:  # left out or failed: the lead's end or the boundary deals with it
            return False
        self.inner.step_outer(result)
        result.info["round"] = round_
        self._took_part(result, self._steps_in)
        exact = [p.detach().to("cpu", torch.float32).clone() for p in self.inner.phi]  # as _theta
        for p, estimated, s in zip(self.inner.model.parameters(), self.start, exact):
            p.add_((s - estimated).to(p.device, p.dtype))
        self.start = exact
        self.pending = (round_, _Applied(result))
        return True

    def _await_arrival(self) -> None:
        """The lead's end: the pending round's aggregate is waited for here, as at the boundary, and
        applied. A replica left out of it goes on (the boundary catches the round up from its
        manifest); one whose round failed, came without a manifest to catch up from, or did not come
        within the run's timeout raises RoundFailed, as the boundary would, and drops the round."""
        if self.pending is None or isinstance(self.pending[1], _Applied):
            return
        round_, handle = self.pending
        try:
            handle.result(self.hooks.timeout_s)
        except NotInRound as late:
            if late.manifest is not None:
                return
            self.pending = None
            raise RoundFailed(round_, late) from late
        except (CollectiveError, TimeoutError) as e:
            self.pending = None
            raise RoundFailed(round_, e) from e
        self.apply_arrived()

    def _took_part(self, result: RoundResult, steps: int | None) -> None:
        """A landed round's bookkeeping: one this replica took part in teaches the start rule and records
        the ``steps`` run from its estimate (None: at the run's end); one caught up does neither."""
        if result.info.get("caught_up"):
            self.start_from.forget()
            return
        self.start_from.observe(self.inner.phi)
        if steps is not None:
            result.info.setdefault("record", {})["arrived_after_steps"] = steps

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult | None:
        """Round t's reduce starts; round t − 1's lands (returned; None at the first round); θ ← s_{t+1}."""
        launched, finished = [], []

        def launch(delta: list[torch.Tensor]) -> tuple[int, object]:
            launched.append((round_, self.inner.start_sync_delta(round_, delta, weight)))
            return launched[0]

        try:
            self.start = self.delay.round(self.start, self._theta(), self.inner.phi, launch,
                                          lambda pending: self._land_pending(pending, timeout, finished, True),
                                          self.start_from)
        except BaseException:
            self.pending = launched[0] if launched else None  # the round begun is the one in flight
            raise
        self._load(self.start)
        return finished[0] if finished else None

    def drain(self, timeout: float | None = None) -> RoundResult | None:
        """Completes the last reduce and sets θ ← φ: the end of training."""
        finished = []
        try:
            self.delay.drain(self.inner.phi, lambda pending: self._land_pending(pending, timeout, finished))
        finally:
            self.pending = None
        self.inner.load_phi_into_model()
        self.start = self._theta()
        return finished[0] if finished else None

    @contextlib.contextmanager
    def global_model(self):
        """θ ← φ for the duration (an evaluation of the shared model), then θ is put back."""
        theta = self._theta()
        self.inner.load_phi_into_model()
        try:
            yield self.inner.model
        finally:
            self._load(theta)

    def _land_pending(self, pending: tuple[int, object], timeout: float | None,
                      finished: list[RoundResult], stepped: bool = False) -> list[torch.Tensor]:
        """Waits for a pending round (a late one is fetched from its members), steps φ, returns φ.
        ``stepped``: a round's inner steps ran from its estimate meanwhile (not at the run's end)."""
        round_, handle = pending
        if isinstance(handle, _Applied):  # stepped as it arrived
            finished.append(handle.landed)
            return self.inner.phi
        try:
            result = handle.result(timeout)
        except NotInRound as late:
            if late.manifest is None:
                raise
            result = self.inner.fetch_round(round_, late.manifest)
            result.info["caught_up"] = True
        self.inner.step_outer(result)
        result.info["round"] = round_
        self._took_part(result, self.inner.sync_every if self.on_arrival and stepped else None)
        finished.append(result)
        return self.inner.phi

    def _theta(self) -> list[torch.Tensor]:
        return [p.detach().to("cpu", torch.float32).clone() for p in self.inner.model.parameters()]

    @torch.no_grad()
    def _load(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self.inner.model.parameters(), tensors):
            p.copy_(t.to(p.device, p.dtype))
