"""The sharded reduce's messages: a member's signed part as chunks, an owner's reply as chunks.

A part's first chunk carries the header (run, group, round, epoch, sender, shard, weight, codec,
size, sha256 of the blob, pieces, piece size and norm: 0 here, and the manifest's digest) with the
sender's key and its signature over that header (transport.signing); later chunks carry only bytes.
A streamed part's messages are in collectives.pieces. A reply's first chunk carries the status, the
contributor list and the size; later chunks only bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import Signer, digest
from lowcomm.transport.wire import slices

KIND = "reduce"  # what the signature says the call is


def part_chunks(signer: Signer, header: dict, blob: bytes, chunk_bytes: int) -> Iterator[wire_pb2.ReduceChunk]:
    """``blob`` as a signed part: ``header`` holds every header field but the digest and size."""
    header = {**header, "sender": signer.peer_id, "total_bytes": len(blob), "digest": digest(blob), "pieces": 0,
              "piece_elems": 0, "norm": 0.0}
    sender_key, signature = signer.sign(KIND, header)
    for i, data in enumerate(slices(blob, chunk_bytes)):
        if i == 0:
            yield wire_pb2.ReduceChunk(**header, data=data, sender_key=sender_key, signature=signature)
        else:
            yield wire_pb2.ReduceChunk(data=data)


def signed_header(first: wire_pb2.ReduceChunk) -> dict:
    """The header fields of a part's first chunk that its signature covers (as `part_chunks` signs them)."""
    return dict(run_id=first.run_id, group=first.group, round=first.round, epoch=first.epoch, sender=first.sender,
                shard=first.shard, weight=first.weight, codec=first.codec, total_bytes=first.total_bytes,
                digest=first.digest, pieces=first.pieces, piece_elems=first.piece_elems, norm=first.norm,
                manifest=first.manifest)


def part_bytes(first: wire_pb2.ReduceChunk, requests) -> Iterator[bytes]:
    """The bytes of a part's stream, its first chunk's included."""
    yield first.data
    for chunk in requests:
        yield chunk.data


def reply_chunks(blob: bytes, contributors: list[str], round_: int, shard: int, codec: str,
                 chunk_bytes: int) -> Iterator[wire_pb2.ReduceReply]:
    for i, data in enumerate(slices(blob, chunk_bytes)):
        if i == 0:
            yield wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.OK, round=round_, shard=shard,
                                       contributors=contributors, codec=codec, total_bytes=len(blob), data=data)
        else:
            yield wire_pb2.ReduceReply(data=data)
