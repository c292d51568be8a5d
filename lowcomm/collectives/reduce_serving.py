"""The sharded reduce as a server: an owner takes members' parts of its shard and replies the aggregate.

A part's header is checked (its signature, then the caller's places, the round's slot, membership,
weight, the manifest it follows, shard and codec) before anything else is read. A one-blob part
(collectives.reduce_messages) is assembled, checked against its digest, decoded and added; its
reply goes out once the slot closes. A streamed part (collectives.pieces) is read by a thread of
its own, each piece checked and added as it arrives, while the call's own thread sends each
reduced piece back as soon as the slot has it (collectives.streamed_slot). A refused part is a `reject` event and a REJECTED reply,
and the round goes on without it; nothing a remote part does raises into the owner's own round.
A held shard is served only to a caller that names the manifest it was reduced under; a forgotten
round is said so at once (EXPIRED), so a late member stops asking.
"""

from __future__ import annotations

import logging
import math
import threading

from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.pieces import Pieces, check_piece, header_digest, held_replies, reply_pieces
from lowcomm.collectives.reduce_messages import KIND, part_bytes, reply_chunks, signed_header
from lowcomm.collectives.reduce_owner import EXPIRED, ContributionRejected, decode_contribution, validate_weight
from lowcomm.collectives.streamed_slot import StreamedSlot, check_norm
from lowcomm.proto import wire_pb2
from lowcomm.transport.service import Overloaded
from lowcomm.transport.signing import Unauthenticated, check_digest
from lowcomm.transport.wire import WireError, assemble

logger = logging.getLogger(__name__)
PER_SENDER_CALLS = 4  # Reduce calls served at once per claimed sender (the overlap needs 2)
STRANGER_CALLS = 16  # ... and from all senders outside the group's recent manifests (transport.service: 48 in all)
REFUSED = (ContributionRejected, Unauthenticated, WireError, TimeoutError)


def rejected(round_: int, shard: int, error: Exception) -> wire_pb2.ReduceReply:
    return wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.REJECTED, round=round_, shard=shard, error=str(error))


