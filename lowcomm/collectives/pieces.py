"""A streamed dense part and reply: the shard cut into pieces that travel, and are reduced, one by one.

A dense mean needs no piece of a shard to wait for another, so a member sends its slice of a
shard as pieces of ``piece_elems`` elements, each encoded on its own, and the owner reduces piece
c as soon as every member's piece c is in and sends it back at once: links never idle between the
two phases of the reduce, and nobody holds a whole encoded part or reply at once (Decision 30 in
docs/round-protocol.md).

A streamed part is a header message (the signed header of collectives.reduce_messages, with
``pieces`` and ``piece_elems`` set and no data), then one message per piece: its index, its
bytes, their sha256 and the sender's signature over (the header's digest, the index, the piece's
digest). An owner checks each piece before it decodes it, so a piece it reduces is the sender's.
A streamed reply is one message per reduced piece; the first says how many, the last names the
contributors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.held_shards import Pieces
from lowcomm.collectives.reduce_messages import KIND
from lowcomm.collectives.reduce_owner import ContributionRejected, decode_contribution
from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import Signer, Unauthenticated, Verifier, digest, signed_bytes
from lowcomm.transport.wire import MAX_CHUNK_BYTES

T = TypeVar("T")
PIECE_KIND = "reduce-piece"  # what a piece's signature says it is
MIN_PIECE_ELEMS = 1 << 14  # 64 KiB of float32: a piece's signature stays a small share of its bytes
PIECE_SLACK_BYTES = 4 << 10  # a piece's codec frame beyond 4 bytes per element (header, zstd's worst case)


class Superseded(CollectiveError):
    """A shard's reader was replaced (it timed out, or its round ended): it stops."""


class Sink:
    """Where one reader of a shard decodes its pieces: ``write(start, end, values)``, and the shard's ``values``."""

    def __init__(self, values: torch.Tensor, write: Callable[[int, int, torch.Tensor], None] | None = None):
        self.values = values
        self.write = write or (lambda start, end, piece: values[start:end].copy_(piece))


class AggregateSlices:
    """A streamed round's aggregate, one slice per shard, each written only by the reader that holds it
    now: a reader that timed out and was replaced (by a hole filler, by zeros for a lost shard, or by
    the round's end) writes nothing more, so no late reply reaches values the round already gave out.

    Built on a donated payload (``into``: Collective.start's ``donate``), a shard's slice is also this
    member's part of that shard, which is read piece by piece as it is sent (``read_part``). An honest owner
    replies piece c only after it has this member's piece c, so a reply never overtakes the part. A
    write that would (a reply ahead of the part, a hole filled or zeroed while the part still streams)
    first ends the part: its next read raises Superseded, so no aggregate value is ever sent as a part
    (an owner's own part is not sent: its slot holds views of it until the shard is reduced)."""

    def __init__(self, numel: int, bounds: list[tuple[int, int]], into: torch.Tensor | None = None):
        if into is not None and (into.numel() != numel or into.dtype != torch.float32 or not into.is_contiguous()):
            raise ValueError("a donated payload must be a contiguous float32 tensor of the aggregate's size")
        self.tensor = torch.empty(numel) if into is None else into
        self.donated = into is not None
        self._bounds = bounds
        self._holders: list[object | None] = [None] * len(bounds)
        self._lock = threading.Lock()
        self._parts = [threading.Lock() for _ in bounds]  # taken before self._lock
        self._read = [0] * len(bounds)  # donated: the elements of each shard's part read so far
        self._ended = [False] * len(bounds)

    def read_part(self, shard: int, read: Callable[[], T], upto: int) -> T:
        """``read()`` of this member's part of ``shard`` as it is sent, ``upto`` the shard-relative element it
        reads to; on a donated payload, refused (Superseded) once a write reached past what the part read."""
        if not self.donated:
            return read()
        with self._parts[shard]:
            if self._ended[shard]:
                raise Superseded(f"shard {shard}: its aggregate was written before this member's part was sent")
            result = read()
            self._read[shard] = max(self._read[shard], upto)
            return result

    def _reaching(self, shard: int, end: int) -> None:
        """Under ``self._parts[shard]``: a write up to ``end`` ends a part not yet read that far."""
        if self.donated and self._read[shard] < end:
            self._ended[shard] = True

    def sink(self, shard: int) -> Sink:
        """A new reader of ``shard``; whoever held it before writes no more."""
        token, (a, b) = object(), self._bounds[shard]
        with self._lock:
            self._holders[shard] = token

        def write(start: int, end: int, values: torch.Tensor) -> None:
            with self._parts[shard]:
                self._reaching(shard, end)
                with self._lock:
                    if self._holders[shard] is not token:
                        raise Superseded(f"shard {shard}: a later reader took it over, or its round ended")
                    self.tensor[a + start:a + end].copy_(values)

        return Sink(self.tensor[a:b], write)

    def zero(self, shard: int) -> torch.Tensor:
        """A lost shard: zeros, and no reader writes it any more."""
        a, b = self._bounds[shard]
        with self._parts[shard]:
            self._reaching(shard, b - a)
            with self._lock:
                self._holders[shard] = None
                return self.tensor[a:b].zero_()

    def close(self) -> torch.Tensor:
        """The round's values: no reader writes them any more."""
        with self._lock:
            self._holders = [None] * len(self._bounds)
            return self.tensor


