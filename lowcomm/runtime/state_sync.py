"""A training peer's global state: download at join, snapshots for others, resync, the φ-hash drift check.

A joiner waits for the next round boundary and downloads that round's state from the peer with
the newest round, so it contributes from that round on and trains from the current global model,
never from scratch. After every round the peer publishes sha256(φ) and a snapshot; a peer whose
hash disagrees with the one agreed by the last round's contributors (`drift_sources`; votes from
anyone else are ignored) resyncs from a contributor that holds it.

Downloaded state is used only if its φ hashes to the round's agreed hash (runtime.round_anchor:
the coordinator's signed anchor, pulled from the coordinator or read from the DHT, or without a
coordinator the majority of the round's votes);
a state that does not is refused (`state_error` and `reject` events) and another source tried.
A joiner also learns from the anchor who the previous round's members were, the only peers whose
next manifest it follows (collectives.manifest).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from lowcomm.algorithms.base import Replica
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.runtime.context import PeerContext, round_timeout
from lowcomm.runtime.membership import Membership
from lowcomm.runtime.progress import Progress
from lowcomm.runtime.round_anchor import Anchor, agreed_hash, parse_anchor, read_anchor
from lowcomm.runtime.state_transfer import (StateError, decode_state, download_state, encode_state, held_round,
                                            state_phi_hash)
from lowcomm.transport.round_posts import ANCHOR

MAX_STATE_BYTES = 8 << 30
FETCH_DEADLINE_S = 600.0  # a joiner's wait for a source (the run may not have started)
STATE_WAIT_S = 120.0  # how long a source may hold a download back until it reaches the requested round
HELD_ROUND_S = 5.0  # how long a source may take to say which round it holds
# a source whose state's round had no anchor this many times is passed over: a record may claim any round
UNANCHORED_TRIES = 2
ANCHOR_SLACK_S = 5.0  # beyond sync.announce_s, how long a download waits for the coordinator's anchor
# a joiner that sees no state source yet looks again after this; each look reads every peer record from the
# DHT (~15 KB on the wire at 4 peers), and at a run's start every peer looks for 2·heartbeat_s before it
# starts from φ_0
EMPTY_POLL_S = 2.0
RETRY_S, RETRY_MAX_S = 0.5, 8.0  # after the n-th download that got no state: a pause of RETRY_S·2ⁿ, capped, ×1-1.5


def retry_pause_s(failures: int) -> float:
    """The pause after ``failures`` downloads in a row got no state: doubling, with jitter, so that many
    peers resyncing at once (a round that left most of them out) do not retry a busy source in step."""
    return min(RETRY_MAX_S, RETRY_S * 2 ** min(failures, 8)) * random.uniform(1.0, 1.5)


class Unanchored(StateError):
    """No agreed φ hash of a downloaded state's round came in time: the state is neither kept nor refused."""


def resync_deadline_s(sync) -> float:
    """How long a resync looks for a source: one round's own deadline (context.round_timeout) plus a
    record's lifetime. Past it nobody can serve (the swarm finished, or this peer is still cut off)."""
    return round_timeout(sync) + sync.record_ttl_s


def drift_sources(hashes: dict[str, str], me: str, voters=None, members=None) -> list[str] | None:
    """The voters to resync from when my φ hash of a round is not the agreed one; None when it is.

    Only the hashes of ``voters`` (the last round's contributors; None: every hash) count. The agreed
    hash is the one most of them published; a tie goes to the hash the smallest voter id holds
    (round_anchor.agreed_hash), so every peer that reads the same hashes settles a split the same
    way: without it a 2-2 split had no majority to follow and stayed split for the rest of the run.
    A verdict needs 3 voters, or 2 that were every member of the round (``members``: the peers that
    applied it; None: unknown). Those two disagreeing are a tie (1-1): the larger id resyncs from the
    smaller. Neither can tell which of them drifted, but two replicas that apply every later aggregate
    to different φ never come back together. Two contributors among more members (a bounded fan-in)
    give no verdict: the members that did not contribute hold the round's φ too, and their hashes do
    not count here.
    """
    votes = hashes if voters is None else {p: h for p, h in hashes.items() if p in voters}
    everyone = voters is not None and members is not None and set(members) <= set(voters)
    if len(votes) < (2 if everyone else 3) or me not in hashes:
        return None
    agreed = agreed_hash(votes)
    if hashes[me] == agreed:
        return None
    return sorted(p for p, h in votes.items() if h == agreed)


