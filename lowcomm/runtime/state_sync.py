"""A training peer's global state: download at join, snapshots for others, resync, the φ-hash drift check.

A joiner waits for the next round boundary and downloads that round's state from the peer with
the newest round, so it contributes from that round on and trains from the current global model,
never from scratch. After every round the peer publishes sha256(φ) and a snapshot; a peer whose
hash disagrees with the majority (`drift_sources`) resyncs from a peer of the majority.
"""

from __future__ import annotations

import random
import time
from collections import Counter

from lowcomm.algorithms.base import Replica
from lowcomm.runtime.context import PeerContext
from lowcomm.runtime.membership import Membership
from lowcomm.runtime.progress import Progress
from lowcomm.runtime.state_transfer import StateError, decode_state, download_state, encode_state

MAX_STATE_BYTES = 8 << 30
FETCH_DEADLINE_S = 600.0


def drift_sources(hashes: dict[str, str], me: str) -> list[str] | None:
    """The peers to resync from when my φ hash of a round is not the agreed one; None when it is.

    The agreed hash is the one most of the (at least 3) peers published. A tie goes to the hash the
    smallest peer id holds, so every peer that reads the same hashes settles a split the same way:
    without it a 2-2 split had no majority to follow and stayed split for the rest of the run.
    """
    if len(hashes) < 3 or me not in hashes:
        return None
    votes = Counter(hashes.values())
    most = max(votes.values())
    agreed = hashes[min(p for p, h in hashes.items() if votes[h] == most)]
    if hashes[me] == agreed:
        return None
    return sorted(p for p, h in hashes.items() if h == agreed)