def piece_elems(chunk_bytes: int) -> int:
    """Elements per piece: one float32 piece fills one message of ``chunk_bytes`` (at least MIN_PIECE_ELEMS)."""
    return max(MIN_PIECE_ELEMS, min(chunk_bytes, MAX_CHUNK_BYTES) // 4)


def piece_bounds(numel: int, elems: int) -> list[tuple[int, int]]:
    """The pieces of a shard of ``numel`` elements, relative to its start; an empty shard has one empty piece."""
    if numel == 0:
        return [(0, 0)]
    return [(start, min(start + elems, numel)) for start in range(0, numel, elems)]


def max_piece_bytes(elems: int) -> int:
    return 4 * elems + PIECE_SLACK_BYTES


def header_digest(header: dict) -> bytes:
    """What binds a piece to its part: the sha256 of the part's signed header."""
    return digest(signed_bytes(KIND, header))


def part_pieces(signer: Signer, header: dict, encode: Callable[[int, int], bytes], numel: int,
                elems: int, norm: float = 0.0, encoded: list[bytes] | None = None) -> Iterator[wire_pb2.ReduceChunk]:
    """A streamed part: ``header`` holds every header field but the sender and the piece fields;
    ``encode(start, end)`` encodes the elements [start, end) of the shard, called as each piece is sent
    (or ``encoded``: the pieces, encoded already); ``norm``: the decoded part's norm, for a clipping owner."""
    bounds = piece_bounds(numel, elems)
    header = {**header, "sender": signer.peer_id, "total_bytes": 0, "digest": b"", "pieces": len(bounds),
              "piece_elems": elems, "norm": float(norm)}
    sender_key, signature = signer.sign(KIND, header)
    yield wire_pb2.ReduceChunk(**header, sender_key=sender_key, signature=signature)
    head = header_digest(header)
    for c, (start, end) in enumerate(bounds):
        blob = encoded[c] if encoded is not None else encode(start, end)
        piece_digest = digest(blob)
        _, piece_signature = signer.sign(PIECE_KIND, {"head": head, "piece": c, "digest": piece_digest})
        yield wire_pb2.ReduceChunk(piece=c, data=blob, digest=piece_digest, signature=piece_signature)


def check_piece(verifier: Verifier, first: wire_pb2.ReduceChunk, head: bytes, c: int,
                message: wire_pb2.ReduceChunk, elems: int) -> bytes:
    """Piece ``c`` of ``first``'s part, when it is the next piece, within its size and signed by its
    sender; else ContributionRejected or Unauthenticated."""
    if message.piece != c:
        raise ContributionRejected(f"piece {message.piece} came where piece {c} was due")
    if len(message.data) > max_piece_bytes(elems):
        raise ContributionRejected(f"piece {c} holds {len(message.data)} bytes, more than {elems} elements need")
    if digest(message.data) != message.digest:
        raise Unauthenticated(f"piece {c} from {first.sender[:40]!r} does not match its digest")
    verifier.verify(PIECE_KIND, {"head": head, "piece": c, "digest": message.digest}, first.sender,
                    first.sender_key, message.signature)
    return message.data


def reply_pieces(piece: Callable[[int], bytes], count: int, contributors: Callable[[], list[str]], round_: int,
                 shard: int, codec: str) -> Iterator[wire_pb2.ReduceReply]:
    """A streamed reply: ``piece(c)`` (which may wait for it) per piece; the last message names
    ``contributors()``, asked once every piece is out."""
    for c in range(count):
        data = piece(c)
        reply = wire_pb2.ReduceReply(data=data)
        if c == 0:
            reply.MergeFrom(wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.OK, round=round_, shard=shard,
                                                 codec=codec, pieces=count))
        if c == count - 1:
            reply.contributors.extend(contributors())
        yield reply


def held_replies(held: Pieces, contributors: list[str], round_: int, shard: int,
                 codec: str) -> Iterator[wire_pb2.ReduceReply]:
    """A held streamed shard, served to a member that lost it."""
    return reply_pieces(held.__getitem__, len(held), lambda: list(contributors), round_, shard, codec)


def read_pieces(messages, codec: str, numel: int, elems: int, out: Sink,
                keep: bool = True) -> tuple[Pieces | None, list[str]]:
    """A streamed reply → its pieces (None unless ``keep``) and contributors, each piece decoded into
    ``out`` (numel elements) as it arrives; anything malformed raises ContributionRejected."""
    bounds = piece_bounds(numel, elems)
    datas, contributors = [], []
    for c, message in enumerate(messages):
        if message.status != wire_pb2.ReduceReply.OK:
            raise ContributionRejected(f"refused at piece {c}: {message.error[:200]}")
        if c == 0 and message.pieces != len(bounds):
            raise ContributionRejected(f"reply of {message.pieces} pieces, the shard has {len(bounds)}")
        if c >= len(bounds):
            raise ContributionRejected(f"reply carries more than its {len(bounds)} pieces")
        if len(message.data) > max_piece_bytes(elems):
            raise ContributionRejected(f"reply piece {c} holds {len(message.data)} bytes")
        start, end = bounds[c]
        out.write(start, end, decode_contribution(message.data, codec, end - start))
        datas.append(message.data if keep else None)
        contributors = list(message.contributors)
    if len(datas) != len(bounds):
        raise ContributionRejected(f"reply ended after {len(datas)} of its {len(bounds)} pieces")
    return (Pieces(datas) if keep else None), contributors


def decode_pieces(pieces: Pieces, codec: str, numel: int, elems: int, out: Sink) -> None:
    """An owner's own reduced pieces decoded into ``out``: every member applies the same decoded bytes."""
    for (start, end), data in zip(piece_bounds(numel, elems), pieces):
        out.write(start, end, decode_contribution(data, codec, end - start))
