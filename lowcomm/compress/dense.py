"""The ``dense`` codec: every element sent as float32, bfloat16 or float16.

Decode always returns float32: wire values are widened exactly, so float32 on
the wire is lossless (NaN payloads and -0.0 included) and the half types lose
only the rounding of the encode-side cast.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lowcomm.compress.base import Codec, WireDType
from lowcomm.compress.errors import CodecError
from lowcomm.compress.finite import all_finite

# Half types travel as their raw 16-bit patterns because numpy has no bfloat16;
# explicit little-endian numpy dtypes keep the wire independent of the host.
_WIRE = {
    "float32": (WireDType.FLOAT32, torch.float32, torch.float32, "<f4"),
    "bfloat16": (WireDType.BFLOAT16, torch.bfloat16, torch.int16, "<i2"),
    "float16": (WireDType.FLOAT16, torch.float16, torch.int16, "<i2"),
}
_BY_CODE = {code: (torch_dtype, bits_dtype, np_dtype) for code, torch_dtype, bits_dtype, np_dtype in _WIRE.values()}


class DenseCodec(Codec):
    """Send every element; ``dtype`` picks the wire precision (decode gives float32)."""

    name = "dense"
    codec_id = 1
    accepted_dtypes = frozenset(_BY_CODE)

    def __init__(self, *, dtype: str = "float32", **frame_params) -> None:
        super().__init__(**frame_params)
        if dtype not in _WIRE:
            raise ValueError(f"dtype must be one of {sorted(_WIRE)}, got {dtype!r}")
        self.dtype = dtype

    @property
    def lossless(self) -> bool:
        return self.dtype == "float32"

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", dtype={self.dtype!r})"

    def _encode_payload(self, tensor: torch.Tensor) -> tuple[WireDType, bytes]:
        code, torch_dtype, bits_dtype, np_dtype = _WIRE[self.dtype]
        bits = tensor.to(device="cpu", dtype=torch_dtype).reshape(-1).view(bits_dtype).numpy()
        return code, bits.astype(np_dtype, copy=False).tobytes()

    def _decode_payload(self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview) -> torch.Tensor:
        numel = math.prod(shape)
        torch_dtype, bits_dtype, np_dtype = _BY_CODE[dtype_code]
        itemsize = np.dtype(np_dtype).itemsize
        if len(payload) != numel * itemsize:
            raise CodecError(
                f"payload: shape declares {numel} {dtype_code.name.lower()} values "
                f"({numel * itemsize} bytes), got {len(payload)} bytes"
            )
        native = np.frombuffer(payload, dtype=np_dtype).astype(np_dtype[1:], copy=True)
        values = torch.from_numpy(native).view(torch_dtype).to(torch.float32)
        if self.check_finite and not all_finite(values):
            raise CodecError(f"values: {int((~torch.isfinite(values)).sum())} non-finite entries")
        return values

    def _max_payload_bytes(self, numel: int) -> int:
        return 4 * numel

    def _payload_size(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * np.dtype(_WIRE[self.dtype][3]).itemsize
