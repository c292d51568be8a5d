"""The ``topk`` codec: SparseLoCo's chunked top-k by magnitude (ALGORITHMS.md §3).

Chunks: the largest divisor ≤ ``chunk`` (default 64) per dimension. k is clamped
to an even number ≥ 2 and ≤ the chunk length rounded down to even (a chunk of 1
element is sent whole). Indices are 12-bit packed for chunks ≤ 4096 elements,
else 16- or 32-bit. The kept values of the whole tensor go through one value
codec (``values``): ``q2`` (default, Templar's 2-bit quantizer), ``fp8``,
``uint8``, or plain ``float32``/``bfloat16``/``float16``. Decode scatters the
decoded values back (float32, zeros elsewhere); ``transmitted(x)`` is that same
reconstruction, so error feedback absorbs both sparsification and quantization.
"""

from __future__ import annotations

import torch

from lowcomm.compress.base import Codec, WireDType
from lowcomm.compress.dense import DenseCodec
from lowcomm.compress.errors import CodecError
from lowcomm.compress.fp8 import Fp8Codec
from lowcomm.compress.packing import index_width_topk
from lowcomm.compress.q2 import Q2Codec
from lowcomm.compress.sparse import SparseCodec
from lowcomm.compress.uint8 import Uint8Codec

VALUE_CODECS = ("q2", "fp8", "uint8", "float32", "bfloat16", "float16")


def clamp_k(k: int, block_len: int) -> int:
    """Even k in [2, block_len rounded down to even]; a 1-element chunk keeps its element."""
    if block_len < 2:
        return block_len
    return min(max(2, k - k % 2), block_len - block_len % 2)


class TopKCodec(SparseCodec):
    """Chunked top-k with packed indices and quantized values; decode gives float32."""

    name = "topk"
    codec_id = 5

    def __init__(self, *, chunk: int = 64, k: int = 64, values: str = "q2", **frame_params) -> None:
        super().__init__(chunk=chunk, k=k, **frame_params)
        if values not in VALUE_CODECS:
            raise ValueError(f"values must be one of {list(VALUE_CODECS)}, got {values!r}")
        self.values = values
        inner = {"zstd_level": 0, "max_elements": self.max_elements, "check_finite": self.check_finite}
        self._value_codecs: dict[WireDType, Codec] = {
            WireDType.UINT2: Q2Codec(**inner),
            WireDType.FLOAT8_E4M3: Fp8Codec(**inner),
            WireDType.UINT8: Uint8Codec(**inner),
            WireDType.FLOAT32: DenseCodec(dtype="float32", **inner),
            WireDType.BFLOAT16: DenseCodec(dtype="bfloat16", **inner),
            WireDType.FLOAT16: DenseCodec(dtype="float16", **inner),
        }
        self._encoder = {
            "q2": WireDType.UINT2,
            "fp8": WireDType.FLOAT8_E4M3,
            "uint8": WireDType.UINT8,
            "float32": WireDType.FLOAT32,
            "bfloat16": WireDType.BFLOAT16,
            "float16": WireDType.FLOAT16,
        }[values]

    accepted_dtypes = frozenset(
        {WireDType.UINT2, WireDType.FLOAT8_E4M3, WireDType.UINT8, WireDType.FLOAT32, WireDType.BFLOAT16, WireDType.FLOAT16}
    )

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", values={self.values!r})"

    def effective_k(self, block_len: int) -> int:
        return clamp_k(self.k, block_len)

    def index_width(self, block_len: int) -> int:
        return index_width_topk(block_len)

    def _encode_values(self, values: torch.Tensor) -> tuple[WireDType, bytes, torch.Tensor]:
        codec = self._value_codecs[self._encoder]
        dtype_code, data = codec._encode_payload(values)
        return dtype_code, data, codec._decode_payload(dtype_code, (values.numel(),), memoryview(data)).reshape(-1)

    def _decode_values(self, dtype_code: WireDType, count: int, data: memoryview) -> torch.Tensor:
        codec = self._value_codecs[dtype_code]
        try:
            return codec._decode_payload(dtype_code, (count,), data).reshape(-1)
        except CodecError as exc:
            raise CodecError(f"values ({codec.name}): {exc}") from None

    def _values_size(self, count: int) -> int:
        return self._value_codecs[self._encoder]._payload_size((count,))

    def _max_values_bytes(self, count: int) -> int:
        return max(codec._max_payload_bytes(count) for codec in self._value_codecs.values())
