"""The ``q2`` codec: SparseLoCo's 2-bit quantizer (ALGORITHMS.md §3), bins 4, range 6.

Applied to the whole tensor at once, in float32 as Templar does::

    shift = mean(v);  σ = ‖v − shift‖ / sqrt(n − 1);  scale = 6σ / 4   (1.0 if 0 or non-finite)
    q = clamp(round((v − shift) / scale + 2), 0, 3)          (round half to even)
    lookup[b] = mean of (v − shift) over the entries with code b   (0 for an empty bin)
    decode: x̂ = lookup[q] + shift

Every decoded value is the mean of its bin, so it lies within the range of the
inputs that share its code. Payload: shift (f32), lookup (4 × f32), codes four per byte.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from lowcomm.compress.base import Codec, WireDType
from lowcomm.compress.errors import CodecError
from lowcomm.compress.packing import pack_bits, unpack_bits

BINS = 4
RANGE = 6.0
_HEADER = struct.Struct("<5f")  # shift, lookup[0..3]


def quantize2(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Return ``(codes uint8, lookup float32[4], shift, scale)`` for a flat float32 tensor."""
    n = v.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8), torch.zeros(BINS), 0.0, 1.0
    shift = v.mean()
    centered = v - shift
    sigma = centered.norm() / math.sqrt(n - 1) if n > 1 else torch.tensor(float("nan"))
    scale = float(RANGE * sigma / BINS)
    if not math.isfinite(scale) or scale == 0.0:
        scale = 1.0
    codes = (centered / scale).add_(BINS // 2).round_().clamp_(0, BINS - 1).to(torch.uint8)
    bins = codes.to(torch.int64)
    sums = torch.zeros(BINS, dtype=torch.float32).index_add_(0, bins, centered)
    counts = torch.bincount(bins, minlength=BINS)
    lookup = sums / counts.clamp(min=1)
    return codes, lookup, float(shift), scale


class Q2Codec(Codec):
    """2-bit codes with a 4-entry lookup of per-bin means plus a shift; decode gives float32."""

    name = "q2"
    codec_id = 4
    accepted_dtypes = frozenset({WireDType.UINT2})

    def _encode_payload(self, tensor: torch.Tensor) -> tuple[WireDType, bytes]:
        codes, lookup, shift, _ = quantize2(tensor.to(device="cpu", dtype=torch.float32).reshape(-1))
        header = _HEADER.pack(shift, *lookup.tolist())
        return WireDType.UINT2, header + pack_bits(codes.numpy(), 2)

    def _decode_payload(self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview) -> torch.Tensor:
        if len(payload) < _HEADER.size:
            raise CodecError(f"lookup: need shift + {BINS} float32 ({_HEADER.size} bytes), got {len(payload)} bytes")
        shift, *lookup = _HEADER.unpack_from(payload)
        table = np.asarray(lookup, dtype=np.float32)
        if self.check_finite and not (math.isfinite(shift) and np.isfinite(table).all()):
            raise CodecError("lookup: shift or lookup entries are not finite")
        codes = unpack_bits(payload[_HEADER.size :], math.prod(shape), 2, field="codes")
        values = np.take(table, codes) + np.float32(shift)
        return torch.from_numpy(values.astype(np.float32, copy=False))

    def _max_payload_bytes(self, numel: int) -> int:
        return _HEADER.size + -(-numel // 4)

    def _payload_size(self, shape: tuple[int, ...]) -> int:
        return self._max_payload_bytes(math.prod(shape))
