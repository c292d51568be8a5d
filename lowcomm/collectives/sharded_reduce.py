"""The sharded reduce over gRPC (hivemind's butterfly, with one decision per shard).

Each member streams part j of its flat payload to shard owner j, which reduces what arrived by the
deadline and returns the *encoded* reduced shard with its contributors; every member (the owner
too) decodes those same bytes, so replicas agree exactly. The mean and the median-clipped mean
stream: parts and replies travel as pieces that the owner reduces and sends back as they complete
(collectives.pieces, collectives.streamed_slot), decoded straight into the round's aggregate;
other combiners send one blob per part and reply once the slot closes. A shard whose owner died
mid-reply is fetched from any member that received it; if none did, nobody applies that slice
(collectives.shard_fetch). A part or a shard request names the manifest its sender follows: when a
round split into two manifests (a peer back from a cut wrote its own), their parts never mix.

Membership comes from a manifest (collectives.manifest) that covers `epoch_rounds` rounds; a round
in which a member failed to contribute ends the epoch, and the exclusion travels in the owners'
contributor lists, so every member sees the same failure and re-forms the group.

Every part is signed by its sender's key over (run, group, round, epoch, sender, shard, weight,
codec, size, payload digest, pieces, the manifest's digest) (transport.signing); an owner checks
the signature on the first chunk, before it admits the call or waits for the round, and the digest
(of the blob, or of each piece, which is signed on its own) before it decodes it. The owner's side
is in collectives.reduce_serving. An owner refuses (a `reject` event, a REJECTED reply) every part
it cannot trust: an unsigned, forged or relabelled one, one for another run or manifest or claiming
the owner's own id, a non-finite one, a weight above `max_weight` (what one round can produce), a
round too far ahead; a member's refused part closes the slot without it, and the owner's own
non-finite part leaves it out of its shard. Nothing a remote part does raises into the owner's own
round. At most `PER_SENDER_CALLS` Reduce calls per sender are served at once, and `STRANGER_CALLS`
from all senders no recent manifest names (fresh keys cannot take the members' places); beyond that,
RESOURCE_EXHAUSTED (`Overloaded`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from lowcomm.collectives.allocator import trimming
from lowcomm.collectives.base import Collective, CollectiveError, FutureHandle, GroupKey, RoundResult
from lowcomm.collectives.manifest import Manifest, ManifestAgreement
from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.held_shards import HeldValues
from lowcomm.collectives.pieces import (AggregateSlices, Pieces, Sink, Superseded, decode_pieces, part_pieces,
                                        piece_bounds, piece_elems)
from lowcomm.collectives.reduce_messages import part_chunks
from lowcomm.collectives.reduce_owner import ContributionRejected, OwnerSlots, Slot, check_finite, validate_weight
from lowcomm.collectives.reduce_serving import PER_SENDER_CALLS, STRANGER_CALLS, ReduceServing
from lowcomm.collectives.streamed_slot import StreamedSlot
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.sender_calls import SenderCalls, StrangerCalls
from lowcomm.collectives.shard_fetch import ShardFetching, ShardReply
from lowcomm.compress import get_codec
from lowcomm.transport.service import ROUND_CALLS_MAX, PeerService
from lowcomm.transport.signing import Signer, Verifier
from lowcomm.transport.wire import Channels, Traffic

logger = logging.getLogger(__name__)


class ShardedReduce(ShardFetching, ReduceServing, Collective):
    """A peer's collective: `start(key, round, payload, weight).result(deadline)`."""

    def __init__(self, signer: Signer, service: PeerService, channels: Channels, traffic: Traffic,
                 agreement: ManifestAgreement, sync: SyncConfig, codec: str, epoch_rounds: int = 1,
                 on_event=None, combiner=None, max_weight: float | None = None, lag: int = 0):
        """``max_weight``: the most tokens one member's part of a round can carry (tokens per step ×
        inner steps); a part claiming more is refused (None: only reduce_owner.MAX_WEIGHT bounds it).
        ``lag``: the rounds a replica starts before the one before lands (DeMo one step late: 1)."""
        self.me = signer.peer_id
        self.signer = signer
        self.verifier = Verifier()
        self.max_weight = max_weight
        self.channels = channels
        self.traffic = traffic
        self.agreement = agreement
        self.sync = sync
        # What owners do with contributions: the token-weighted mean by default (DiLoCo, ddp).
        self.combiner = combiner or DenseMean(codec, sync.zstd_level)
        self.codec = self.combiner.name
        self.elems = piece_elems(sync.chunk_bytes)
        self.epoch_rounds = epoch_rounds
        self.slots = OwnerSlots()
        self.on_event = on_event or (lambda kind, **fields: None)
        self.before_send = None  # fault-injection hook for tests: called with the round after the manifest
        self._manifests: dict[str, Manifest] = {}
        self._suspects: dict[str, frozenset[str]] = {}
        self._agreeing = threading.Lock()
        self._ended: dict[str, int] = {}  # group -> the round whose exclusion ends its epoch
        self.lag = lag
        # threads made as needed: a streamed round sends to every owner at once (as many as the service admits)
        self._pool = ThreadPoolExecutor(max_workers=ROUND_CALLS_MAX + 8, thread_name_prefix="reduce")
        self._service = service
        self._calls = SenderCalls(PER_SENDER_CALLS)  # Reduce calls being served, by claimed sender
        self._strangers = StrangerCalls(STRANGER_CALLS)  # ... by senders outside the recent manifests
        service.reduce_handler = self._serve_reduce
        service.shard_handler = self._serve_shard

    @property
    def streams(self) -> bool:
        """Whether this collective's rounds are reduced piece by piece (Decision 30); a stage sets its
        combiner after the collective is made (runtime.stage_state)."""
        return getattr(self.combiner, "streams", False)

    def held_as_values(self):
        """For a streamed lossless codec, ``(values, alias) -> HeldValues``: a received shard is held as its
        decoded values and encoded again when asked for (Decision 36); else None, the pieces are held."""
        if not self.streams:
            return None
        codec = get_codec(self.codec, zstd_level=self.combiner.zstd_level)
        if not codec.lossless:
            return None
        return lambda values, alias: HeldValues(values, codec.encode, piece_bounds(values.numel(), self.elems), alias)

    # ---- the caller's side ----------------------------------------------------------------

    def start(self, key: GroupKey, round_: int, payload, weight: float = 1.0, donate: bool = False) -> FutureHandle:
        """``payload``: a tensor (dense combiners) or what the combiner encodes (e.g. blobs per parameter).
        ``donate``: a streamed round decodes the aggregate into the payload's flat float32 values (the
        payload itself when it is a contiguous float32 CPU tensor): no second payload-sized buffer."""
        if isinstance(payload, torch.Tensor):
            payload = payload.detach().reshape(-1).to(torch.float32).cpu()
        donate = donate and isinstance(payload, torch.Tensor) and self.streams
        future = self._pool.submit(self._run, key, round_, payload, float(weight), donate)
        return FutureHandle(future)

    def announce_ahead(self, key: GroupKey, round_: int) -> None:
        """Announces ``round_`` in the background (ManifestAgreement.announce); a failure only costs the head start."""

        def announce():
            try:
                self.agreement.announce(key.group, round_, ahead=True)
            except Exception as e:  # the round's own announcement follows when it starts
                logger.info("round %d: announcing ahead failed: %s", round_, e)

        self._pool.submit(announce)

    def withdraw_ahead(self, key: GroupKey, round_: int) -> None:
        """Takes back an announcement ahead of ``round_`` (the peer leaves); best effort."""
        try:
            self.agreement.withdraw(key.group, round_)
        except Exception as e:
            logger.info("round %d: withdrawing the announcement failed: %s", round_, e)

    def end_epoch(self, key: GroupKey, round_: int | None = None) -> None:
        """Forces a fresh manifest: at once (a resync), or past round ``round_ + lag`` when ``round_``
        excluded a member (with a lag, the next rounds may have started on this manifest everywhere)."""
        manifest = self._manifests.get(key.group)
        if round_ is None:
            self._manifests.pop(key.group, None)
        elif manifest is not None and manifest.round <= round_:  # not a round from before a resync
            self._ended[key.group] = round_

    def _manifest_for(self, key: GroupKey, round_: int) -> Manifest:
        with self._agreeing:  # a round started while the one before agrees (DeMo one step late) waits for it
            manifest, ended = self._manifests.get(key.group), self._ended.get(key.group, round_)
            if manifest is None or not manifest.covers(round_) or round_ > ended + self.lag:
                suspects = self._suspects.get(key.group, frozenset())
                manifest = self.agreement.agree(key.group, round_, self.epoch_rounds, self.codec, suspects)
                self._manifests[key.group] = manifest
                self._ended.pop(key.group, None)
                self._strangers.learn(key.group, manifest.members)
            return manifest

    def _run(self, key: GroupKey, round_: int, payload, weight: float, donate: bool) -> RoundResult:
        nbytes = 4 * payload.numel() if isinstance(payload, torch.Tensor) else 0
        # the pieces' freed memory goes back while it reduces (collectives.allocator)
        with trimming.round(nbytes, allocates=0 if donate else nbytes):
            return self._reduce(key, round_, payload, weight, donate)

    def _reduce(self, key: GroupKey, round_: int, payload, weight: float, donate: bool = False) -> RoundResult:
        t0 = time.monotonic()
        self.slots.reach(key.group, round_)
        manifest = self._manifest_for(key, round_)
        self._service.fit_round(len(manifest.senders))
        if self.before_send is not None:
            self.before_send(round_)
        t_manifest = time.monotonic()
        deadline = t_manifest + self.sync.reduce_timeout_s
        numel = self.combiner.numel(payload)
        bounds = self.combiner.shard_bounds(len(manifest.owners), numel)
        # a streamed round's shards are decoded straight into the aggregate (the donated payload), as they arrive
        out = AggregateSlices(numel, bounds, into=payload if donate else None) if self.streams else None

        def sink(j: int) -> Sink | None:  # a new reader of shard j: the one before writes no more
            return out.sink(j) if out is not None else None
        my_shard = manifest.owners.index(self.me) if self.me in manifest.owners else None
        if my_shard is not None:
            slot = self.slots.open(self._slot(key, round_, my_shard, manifest, bounds[my_shard], deadline))
        sends = {}
        contributing = self.me in manifest.senders  # else (a bounded fan-in) it only receives the aggregate
        for j, owner in enumerate(manifest.owners):
            if not contributing:
                if owner != self.me:
                    sends[j] = self._pool.submit(self._receive, manifest, key, round_, j, bounds[j], deadline,
                                                 sink(j))
            elif owner == self.me:
                self._add_own(slot, payload, bounds[j], weight)
            else:
                sends[j] = self._pool.submit(self._send, manifest, key, round_, j, payload, weight, bounds[j],
                                             deadline, sink(j), out)
        replies: dict[int, ShardReply] = {}
        timed_out = set()
        if my_shard is not None:
            replies[my_shard] = self._own_reply(slot, round_, sink(my_shard))
            own = replies[my_shard]
            self.slots.hold(key.group, round_, my_shard, own.blob, own.contributors, manifest.digest)
        for j, future in sends.items():
            try:
                replies[j] = future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except Exception as e:  # a dead, slow or misbehaving owner: a hole to fill
                timed_out.add(manifest.owners[j])
                self.on_event("timeout", round=round_, owner=manifest.owners[j], error=str(e)[:200])
        for j, reply in replies.items():
            self.slots.hold(key.group, round_, j, reply.blob, reply.contributors, manifest.digest)
        missing = [j for j in range(len(manifest.owners)) if j not in replies]
        for j in missing:
            filled = self._fill_hole(manifest, key, round_, j, bounds[j],
                                     wait_s=min(5.0, max(1.0, deadline - time.monotonic() + 2.0)), out=sink(j))
            if filled is not None:
                replies[j] = filled
                self.slots.hold(key.group, round_, j, filled.blob, filled.contributors, manifest.digest)
                self.on_event("hole_filled", round=round_, shard=j, owner=manifest.owners[j])
        lost = [j for j in range(len(manifest.owners)) if j not in replies]
        if my_shard is not None and len(lost) == len(manifest.owners) - 1 > 0 and replies[my_shard].contributors == [self.me]:
            self.end_epoch(key, round_)  # nothing reached it and nothing came back: cut off (Decision 27)
            raise CollectiveError(f"round {round_}: no other member's part or shard came: this peer is cut off")
        for j in lost:
            # Nobody received it: its owner died before replying to anyone. Every member that lost it
            # applies no update to that slice (the drift check resyncs a member that raced and got it).
            replies[j] = ShardReply(out.zero(j) if out is not None else torch.zeros(bounds[j][1] - bounds[j][0]),
                                    [], b"")
            self.on_event("shard_lost", round=round_, shard=j, owner=manifest.owners[j])
        aggregate = out.close() if out is not None else torch.cat([replies[j].values
                                                                   for j in range(len(manifest.owners))])
        self.slots.settle(key.group, round_)  # held values that are slices of the aggregate: copied first
        kept = [set(r.contributors) for j, r in replies.items() if j not in lost]
        if not kept:
            self.end_epoch(key, round_)
            raise CollectiveError(f"round {round_}: no shard could be obtained from anyone")
        contributors = sorted(set.intersection(*kept))
        if contributors == [self.me] and set(manifest.senders) - {self.me} and (lost or timed_out):
            # Some owner never answered it and no other member's part counted in every shard it holds:
            # back from a cut, it ran this round under a manifest the others did not (Decision 27)
            self.end_epoch(key, round_)
            raise CollectiveError(f"round {round_}: some shards never came and no other member's part counted "
                                  "in every shard: this peer is cut off")
        absent = (set(manifest.senders) - set(contributors)) | {manifest.owners[j] for j in lost}
        if absent:  # the exclusion every member reads from the same owner replies
            if absent - timed_out:
                self.on_event("timeout", round=round_, stage="reduce", excluded=sorted(absent - timed_out))
            if self._manifests.get(key.group) is manifest:  # not a round of an epoch a resync replaced
                self._suspects[key.group] = frozenset(absent)
            self.end_epoch(key, round_)
        elif manifest.round + manifest.epoch_rounds - 1 == round_:
            self._suspects[key.group] = frozenset()
        return RoundResult(aggregate, contributors, list(manifest.members),
                           {"manifest_s": t_manifest - t0, "reduce_s": time.monotonic() - t_manifest,
                            "leader": manifest.leader, "epoch": manifest.round, "lost_shards": lost,
                            "shard_contributors": {j: r.contributors for j, r in replies.items()},
                            "record": {"owners": list(manifest.owners)}})

    def _slot(self, key: GroupKey, round_: int, shard: int, manifest: Manifest, bounds: tuple[int, int],
              deadline: float):
        members = frozenset(manifest.senders)
        if self.streams:
            return StreamedSlot(key.group, round_, shard, members, bounds, self.codec, self.combiner.zstd_level,
                                self.elems, deadline, owner=self.me, run=key.run, clip=self.combiner.clips,
                                manifest=manifest.digest)
        return Slot(key.group, round_, shard, members, bounds, self.combiner, deadline, owner=self.me, run=key.run,
                    manifest=manifest.digest)

    def _add_own(self, slot, payload, bounds: tuple[int, int], weight: float) -> None:
        """The owner's own part into its slot; a refused one (non-finite, a bad weight) leaves it out."""
        try:
            weight = validate_weight(weight, self.max_weight)
            if isinstance(slot, StreamedSlot):
                own = check_finite(payload[bounds[0]:bounds[1]])
                slot.begin(self.me, weight, own=True, norm=float(own.norm()) if slot.clip else 0.0)
                for c, (start, end) in enumerate(slot.pieces):
                    slot.add(self.me, c, own[start:end])
            else:
                slot.add(self.me, self.combiner.own(payload, bounds), weight, own=True)
        except ContributionRejected as e:
            slot.leave_out(self.me)
            self._reject(slot.round, self.me, e)

    def _own_reply(self, slot, round_: int, out: Sink | None) -> ShardReply:
        """This owner's own shard, once its slot closed: the same bytes it replies to every member."""
        blob, contributors = slot.result()
        try:
            if isinstance(blob, Pieces):
                decode_pieces(blob, self.codec, slot.numel, self.elems, out)
                values = self.held_as_values()
                return ShardReply(out.values, contributors, blob if values is None else values(out.values, True))
            return ShardReply(self.combiner.finish(blob, slot.bounds), contributors, blob)
        except ContributionRejected as e:
            raise CollectiveError(f"round {round_}: this owner's own reply is unreadable: {e}") from None

    def _send(self, manifest: Manifest, key: GroupKey, round_: int, shard: int, payload, weight: float,
              bounds: tuple[int, int], deadline: float, out: Sink | None,
              slices: AggregateSlices | None = None) -> ShardReply:
        """``slices``: the round's aggregate, through which a donated payload's part is read (read_part)."""
        owner = manifest.owners[shard]
        stub = self.channels.stub(manifest.endpoints[owner])
        header = dict(run_id=key.run, group=key.group, round=round_, epoch=manifest.round, shard=shard, weight=weight,
                      codec=self.codec, manifest=manifest.digest)
        if self.streams:  # each piece encoded as it is sent (a clipping owner's lossy pieces: first, for the norm)
            def read(fn, upto: int):
                return slices.read_part(shard, fn, upto) if slices is not None else fn()

            blob, (norm, encoded) = None, (0.0, None)
            if self.combiner.clips:
                norm, encoded = read(lambda: self.combiner.part_norm(payload, bounds, self.elems), 0)
            def encode(a: int, b: int) -> bytes:
                return read(lambda: self.combiner.encode(payload, (bounds[0] + a, bounds[0] + b)), b)

            chunks = _until_superseded(part_pieces(self.signer, header, encode, bounds[1] - bounds[0], self.elems,
                                                   norm, encoded))
        else:
            blob = self.combiner.encode(payload, bounds)
            chunks = part_chunks(self.signer, header, blob, self.sync.chunk_bytes)
        timeout = max(0.1, deadline - time.monotonic() + 0.5)
        call_deadline = time.monotonic() + timeout
        replies = stub.Reduce(self.traffic.sending(chunks, call_deadline), timeout=timeout)
        reply = self._read_reply(replies, shard, bounds, len(manifest.members), call_deadline, own_part=blob, out=out)
        # Held at once, not after every other shard: a member whose copy of this shard was lost
        # asks the others for it while they may still wait on slower owners.
        self.slots.hold(key.group, round_, shard, reply.blob, reply.contributors, manifest.digest)
        return reply

    def _receive(self, manifest: Manifest, key: GroupKey, round_: int, shard: int, bounds: tuple[int, int],
                 deadline: float, out: Sink | None) -> ShardReply:
        """A member outside the round's bounded fan-in: shard ``shard``'s aggregate from its owner."""
        while True:
            reply = self._fill_hole(manifest, key, round_, shard, bounds, ask_owner=True,
                                    wait_s=min(5.0, max(0.1, deadline - time.monotonic())), out=out)
            if reply is not None:
                break
            if time.monotonic() >= deadline:
                raise CollectiveError(f"owner of shard {shard} did not send its aggregate")
        self.slots.hold(key.group, round_, shard, reply.blob, reply.contributors, manifest.digest)
        return reply


def _until_superseded(chunks):
    """A part's messages until its slice of a donated payload was overwritten (AggregateSlices): the part
    ends short, and its owner leaves it out as it would a broken stream."""
    try:
        yield from chunks
    except Superseded:
        return