class StateSync:
    def __init__(self, ctx: PeerContext, membership: Membership, replica: Replica, progress: Progress):
        self.ctx, self.membership, self.replica, self.progress = ctx, membership, replica, progress
        self.config = ctx.config

    def round_boundary_for(self, completed: int) -> int:
        """The first round at which a newcomer can enter when others hold `completed` rounds."""
        if self.replica.per_step:
            epoch = self.config.ddp.epoch_steps
            return (completed // epoch + 1) * epoch
        return completed + 1

    def publish_snapshot(self) -> None:
        r = self.replica
        self.ctx.holder.publish(encode_state(r.state_tensors(), r.round, self.progress.tokens_global,
                                             self.config.config_hash(), r.phi_hash()))

    def publish_round(self) -> None:
        """φ's hash (the drift check) and the state snapshot (joiners) under the round reached."""
        r, per_step = self.replica, self.replica.per_step
        if r.shared_phi and (not per_step or r.round % self.config.ddp.epoch_steps == 0):
            self.ctx.control.publish_phi_hash(r.key.group, r.round, r.phi_hash(), self.config.sync.record_ttl_s * 6)
        if not per_step:  # ddp's state is complete only after the optimizer step: it snapshots at epoch starts
            self.publish_snapshot()

    def fetch(self, min_round: int | None = None, prefer: list[str] | None = None) -> bool:
        """Downloads the global state from the peer with the newest round (of `prefer` where one of them
        is training); False if there is none."""
        ctx, me = self.ctx, self.ctx.me
        deadline = time.monotonic() + FETCH_DEADLINE_S
        empty_since = None
        while time.monotonic() < deadline and not ctx.stop.is_set():
            everyone = ctx.control.live_peers()
            records = [r for p, r in everyone.items()
                       if p != me and r.state in ("training", "holder") and not r.client_mode]
            trainers = [r for r in records if r.state == "training"]
            if not records:
                # A fresh DHT node may not see records yet: only call ourselves first once the
                # coordinator's record is visible and two heartbeats passed without any trainer.
                # A resync (min_round set) is mid-run: a record missing for a moment (a busy
                # peer's late heartbeat) is no reason to give up, so it waits for the deadline.
                empty_since = empty_since or time.monotonic()
                settled = time.monotonic() - empty_since > 2 * self.config.sync.heartbeat_s
                if min_round is None and any(r.state == "coordinator" for r in everyone.values()) and settled:
                    return False
                time.sleep(0.2)
                continue
            empty_since = None
            if trainers and max(r.round for r in trainers) == 0 and not min_round:
                return False  # the run is in its first round: start from the shared seeded φ_0 and join it
            trainers = [r for r in trainers if r.peer_id in (prefer or ())] or trainers
            if trainers:
                newest = max(r.round for r in trainers)
                target = max(min_round or 0, self.round_boundary_for(newest))
                source = random.choice([r for r in trainers if r.round == newest])
            else:  # only a holder (a resumed coordinator): take its round as is
                source = max(records, key=lambda r: r.round)
                target = max(min_round or 0, source.round)
            self.membership.set(state="joining", round=target)
            if self._load_from(source, target):
                return True
        return False

    def _load_from(self, source, target: int) -> bool:
        ctx, replica = self.ctx, self.replica
        try:
            state = download_state(ctx.channels, ctx.traffic, source.endpoint, ctx.options.run_name, ctx.me,
                                   target, wait_s=120.0, timeout=60.0, max_bytes=MAX_STATE_BYTES)
            if state.config_hash != self.config.config_hash():
                raise StateError(f"state is for config {state.config_hash}, this run is {self.config.config_hash()}")
            tensors = decode_state(state.data, replica.expected_shapes())
        except StateError as e:
            ctx.log.event("state_error", source=source.peer_id, error=str(e)[:200])
            return False
        replica.load_state_tensors(tensors)
        self.progress.last_members = frozenset()
        self.progress.tokens_global = int(state.tokens)
        self.progress.step = self.config.step_after_rounds(int(state.round))
        # the overlap: the round in flight when the state was taken lands at our first sync
        if not replica.enter(int(state.round), wait_s=self.config.sync.manifest_s):
            ctx.log.event("round_dropped", round=replica.round - 1, reason="no manifest (a resumed checkpoint?)")
        replica.collective.end_epoch(replica.key)
        self.publish_snapshot()
        ctx.log.event("state_received", source=source.peer_id, round=replica.round, phi_hash=replica.phi_hash())
        return True

    def resync(self, reason: str, sources: list[str] | None = None) -> None:
        """Drops this peer's state for a newer one; `sources`: the peers to take it from where they can."""
        ctx, round_ = self.ctx, self.replica.round
        ctx.log.event("resync", round=round_, reason=reason[:200])
        if self.round_boundary_for(round_) >= self.config.total_rounds:
            # the run ends before the next boundary: nothing left to join, stop as done
            self._end(self.config.run.steps, "late_at_end", round_)
            return
        if not self.fetch(min_round=round_ + 1, prefer=sources):
            if ctx.stop.is_set():
                return
            if not any(r.state == "training" for r in ctx.control.live_peers().values()):
                # everyone else finished and left while this peer was behind: the run is over
                self._end(self.config.run.steps, "run_over", round_)
                return
            raise RuntimeError("no peer to resync from; leaving the run")

    def _end(self, step: int, event: str, round_: int) -> None:
        self.progress.step = step
        self.ctx.log.event(event, round=round_)
        self.progress.eval_due()  # its final evaluation is still due

    def drift_check(self, round_: int) -> bool:
        """A peer whose φ hash of round `round_` is not the agreed one (`drift_sources`) resyncs from a
        peer that holds it. The verdict waits (up to announce_s) for the hash of every member of the
        last round this peer applied, and without them all is left to the next check: a verdict on part
        of the hashes could follow a minority.

        True when it resynced: the caller's round is then behind this peer and must not run.
        """
        control, group, members = self.ctx.control, self.replica.key.group, self.progress.last_members
        deadline = time.monotonic() + self.config.sync.announce_s
        hashes = control.phi_hashes(group, round_)
        while not members <= hashes.keys() and time.monotonic() < deadline:
            if self.ctx.stop.wait(0.2):
                return False
            hashes = control.phi_hashes(group, round_)
        if not members <= hashes.keys():
            return False
        sources = drift_sources(hashes, self.ctx.me)
        if sources is None:
            return False
        self.resync(f"φ hash of round {round_} disagrees with {len(sources)} of {len(hashes)} peers", sources)
        return True
