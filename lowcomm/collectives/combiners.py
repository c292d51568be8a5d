"""What a shard owner does with the contributions it collects, and how members read its reply.

The sharded reduce moves bytes; a combiner gives them meaning:

- ``DenseMean`` (DiLoCo, ddp): each member sends its slice of the flat payload encoded with a
  codec; the owner returns the token-weighted mean, encoded once, or the robust rule the
  algorithm asks for (collectives.robust: median-norm clip, trimmed mean, CenteredClip).
- ``SparseBundle`` (SparseLoCo; DESIGN.md "Sparse payloads"): a reduced sparse shard would cost
  more than its inputs, so the owner only decides the contributor set and returns the
  contributors' own encoded payloads (sorted by sender); every member combines them itself with
  the algorithm's rule (SparseLoCo: clipped scatter-mean), in that fixed order, so all get
  identical values. Shards follow parameter
  boundaries because each parameter is encoded on its own (top-k chunks are per 2-D parameter).
  The owner does not echo a member's own part back to it (``reply_for``): the member puts back
  the bytes it sent (``complete``), so each peer sends (N−1)·S per round for a payload of S, the
  all-gather's bound, instead of (N−1)(N+1)/N·S.

Both raise ``ContributionRejected`` on anything malformed.
"""

from __future__ import annotations

import copy
import math
import struct
import threading
from collections.abc import Callable, Sequence

import torch

from lowcomm.collectives.pieces import piece_bounds
from lowcomm.collectives.reduce_owner import ContributionRejected, check_finite, decode_contribution
from lowcomm.collectives.robust import Aggregate
from lowcomm.compress import Codec, CodecError, SparseCodec, get_codec
from lowcomm.compress.finite import all_finite

MAX_SENDER_BYTES = 64
MAX_CLOSED_HELD = 4  # owners' bundles kept decoded until finished (a round's own shard; another round in flight)
Contribution = tuple[torch.Tensor, torch.Tensor]  # (flat indices, values) of one sender


