"""The ``dct-topk`` codec: DeMo's block DCT plus top-k per block (ALGORITHMS.md §2).

Chunk edge = largest divisor ≤ ``chunk`` (s, default 64) per dimension, an
orthonormal DCT-II per block, the k (default 32, at most the block length)
largest-magnitude coefficients per block. Indices are u8/u16/u32 by block length
(Psyche). Values travel as ``dtype`` floats, or with ``sign=True`` as 1 bit each
(LSB first, bit 1 = negative; decoded as 1 − 2b) followed by ``zeros u32`` and
that many u32 positions of kept values that are exactly 0 (decoded as 0). One bit
cannot say "zero", and without the list an all-zero block (an embedding row no
batch touched) would decode to ±1 and move the model; normally the list is empty
and costs 4 bytes.

``decode`` gives the inverse DCT of the scattered coefficients; ``decode_sparse``
gives the coefficients themselves for a scatter-mean before ``inverse``.
``transmitted(x)`` is the inverse DCT of the *unquantized* selected coefficients
in sign mode (what DeMo subtracts from its residual), of the wire values otherwise.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from lowcomm.compress.base import WireDType
from lowcomm.compress.chunking import Blocking
from lowcomm.compress.dct import block_dct, block_idct
from lowcomm.compress.dense import DenseCodec
from lowcomm.compress.errors import CodecError
from lowcomm.compress.packing import index_width_dct, pack_bits, unpack_bits
from lowcomm.compress.sparse import SparseCodec

_COUNT = struct.Struct("<I")
_FLOAT_CODES = {"float32": WireDType.FLOAT32, "bfloat16": WireDType.BFLOAT16, "float16": WireDType.FLOAT16}


class DctTopKCodec(SparseCodec):
    """Block-DCT top-k with float or 1-bit sign values; decode gives float32."""

    name = "dct-topk"
    codec_id = 6
    accepted_dtypes = frozenset({WireDType.SIGN1, *_FLOAT_CODES.values()})

    def __init__(self, *, chunk: int = 64, k: int = 32, sign: bool = False, dtype: str = "float32", **frame_params) -> None:
        super().__init__(chunk=chunk, k=k, **frame_params)
        if not isinstance(sign, bool):
            raise ValueError(f"sign must be a bool, got {sign!r}")
        if dtype not in _FLOAT_CODES:
            raise ValueError(f"dtype must be one of {sorted(_FLOAT_CODES)}, got {dtype!r}")
        self.sign = sign
        self.dtype = dtype
        inner = {"zstd_level": 0, "max_elements": self.max_elements, "check_finite": self.check_finite}
        self._floats = {code: DenseCodec(dtype=name, **inner) for name, code in _FLOAT_CODES.items()}

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", sign={self.sign}, dtype={self.dtype!r})"

    def effective_k(self, block_len: int) -> int:
        return min(self.k, block_len)

    def index_width(self, block_len: int) -> int:
        return index_width_dct(block_len)

    def _transform(self, blocks: torch.Tensor, blocking: Blocking) -> torch.Tensor:
        return block_dct(blocks, blocking.edges)

    def _inverse(self, blocks: torch.Tensor, blocking: Blocking) -> torch.Tensor:
        return block_idct(blocks, blocking.edges)

    def _transmitted_values(self, selected: torch.Tensor, wire: torch.Tensor) -> torch.Tensor:
        return selected if self.sign else wire

    def _encode_values(self, values: torch.Tensor) -> tuple[WireDType, bytes, torch.Tensor]:
        if self.sign:
            negative = (values < 0).to(torch.uint8)
            zeros = torch.nonzero(values == 0).reshape(-1)
            data = pack_bits(negative.numpy(), 1) + _COUNT.pack(zeros.numel()) + zeros.numpy().astype("<u4").tobytes()
            wire = 1.0 - 2.0 * negative.to(torch.float32)
            wire[zeros] = 0.0
            return WireDType.SIGN1, data, wire
        code = _FLOAT_CODES[self.dtype]
        dtype_code, data = self._floats[code]._encode_payload(values)
        return dtype_code, data, self._floats[code]._decode_payload(dtype_code, (values.numel(),), memoryview(data))

    def _decode_values(self, dtype_code: WireDType, count: int, data: memoryview) -> torch.Tensor:
        if dtype_code == WireDType.SIGN1:
            return _decode_signs(data, count)
        try:
            return self._floats[dtype_code]._decode_payload(dtype_code, (count,), data)
        except CodecError as exc:
            raise CodecError(f"values: {exc}") from None

    def _values_size(self, count: int) -> int:
        if self.sign:
            return -(-count // 8) + _COUNT.size
        return self._floats[_FLOAT_CODES[self.dtype]]._payload_size((count,))

    def _max_values_bytes(self, count: int) -> int:
        return 5 * count + _COUNT.size


def _decode_signs(data: memoryview, count: int) -> torch.Tensor:
    sign_bytes = -(-count // 8)
    if len(data) < sign_bytes + _COUNT.size:
        raise CodecError(f"signs: {count} signs and a zero count need {sign_bytes + _COUNT.size} bytes, got {len(data)}")
    bits = unpack_bits(data[:sign_bytes], count, 1, field="signs")
    (num_zeros,) = _COUNT.unpack_from(data, sign_bytes)
    positions = data[sign_bytes + _COUNT.size :]
    if num_zeros > count or len(positions) != 4 * num_zeros:
        raise CodecError(f"zeros: {num_zeros} zero positions for {count} values in {len(positions)} bytes")
    zeros = np.frombuffer(positions, dtype="<u4").astype(np.int64)
    if zeros.size and (int(zeros[-1]) >= count or (np.diff(zeros) <= 0).any()):
        raise CodecError(f"zeros: positions must increase strictly and stay below {count}")
    values = 1.0 - 2.0 * bits.astype(np.float32)
    values[zeros] = 0.0
    return torch.from_numpy(values)
