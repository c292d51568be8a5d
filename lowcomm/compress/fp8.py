"""The ``fp8`` codec: float8 e4m3 codes with one float32 scale per row (torchft style).

Rows are the last dimension (a 0-D or 1-D tensor is one row). Per row::

    scale = max|x| / 448   (1.0 if 0 or non-finite);   code = e4m3(clamp(x / scale, ±448))
    decode: x̂ = float32(code) · scale

e4m3 keeps 3 mantissa bits, so |x̂ − x| ≤ max(2⁻⁴·|x|, 2⁻¹⁰·scale) (the second
term covers subnormals). NaN stays NaN; ±inf makes its row's scale 1 and saturates
to ±448. Payload: the row scales (float32), then one byte per element.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lowcomm.compress.base import Codec, WireDType
from lowcomm.compress.errors import CodecError
from lowcomm.compress.finite import all_finite

E4M3_MAX = 448.0


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) the codec scales by: the last dimension is a row."""
    if len(shape) <= 1:
        return 1, math.prod(shape)
    return math.prod(shape[:-1]), shape[-1]


class Fp8Codec(Codec):
    """e4m3 codes, one float32 scale per row; decode gives float32."""

    name = "fp8"
    codec_id = 3
    accepted_dtypes = frozenset({WireDType.FLOAT8_E4M3})

    def _encode_payload(self, tensor: torch.Tensor) -> tuple[WireDType, bytes]:
        rows, cols = rows_of(tuple(tensor.shape))
        x = tensor.to(device="cpu", dtype=torch.float32).reshape(rows, cols)
        if cols:
            scale = x.abs().amax(dim=1) / E4M3_MAX
            scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
        else:
            scale = torch.ones(rows)
        codes = (x / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        wire_scale = scale.numpy().astype("<f4", copy=False).tobytes()
        return WireDType.FLOAT8_E4M3, wire_scale + codes.view(torch.uint8).numpy().tobytes()

    def _decode_payload(self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview) -> torch.Tensor:
        rows, cols = rows_of(shape)
        if len(payload) != rows * (4 + cols):
            raise CodecError(
                f"payload: {rows} rows of {cols} need {rows * 4} scale bytes + {rows * cols} codes, got {len(payload)} bytes"
            )
        scale = np.frombuffer(payload[: 4 * rows], dtype="<f4").astype(np.float32)
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise CodecError("scales: every row scale must be finite and > 0")
        codes = torch.from_numpy(np.frombuffer(payload[4 * rows :], dtype=np.uint8).copy())
        values = codes.view(torch.float8_e4m3fn).to(torch.float32).reshape(rows, cols) * torch.from_numpy(scale)[:, None]
        if self.check_finite and not all_finite(values):
            raise CodecError(f"values: {int((~torch.isfinite(values)).sum())} non-finite entries")
        return values

    def _max_payload_bytes(self, numel: int) -> int:
        return 5 * numel + 4

    def _payload_size(self, shape: tuple[int, ...]) -> int:
        rows, cols = rows_of(shape)
        return rows * (4 + cols)