class ReduceServing:
    """ShardedReduce's owner side. Uses its ``me``, ``sync``, ``combiner``, ``codec``, ``max_weight``,
    ``slots``, ``verifier``, ``_calls``, ``_strangers`` and ``on_event``."""

    def _reject(self, round_: int, sender: str, error: Exception) -> None:
        self.slots.rejected += 1
        self.on_event("reject", round=int(round_), sender=sender[:40], error=str(error)[:200])
        logger.warning("round %d: refused a part from %s: %s", round_, sender[:40], error)

    def _serve_reduce(self, requests, context):
        first = next(requests, None)
        if first is None:
            raise ContributionRejected("empty stream")
        try:  # before anything is admitted or waited for: the per-sender cap counts proven senders only
            self.verifier.verify(KIND, signed_header(first), first.sender, first.sender_key, first.signature)
        except Unauthenticated as e:
            self._reject(first.round, first.sender, e)
            yield rejected(first.round, first.shard, e)
            return
        release, stranger = self._calls.admit(first.sender), None
        if release is None:
            error = f"too many Reduce calls at once from {first.sender[:40]!r} (at most {PER_SENDER_CALLS})"
        elif (stranger := self._strangers.admit(first.group, first.sender)) is None:
            release()
            error = f"{first.sender[:40]!r} is in no recent manifest and {STRANGER_CALLS} such calls are served"
        if release is None or stranger is None:
            self._reject(first.round, first.sender, error)
            raise Overloaded(error)
        for callback in (release, stranger, self.slots.wake):
            context.add_callback(callback)
        try:
            yield from self._serve_part(first, requests, context)
        finally:
            release()
            stranger()

    def _serve_part(self, first, requests, context):
        slot = None  # set once the (signed) sender is known to be a member of the round
        try:
            slot = self._slot_for(first, context)
            if isinstance(slot, StreamedSlot):
                streamed, slot = slot, None  # a replayed header must not cost its sender its place
                streamed.begin(first.sender, first.weight, norm=first.norm)
                slot = streamed
            else:
                blob = assemble(first.total_bytes, part_bytes(first, requests),
                                self.combiner.max_reply_bytes(slot.bounds, 1))
                check_digest(blob, first.digest, first.sender)
                slot.add(first.sender, self.combiner.accept(blob, slot.bounds), first.weight)
        except REFUSED as e:
            if slot is not None:  # a member's refused part: the slot closes without waiting for it
                slot.leave_out(first.sender)
            self._reject(first.round, first.sender, e)
            yield rejected(first.round, first.shard, e)
            return
        if isinstance(slot, StreamedSlot):
            yield from self._stream(first, requests, context, slot)
            return
        blob, contributors = slot.result()
        reply = self.combiner.reply_for(blob, first.sender)  # sparse bundles: without the sender's own part
        yield from reply_chunks(reply, contributors, slot.round, slot.shard, self.codec, self.sync.chunk_bytes)

    def _slot_for(self, first, context):
        """The slot ``first``'s part goes to, once the round opened here and the part's header fits it."""
        if first.sender == self.me:
            raise ContributionRejected(f"a remote part claims this owner's own id {first.sender[:40]!r}")
        wait_s = min(max(0.0, context.time_remaining() or 0),
                     self.sync.reduce_timeout_s + self.sync.manifest_s + self.sync.announce_s)
        slot = self.slots.wait_slot(first.group, first.round, timeout=wait_s, active=context.is_active)
        if first.run_id != slot.run:
            raise ContributionRejected(f"part for run {first.run_id[:80]!r}, this owner serves {slot.run!r}")
        if first.sender not in slot.members:
            raise ContributionRejected(f"{first.sender!r} is not a member of round {first.round}")
        # A header signed for another shard (an owner may forward what a member sent it) says nothing
        # of this one: refused, its sender still awaited.
        if first.manifest != slot.manifest:  # a split round: the sender follows another manifest of it
            raise ContributionRejected(f"a part of another manifest of round {first.round} than this owner's")
        if first.shard != slot.shard or first.codec != slot.codec_name:
            raise ContributionRejected(f"shard {first.shard}/codec {first.codec!r} do not match this owner's "
                                       f"shard {slot.shard}/{slot.codec_name!r}")
        streamed = isinstance(slot, StreamedSlot)
        if streamed and (first.pieces != len(slot.pieces) or first.piece_elems != slot.elems):
            raise ContributionRejected(f"a part of {first.pieces} pieces of {first.piece_elems} elements; "
                                       f"this shard has {len(slot.pieces)} of {slot.elems}")
        if not streamed and first.pieces:
            raise ContributionRejected("a streamed part for a shard this owner reduces whole")
        try:  # the sender's own claims for this shard: refused, the round goes on without it
            validate_weight(first.weight, self.max_weight)
            if streamed and slot.clip:
                check_norm(first.norm)
        except ContributionRejected:
            slot.leave_out(first.sender)
            raise
        return slot

    def _stream(self, first, requests, context, slot: StreamedSlot):
        """Takes a streamed part's pieces in a thread of its own while replying each reduced piece."""
        failed: list[Exception] = []
        taker = threading.Thread(target=self._take_pieces, args=(first, requests, slot, failed), daemon=True,
                                 name="reduce-take")
        # counted before the taker runs: its last piece may complete the shard, and the owner take it and drop
        # the reduced pieces (StreamedSlot.replied), before this call's reply has read them
        slot.replying()
        try:
            taker.start()
            for reply in reply_pieces(lambda c: slot.piece(c, context.is_active), len(slot.pieces),
                                      slot.contributors, slot.round, slot.shard, self.codec):
                if failed:
                    break
                yield reply
        except (ContributionRejected, CollectiveError) as e:  # the call ended, or the slot was aborted
            failed.append(e)
        finally:
            slot.replied()  # also when gRPC closes the generator of a cancelled call
        if failed:
            yield rejected(slot.round, slot.shard, failed[0])

    def _take_pieces(self, first, requests, slot: StreamedSlot, failed: list) -> None:
        head = header_digest(signed_header(first))
        try:
            for c, (start, end) in enumerate(slot.pieces):
                message = next(requests, None)
                if message is None:
                    raise ContributionRejected(f"part ended after {c} of its {len(slot.pieces)} pieces")
                data = check_piece(self.verifier, first, head, c, message, slot.elems)
                slot.add(first.sender, c, decode_contribution(data, slot.codec_name, end - start))
        except Exception as e:  # hostile or broken: the round goes on without the rest of this part
            failed.append(e)
            slot.leave_out(first.sender)
            self._reject(first.round, first.sender, e)

    def _serve_shard(self, request, context):
        context.add_callback(self.slots.wake)
        wait_s = min(max(request.wait_s, 0.0), 5.0) if math.isfinite(request.wait_s) else 0.0
        held = self.slots.held(request.group, request.round, request.shard, timeout=wait_s,
                               manifest=request.manifest, active=context.is_active)
        if isinstance(held, str):
            status = wire_pb2.ReduceReply.EXPIRED if held == EXPIRED else wire_pb2.ReduceReply.NOT_READY
            yield wire_pb2.ReduceReply(status=status, round=request.round, shard=request.shard, error=held)
            return
        if isinstance(held[0], Pieces):
            yield from held_replies(held[0], held[1], request.round, request.shard, self.codec)
            return
        yield from reply_chunks(held[0], held[1], request.round, request.shard, self.codec, self.sync.chunk_bytes)
