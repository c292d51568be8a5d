"""The bytes of one pushed contribution: a list of tensors, one codec frame each, checked against the model.

    blob = u32 count | (u32 length | frame) × count          (little-endian; frames: lowcomm.compress)

The receiver knows the shapes it expects, in order (its own model's). A blob is accepted only if
it holds exactly that many frames and every frame decodes with the round's codec (the frame's
codec id must match), has the expected shape, holds only finite values and is no larger than
that codec's frame for that shape with zstd off (zstd only ever shrinks a frame). Anything else
raises ``ContributionRejected``; nothing is allocated beyond those bounds.

Codec names (``[noloco] codec``): ``fp32`` (lossless), ``bf16`` (dense bfloat16, decoded to
float32) and ``uint8`` (INTELLECT-1's 8-bit codebook, one codebook per tensor).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from lowcomm.collectives.reduce_owner import ContributionRejected
from lowcomm.compress import Codec, CodecError, get_codec
from lowcomm.compress.finite import all_finite

WIRE_CODECS: dict[str, tuple[str, dict]] = {
    "fp32": ("dense", {"dtype": "float32"}),
    "bf16": ("dense", {"dtype": "bfloat16"}),
    "uint8": ("uint8", {}),
}
_U32 = struct.Struct("<I")


class TensorListFormat:
    """Encodes and validates a list of float tensors of fixed ``shapes`` with the codec ``codec_name``."""

    def __init__(self, codec_name: str, shapes: Sequence[tuple[int, ...]], zstd_level: int = 0):
        if codec_name not in WIRE_CODECS:
            raise ValueError(f"codec {codec_name!r}: use one of {', '.join(WIRE_CODECS)}")
        name, params = WIRE_CODECS[codec_name]
        self.codec_name = codec_name
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.codecs: list[Codec] = [get_codec(name, **params, zstd_level=zstd_level, check_finite=True,
                                              max_elements=max(1, math.prod(shape))) for shape in self.shapes]
        self.frame_limits = [codec.raw_size(shape) for codec, shape in zip(self.codecs, self.shapes)]
        self.max_bytes = _U32.size * (1 + len(self.shapes)) + sum(self.frame_limits)

    def encode(self, tensors: Sequence[torch.Tensor]) -> bytes:
        if len(tensors) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} tensors, got {len(tensors)}")
        out = [_U32.pack(len(tensors))]
        for codec, tensor in zip(self.codecs, tensors):
            frame = codec.encode(tensor.detach().to("cpu", torch.float32))
            out += [_U32.pack(len(frame)), frame]
        return b"".join(out)

    def decode(self, blob: bytes) -> list[torch.Tensor]:
        """The tensors of a received blob (float32, the expected shapes); ContributionRejected otherwise."""
        if len(blob) > self.max_bytes:
            raise ContributionRejected(f"blob of {len(blob)} bytes exceeds the limit of {self.max_bytes}")
        view = memoryview(blob)
        count, pos = _read_u32(view, 0)
        if count != len(self.shapes):
            raise ContributionRejected(f"blob holds {count} tensors, the model has {len(self.shapes)}")
        tensors = []
        for i, (codec, shape, limit) in enumerate(zip(self.codecs, self.shapes, self.frame_limits)):
            length, pos = _read_u32(view, pos)
            if length > limit or pos + length > len(view):
                raise ContributionRejected(f"tensor {i}: frame of {length} bytes (limit {limit}, "
                                           f"{len(view) - pos} left in the blob)")
            try:
                values = codec.decode(bytes(view[pos:pos + length]))
            except CodecError as e:
                raise ContributionRejected(f"tensor {i}: undecodable frame: {e}") from None
            if tuple(values.shape) != shape:
                raise ContributionRejected(f"tensor {i}: shape {tuple(values.shape)}, expected {shape}")
            if values.dtype != torch.float32 or not all_finite(values):
                raise ContributionRejected(f"tensor {i}: {values.dtype} or non-finite values")
            tensors.append(values)
            pos += length
        if pos != len(view):
            raise ContributionRejected(f"blob: {len(view) - pos} trailing bytes")
        return tensors


def _read_u32(view: memoryview, pos: int) -> tuple[int, int]:
    if pos + _U32.size > len(view):
        raise ContributionRejected("blob: truncated length field")
    return _U32.unpack_from(view, pos)[0], pos + _U32.size
