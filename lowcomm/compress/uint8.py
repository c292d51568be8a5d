"""The ``uint8`` codec: INTELLECT-1's 8-bit quantizer with a per-tensor codebook.

ALGORITHMS.md §1, no mean subtraction::

    σ = ‖x‖ / sqrt(n − 1)   (n = 1: ‖x‖);   scale = 6σ / 256   (1.0 if 0 or non-finite)
    q = clamp(round(x / scale) + 128, 0, 255)
    codebook[b] = mean of the x with q = b   (0 for empty bins)
    decode: x̂ = codebook[q]

Payload: 256 float32 codebook entries, then one uint8 code per element.
Decode returns float32. Non-finite inputs land in a bin whose codebook entry
becomes non-finite, which ``check_finite`` on the receiver rejects.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lowcomm.compress.base import Codec, WireDType
from lowcomm.compress.errors import CodecError

NUM_BINS = 256
ZERO_POINT = 128
RANGE_SIGMAS = 6.0
_CODEBOOK_BYTES = NUM_BINS * 4


def quantization_scale(x: torch.Tensor) -> float:
    """Bin width for ``x``; float64 so the norm of large values does not overflow."""
    n = x.numel()
    if n == 0:
        return 1.0
    sigma = torch.linalg.vector_norm(x.to(torch.float64)).item() / math.sqrt(max(n - 1, 1))
    scale = RANGE_SIGMAS * sigma / NUM_BINS
    return scale if math.isfinite(scale) and scale > 0.0 else 1.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(codes uint8, codebook float32[256])`` for a flat tensor."""
    x64 = x.to(torch.float64)
    scaled = x64 / quantization_scale(x64)
    # In place: this is the hot loop on 16M-element shards.
    scaled.round_().add_(ZERO_POINT).clamp_(0, NUM_BINS - 1)
    torch.nan_to_num_(scaled, nan=float(ZERO_POINT))
    codes = scaled.to(torch.uint8)
    bins = codes.to(torch.int64)
    sums = torch.bincount(bins, weights=x64, minlength=NUM_BINS)
    counts = torch.bincount(bins, minlength=NUM_BINS)
    codebook = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return codes, codebook.to(torch.float32)


class Uint8Codec(Codec):
    """8-bit codes plus a 256-entry float32 codebook of per-bin means."""

    name = "uint8"
    codec_id = 2
    accepted_dtypes = frozenset({WireDType.UINT8})

    def _encode_payload(self, tensor: torch.Tensor) -> tuple[WireDType, bytes]:
        codes, codebook = quantize(tensor.to("cpu").reshape(-1))
        wire_codebook = codebook.numpy().astype("<f4", copy=False).tobytes()
        return WireDType.UINT8, wire_codebook + codes.numpy().tobytes()

    def _decode_payload(self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview) -> torch.Tensor:
        numel = math.prod(shape)
        if len(payload) < _CODEBOOK_BYTES:
            raise CodecError(f"codebook: need {NUM_BINS} float32 ({_CODEBOOK_BYTES} bytes), got {len(payload)} bytes")
        codes_bytes = len(payload) - _CODEBOOK_BYTES
        if codes_bytes != numel:
            raise CodecError(f"codes: shape declares {numel} elements, payload holds {codes_bytes} codes")
        codebook = np.frombuffer(payload[:_CODEBOOK_BYTES], dtype="<f4").astype(np.float32)
        if self.check_finite and not np.isfinite(codebook).all():
            raise CodecError(f"codebook: {int((~np.isfinite(codebook)).sum())} non-finite entries")
        codes = np.frombuffer(payload[_CODEBOOK_BYTES:], dtype=np.uint8)
        return torch.from_numpy(np.take(codebook, codes))

    def _max_payload_bytes(self, numel: int) -> int:
        return _CODEBOOK_BYTES + numel

    def _payload_size(self, shape: tuple[int, ...]) -> int:
        return self._max_payload_bytes(math.prod(shape))