class StateSync:
    def __init__(self, ctx: PeerContext, membership: Membership, replica: Replica, progress: Progress,
                 agreement: ManifestAgreement | None = None, admits: Callable[[str], bool] | None = None):
        """``agreement``: the replica's manifest agreement, told the previous members a download's anchor names;
        ``admits(peer_id)``: whether the run's mode lets that peer be a source or a voter (default: everyone)."""
        self.ctx, self.membership, self.replica, self.progress = ctx, membership, replica, progress
        self.agreement = agreement
        self.anchored_by: str | None = None  # where the last anchor came from: "pulled" (the coordinator's) or "dht"
        self.admits = admits or (lambda peer_id: True)
        self._outsiders: set[str] = set()  # sources refused as not admitted (one `reject` event each)
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
            ttl = self.config.sync.record_ttl_s * 6
            if self.agreement is not None:  # posted to the members and the coordinator, and stored
                self.agreement.publish_vote(r.key.group, r.round, r.phi_hash(), ttl)
            else:
                self.ctx.control.publish_phi_hash(r.key.group, r.round, r.phi_hash(), ttl)
        if not per_step:  # ddp's state is complete only after the optimizer step: it snapshots at epoch starts
            self.publish_snapshot()

    def fetch(self, min_round: int | None = None, prefer: list[str] | None = None) -> bool:
        """Downloads the global state from the peer with the newest round (of `prefer` where one of them
        is training); False if there is none."""
        ctx, me = self.ctx, self.ctx.me
        deadline = time.monotonic() + (FETCH_DEADLINE_S if min_round is None else resync_deadline_s(self.config.sync))
        empty_since, failures = None, 0
        refused: set[str] = set()  # sources whose state was refused: another one is tried
        missed: set[str] = set()  # sources that served no state (dead, busy, not at the round): others first
        unanchored: dict[str, int] = {}  # source -> its states whose round had no anchor yet
        while time.monotonic() < deadline and not ctx.stop.is_set():
            everyone = ctx.control.live_peers()
            records = [r for p, r in everyone.items()
                       if p != me and r.state in ("training", "holder") and not r.client_mode and p not in refused
                       and self._admitted(p)]
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
                ctx.stop.wait(EMPTY_POLL_S)
                continue
            empty_since = None
            if trainers and max(r.round for r in trainers) == 0 and not min_round:
                return False  # the run is in its first round: start from the shared seeded φ_0 and join it
            trainers = [r for r in trainers if r.peer_id in (prefer or ())] or trainers
            # a killed peer's record lives on for up to its life (30 s): it costs one try, not one per pick
            trainers = [r for r in trainers if r.peer_id not in missed] or trainers
            if trainers:
                newest = max(r.round for r in trainers)
                source = random.choice([r for r in trainers if r.round == newest])
                # its record's round may be half a record's life old (Decision 58): the source says its own
                held = held_round(ctx.channels, ctx.traffic, source.endpoint, ctx.options.run_name, me, HELD_ROUND_S)
                target = max(min_round or 0, self.round_boundary_for(max(newest, held or 0)))
            else:  # only a holder (a resumed coordinator): take its round as is
                source = max(records, key=lambda r: r.round)
                target = max(min_round or 0, source.round)
            self.membership.set(state="joining", round=target)
            loaded = self._load_from(source, target, deadline, unanchored)
            if loaded:
                return True
            if loaded is False:
                refused.add(source.peer_id)
            elif ctx.stop.wait(retry_pause_s(failures)):  # no state there (unreachable, busy, not at the round)
                break
            else:
                failures += 1
                if source.peer_id not in unanchored:  # (a state whose round had no anchor yet is asked again)
                    missed.add(source.peer_id)
        return False

    def _admitted(self, peer_id: str) -> bool:
        """Whether the run admits ``peer_id`` as a state source; a `reject` event the first time it does not."""
        if self.admits(peer_id):
            return True
        if peer_id not in self._outsiders:
            self._outsiders.add(peer_id)
            self.ctx.log.event("reject", sender=peer_id[:40], reason="a state source the run does not admit")
        return False

    def _load_from(self, source, target: int, deadline: float, unanchored: dict[str, int]) -> bool | None:
        """True: loaded; False: the source's state was refused (its φ is not the agreed one, or its round
        had no anchor UNANCHORED_TRIES times, counted in ``unanchored``); None: no state, or no agreed φ
        hash of its round yet (tried again at the next look). The source holds the download back until it
        reaches ``target``, at most until ``deadline``."""
        ctx, replica = self.ctx, self.replica
        wait_s = min(STATE_WAIT_S, max(1.0, deadline - time.monotonic()))
        try:
            state = download_state(ctx.channels, ctx.traffic, source.endpoint, ctx.options.run_name, ctx.me,
                                   target, wait_s=wait_s, timeout=60.0, max_bytes=MAX_STATE_BYTES)
            if state.config_hash != self.config.config_hash():
                raise StateError(f"state is for config {state.config_hash}, this run is {self.config.config_hash()}")
            if int(state.round) < target:
                raise StateError(f"state of round {state.round}, below the requested {target}")
            tensors = decode_state(state.data, replica.expected_shapes())
        except StateError as e:
            ctx.log.event("state_error", source=source.peer_id, error=str(e)[:200])
            return None
        try:
            anchor = self._check(tensors, int(state.round), source.peer_id)
        except Unanchored as e:  # the round may not be settled yet: asked again, unless it keeps naming one that is not
            ctx.log.event("state_error", source=source.peer_id, error=str(e)[:200])
            unanchored[source.peer_id] = unanchored.get(source.peer_id, 0) + 1
            return False if unanchored[source.peer_id] >= UNANCHORED_TRIES else None
        except StateError as e:
            ctx.log.event("state_error", source=source.peer_id, error=str(e)[:200])
            ctx.log.event("reject", sender=source.peer_id, round=int(state.round), reason=str(e)[:200])
            return False
        replica.load_state_tensors(tensors)
        if anchor is not None and self.agreement is not None:
            self.agreement.learn(replica.key.group, anchor.round - 1, anchor.members)
        self.progress.last_members = frozenset()
        self.progress.last_contributors = frozenset()
        self.progress.tokens_global = int(state.tokens)
        self.progress.step = self.config.step_after_rounds(int(state.round))
        # the overlap: the round in flight when the state was taken lands at our first sync
        if not replica.enter(int(state.round), wait_s=self.config.sync.manifest_s):
            ctx.log.event("round_dropped", round=replica.round - 1, reason="no manifest (a resumed checkpoint?)")
        replica.collective.end_epoch(replica.key)
        self.publish_snapshot()
        ctx.log.event("state_received", source=source.peer_id, round=replica.round, phi_hash=replica.phi_hash(),
                      anchor=self.anchored_by if anchor is not None else None)
        return True

    def _check(self, tensors, round_: int, source: str) -> Anchor | None:
        """Raises StateError unless the state's φ is round ``round_``'s agreed one; the anchor it was
        checked against (None: the coordinator's own state, or the fallback of every vote)."""
        if not self.replica.shared_phi or source == self.ctx.service.checkpointer:
            return None  # replicas that hold their own φ (NoLoCo); a checkpoint the coordinator serves
        anchor, agreed = self._agreed(round_)
        if agreed is None:
            raise Unanchored(f"no agreed φ hash for round {round_} to check the state against")
        held = state_phi_hash(tensors, self.replica.names)
        if held != agreed:
            raise StateError(f"state's φ hash {held} is not round {round_}'s agreed {agreed}")
        return anchor

    def _agreed(self, round_: int) -> tuple[Anchor | None, str | None]:
        """Round ``round_``'s agreed φ hash: the coordinator's anchor while the coordinator is in the run
        (waited for up to announce_s + ANCHOR_SLACK_S), else the majority of every vote (no sybil defence)."""
        ctx, group = self.ctx, self.replica.key.group
        coordinator = ctx.service.checkpointer
        deadline = time.monotonic() + self.config.sync.announce_s + ANCHOR_SLACK_S
        while coordinator is not None and (record := ctx.control.live_peers().get(coordinator)) is not None:
            pulled = self._pulled_anchor(coordinator, record.endpoint, round_)
            anchor = pulled or read_anchor(ctx.control, coordinator, group, round_)
            if anchor is not None:
                self.anchored_by = "pulled" if pulled else "dht"
                return anchor, anchor.phi_hash
            if time.monotonic() >= deadline or ctx.stop.wait(0.2):
                return None, None
        ctx.log.event("unanchored", round=round_, reason="no coordinator: the majority of every vote")
        return None, agreed_hash({p: h for p, h in ctx.control.phi_hashes(group, round_).items() if self.admits(p)})

    def _pulled_anchor(self, coordinator: str, endpoint: str, round_: int) -> Anchor | None:
        """The anchor of ``round_`` pulled from the coordinator's data plane (its own round post, signed by
        its key: runtime.round_anchor); None where it holds none yet or does not answer (the DHT's then)."""
        if self.agreement is None or not endpoint:
            return None
        wakes, group = self.agreement.wakes, self.replica.key.group
        if coordinator not in wakes.posted(ANCHOR, group, round_):
            wakes.pull(ANCHOR, group, round_, {coordinator: endpoint})
        return parse_anchor(wakes.posted(ANCHOR, group, round_).get(coordinator), round_)

    def resync(self, reason: str, sources: list[str] | None = None) -> None:
        """Drops this peer's state for a newer one; `sources`: the peers to take it from where they can."""
        ctx, round_ = self.ctx, self.replica.round
        ctx.log.event("resync", round=round_, reason=reason[:200])
        if self.round_boundary_for(round_) >= self.config.total_rounds:
            # the run ends before the next boundary: nothing left to join, stop as done
            self._end(self.config.run.steps, "late_at_end", round_)
            return
        started = time.monotonic()
        if self.fetch(min_round=round_ + 1, prefer=sources):
            self.membership.set(state="training")  # a source for others again, and shown as training
        else:
            if ctx.stop.is_set():
                return
            ctx.log.event("resync_failed", round=round_, waited_s=round(time.monotonic() - started, 1),
                          reason="no source served the state within the resync deadline")
            if not any(r.state == "training" for r in ctx.control.live_peers().values()):
                # everyone else finished and left while this peer was behind: the run is over
                self._end(self.config.run.steps, "run_over", round_)
                return
            raise RuntimeError("no peer to resync from; leaving the run")

    def _votes(self, group: str, round_: int, voters, fresh: bool = False) -> dict[str, str]:
        """The φ votes of ``round_``: posted ones first (the DHT at its poll), or the DHT's at every look."""
        if self.agreement is not None:
            return self.agreement.reads.votes(group, round_, voters, fresh)
        return self.ctx.control.phi_hashes(group, round_)

    def _end(self, step: int, event: str, round_: int) -> None:
        self.progress.step = step
        self.ctx.log.event(event, round=round_)
        self.progress.eval_due()  # its final evaluation is still due

    def drift_check(self, round_: int) -> bool:
        """A peer whose φ hash of round `round_` is not the one the contributors of the last round it
        applied agreed on (`drift_sources`) resyncs from a contributor that holds it. Nobody else's
        hash counts; a peer that applied no round since its state was downloaded (checked against the
        agreed hash then) has no voters and no verdict. The verdict waits (up to announce_s) for every
        voter's hash, and without them all is left to the next check (a `drift_unchecked` event): a verdict
        on part of the hashes could follow a minority.

        True when it resynced: the caller's round is then behind this peer and must not run.
        """
        group, voters = self.replica.key.group, self.progress.last_contributors
        if not voters:
            return False
        deadline = time.monotonic() + self.config.sync.announce_s
        hashes = self._votes(group, round_, voters)
        while not voters <= hashes.keys() and time.monotonic() < deadline:
            if self.ctx.stop.wait(0.2):
                return False
            hashes = self._votes(group, round_, voters)
        if not voters <= hashes.keys():  # a vote neither posted nor pulled yet: one last look (a pull, the DHT)
            hashes = self._votes(group, round_, voters, fresh=True)
            if not voters <= hashes.keys():
                self.ctx.log.event("drift_unchecked", round=round_, missing=len(voters - hashes.keys()))
                return False
        sources = drift_sources(hashes, self.ctx.me, voters, self.progress.last_members)
        if sources is None:
            return False
        self.resync(f"φ hash of round {round_} disagrees with {len(sources)} of {len(hashes)} peers", sources)
        return True