class DenseMean:
    """Token-weighted mean of dense slices, encoded with ``codec`` (the round's codec name).

    ``aggregate`` (collectives.robust) combines a shard's parts; the default is the plain mean.
    """

    def __init__(self, codec: str, zstd_level: int, aggregate: Aggregate = Aggregate()):
        self.name = codec
        self.zstd_level = zstd_level
        self.aggregate = aggregate

    @property
    def streams(self) -> bool:
        """The mean and the median-clipped mean are reduced piece by piece (the clip from norms the
        senders declare, collectives.streamed_slot); the other rules need every part whole."""
        return self.aggregate.name in ("mean", "median-clip")

    @property
    def clips(self) -> bool:
        return self.aggregate.name == "median-clip"

    def part_norm(self, payload: torch.Tensor, bounds: tuple[int, int],
                  elems: int) -> tuple[float, list[bytes] | None]:
        """The L2 norm its owner will measure of this part, decoded, and (for a lossy codec, whose
        decoded values are known only once encoded) the part's pieces, encoded to send."""
        codec = get_codec(self.name, zstd_level=self.zstd_level)
        part = payload[bounds[0]:bounds[1]]
        if codec.lossless:
            return float(part.norm()), None
        blobs = [codec.encode(part[a:b]) for a, b in piece_bounds(part.numel(), elems)]
        sumsq = sum(float(codec.decode(blob).double().pow(2).sum()) for blob in blobs)
        return math.sqrt(sumsq), blobs

    def numel(self, payload: torch.Tensor) -> int:
        return payload.numel()

    def shard_bounds(self, owners: int, numel: int) -> list[tuple[int, int]]:
        base, extra = divmod(numel, owners)
        bounds, start = [], 0
        for j in range(owners):
            end = start + base + (1 if j < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds

    def encode(self, payload: torch.Tensor, bounds: tuple[int, int]) -> bytes:
        return get_codec(self.name, zstd_level=self.zstd_level).encode(payload[bounds[0]:bounds[1]])

    def own(self, payload: torch.Tensor, bounds: tuple[int, int]):
        """The owner's own slice, refused as any part when it is not finite."""
        return check_finite(payload[bounds[0]:bounds[1]])

    def accept(self, blob: bytes, bounds: tuple[int, int]) -> torch.Tensor:
        return decode_contribution(blob, self.name, bounds[1] - bounds[0])

    def close(self, items: dict[str, tuple[object, float]], bounds: tuple[int, int]) -> bytes:
        if items:  # combined in sender order: the same bytes whatever order the parts arrived in
            mean = self.aggregate([items[sender] for sender in sorted(items)])
        else:  # nobody contributed, not even the owner: an empty round
            mean = torch.zeros(bounds[1] - bounds[0])
        return get_codec(self.name, zstd_level=self.zstd_level).encode(mean)

    def finish(self, blob: bytes, bounds: tuple[int, int]) -> torch.Tensor:
        return decode_contribution(blob, self.name, bounds[1] - bounds[0])

    def max_reply_bytes(self, bounds: tuple[int, int], members: int) -> int:
        return (bounds[1] - bounds[0]) * 4 + (64 << 10)

    def reply_for(self, blob: bytes, recipient: str) -> bytes:
        return blob  # the mean is one blob for everyone

    def complete(self, blob: bytes, me: str, own_part: bytes | None) -> bytes:
        return blob


class SparseBundle:
    """Forward the contributors' per-parameter payloads; members combine them with ``combine``.

    Payload passed to ``start``: one encoded blob per parameter, in parameter order. A shard is a
    run of whole parameters; a member's part is ``u32 count | (u32 length | blob) × count``. The
    owner's bundle is ``u32 contributors | (u8 id length | id | u32 part length | part) × n``,
    sorted by id. In the reply to a contributor, its own entry has the length ``YOURS`` and no
    bytes; holders keep and serve the whole bundle.
    """

    name = "sparse-bundle"

    def __init__(self, shapes: Sequence[tuple[int, ...]], codec_for: Callable[[tuple[int, ...]], Codec],
                 combine: Callable[[list[Contribution], tuple[int, ...], Codec], torch.Tensor]):
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes) + 1)]
        self.codecs = [codec_for(s) for s in self.shapes]
        # decoders bounded by each parameter's size: a part declaring more is refused before decompressing
        self.decoders = [_bounded(codec, size) for codec, size in zip(self.codecs, self.sizes)]
        self.combine = combine  # the algorithm's rule, e.g. SparseLoCo's clipped scatter-mean
        # bounds -> (bundle, its parts decoded): what this owner closed, until its own member finishes it
        self._closed: dict[tuple[int, int], tuple[bytes, list]] = {}
        self._closed_lock = threading.Lock()

    def numel(self, payload: Sequence[bytes]) -> int:
        if len(payload) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} parameter payloads, got {len(payload)}")
        return self.offsets[-1]

    def shard_bounds(self, owners: int, numel: int) -> list[tuple[int, int]]:
        """Parameter-aligned shards: parameter i goes to the owner its first element falls to."""
        first = [min(owners - 1, self.offsets[i] * owners // max(numel, 1)) for i in range(len(self.shapes))]
        bounds = []
        for j in range(owners):
            params = [i for i, owner in enumerate(first) if owner == j]
            start = self.offsets[params[0]] if params else (bounds[-1][1] if bounds else 0)
            end = self.offsets[params[-1] + 1] if params else start
            bounds.append((start, end))
        return bounds

    def _params(self, bounds: tuple[int, int]) -> list[int]:
        return [i for i in range(len(self.shapes)) if bounds[0] <= self.offsets[i] < bounds[1]]

    def encode(self, payload: Sequence[bytes], bounds: tuple[int, int]) -> bytes:
        params = self._params(bounds)
        return struct.pack("<I", len(params)) + b"".join(struct.pack("<I", len(payload[i])) + payload[i]
                                                         for i in params)

    def own(self, payload: Sequence[bytes], bounds: tuple[int, int]):
        part = self.encode(payload, bounds)
        return self.accept(part, bounds)

    def accept(self, blob: bytes, bounds: tuple[int, int]):
        """Validates a member's part: (its bytes, its decoded (indices, values) per parameter)."""
        params = self._params(bounds)
        blobs = _split(memoryview(blob), "part")
        if len(blobs) != len(params):
            raise ContributionRejected(f"part holds {len(blobs)} parameter payloads, the shard has {len(params)}")
        decoded = []
        for i, piece in zip(params, blobs):
            decoded.append(self._decode(i, bytes(piece)))
        return bytes(blob), decoded

    def _decode(self, i: int, blob: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        codec = self.decoders[i]
        try:
            if isinstance(codec, SparseCodec):
                indices, values, shape = codec.decode_sparse(blob)
            else:
                dense = codec.decode(blob)
                shape = tuple(dense.shape)
                indices, values = torch.arange(dense.numel()), dense.reshape(-1)
        except CodecError as e:
            raise ContributionRejected(f"parameter {i}: undecodable payload: {e}") from None
        if tuple(shape) != self.shapes[i]:
            raise ContributionRejected(f"parameter {i}: shape {tuple(shape)}, expected {self.shapes[i]}")
        if not all_finite(values):
            raise ContributionRejected(f"parameter {i}: NaN or Inf values")
        return indices, values.to(torch.float32)

    def close(self, items: dict[str, tuple[object, float]], bounds: tuple[int, int]) -> bytes:
        """The owner's bundle; the parts it decoded on arrival are kept for its own ``finish`` of it."""
        senders = sorted(items)
        blob = _bundle((sender.encode(), items[sender][0][0]) for sender in senders)
        parts = [items[sender][0][1] for sender in senders]
        if all(part is not None for part in parts):
            with self._closed_lock:
                if len(self._closed) >= MAX_CLOSED_HELD:
                    self._closed.pop(next(iter(self._closed)))
                self._closed[tuple(bounds)] = (blob, parts)
        return blob

    def reply_for(self, blob: bytes, recipient: str) -> bytes:
        """The bundle as sent to ``recipient``: its own part left out (it holds those bytes)."""
        entries = _entries(blob)
        if recipient.encode() not in (sender for sender, _ in entries):
            return blob
        return _bundle((sender, None if sender == recipient.encode() else part) for sender, part in entries)

    def complete(self, blob: bytes, me: str, own_part: bytes | None) -> bytes:
        """The whole bundle from a reply: ``own_part`` (what this member sent) where the owner left it out.

        Only this member's own entry may be left out, and only in an owner's reply to its part
        (``own_part`` given); anything else is a malformed reply.
        """
        entries = _entries(blob)
        mine = me.encode()
        for sender, part in entries:
            if part is None and (sender != mine or own_part is None):
                raise ContributionRejected(f"bundle: part of {sender[:40]!r} left out")
        if all(part is not None for _, part in entries):
            return blob
        return _bundle((sender, own_part if part is None else part) for sender, part in entries)

    def finish(self, blob: bytes, bounds: tuple[int, int]) -> torch.Tensor:
        """The shard's aggregate: per parameter, the (clipped) scatter-mean of the contributors."""
        with self._closed_lock:
            closed = self._closed.get(tuple(bounds))
            if closed is not None and (closed[0] is blob or closed[0] == blob):
                del self._closed[tuple(bounds)]
            else:
                closed = None
        if closed is not None:
            parts = closed[1]  # this owner's own bundle: decoded and checked as its parts arrived
        else:
            parts = []
            for sender, part in _entries(blob):
                if part is None:
                    raise ContributionRejected(f"bundle: part of {sender[:40]!r} left out")
                parts.append(self.accept(part, bounds)[1])
        values = []
        for k, i in enumerate(self._params(bounds)):
            contributions = [part[k] for part in parts]
            values.append(self.combine(contributions, self.shapes[i], self.codecs[i]).reshape(-1))
        return torch.cat(values) if values else torch.zeros(0)

    def max_reply_bytes(self, bounds: tuple[int, int], members: int) -> int:
        return members * ((bounds[1] - bounds[0]) * 8 + (64 << 10))


def _bounded(codec: Codec, numel: int) -> Codec:
    """A copy of ``codec`` that decodes at most ``numel`` elements."""
    bounded = copy.copy(codec)
    bounded.max_elements = min(codec.max_elements, max(numel, 1))
    return bounded


YOURS = 0xFFFFFFFF  # a bundle entry's length: the recipient's own part, not echoed back to it


def _bundle(entries) -> bytes:
    """``(sender id, part or None)`` pairs → a bundle (None: left out for its recipient)."""
    out, count = [], 0
    for sender, part in entries:
        length = YOURS if part is None else len(part)
        out.append(struct.pack("<B", len(sender)) + sender + struct.pack("<I", length) + (part or b""))
        count += 1
    return struct.pack("<I", count) + b"".join(out)


def _entries(blob: bytes) -> list[tuple[bytes, bytes | None]]:
    """A bundle → its ``(sender id, part or None)`` entries, in order; malformed → ContributionRejected."""
    view, entries = memoryview(blob), []
    count, pos = _read_u32(view, 0, "bundle")
    for _ in range(count):
        if pos >= len(view):
            raise ContributionRejected("bundle: truncated sender id")
        size = view[pos]
        if size == 0 or size > MAX_SENDER_BYTES or pos + 1 + size > len(view):
            raise ContributionRejected("bundle: bad sender id")
        sender = bytes(view[pos + 1:pos + 1 + size])
        length, pos = _read_u32(view, pos + 1 + size, "bundle")
        if length == YOURS:
            entries.append((sender, None))
            continue
        if pos + length > len(view):
            raise ContributionRejected("bundle: truncated part")
        entries.append((sender, bytes(view[pos:pos + length])))
        pos += length
    if pos != len(view):
        raise ContributionRejected("bundle: trailing bytes")
    if len({sender for sender, _ in entries}) != len(entries):
        raise ContributionRejected("bundle: a sender appears twice")
    return entries


def _read_u32(view: memoryview, pos: int, field: str) -> tuple[int, int]:
    if pos + 4 > len(view):
        raise ContributionRejected(f"{field}: truncated length")
    return struct.unpack_from("<I", view, pos)[0], pos + 4


def _split(view: memoryview, field: str) -> list[memoryview]:
    count, pos = _read_u32(view, 0, field)
    pieces = []
    for _ in range(count):
        length, pos = _read_u32(view, pos, field)
        if pos + length > len(view):
            raise ContributionRejected(f"{field}: truncated payload")
        pieces.append(view[pos:pos + length])
        pos += length
    if pos != len(view):
        raise ContributionRejected(f"{field}: trailing bytes")
    return pieces
