"""Bit packing for codes and indices, vectorised with numpy, little-endian.

- 12-bit indices, pairs (i1, i2) → 3 bytes (ALGORITHMS.md §3):
  b0 = i1 & 0xFF; b1 = (i1 >> 8) | (i2 & 0xF) << 4; b2 = i2 >> 4.
  An odd count is padded with one zero index.
- 2-bit codes, four per byte, the first code in the lowest bits.
- 1-bit signs, eight per byte, LSB first; bit 1 means negative (decoded as 1 − 2b).

Unpackers check the byte count and the padding bits and raise ``CodecError``.
"""

from __future__ import annotations

import numpy as np

from lowcomm.compress.errors import CodecError


def index_width_topk(block_len: int) -> int:
    """Bits per index for ``topk``: 12 up to 4096-element chunks, else 16 or 32."""
    if block_len <= 4096:
        return 12
    return 16 if block_len <= 65536 else 32


def index_width_dct(block_len: int) -> int:
    """Bits per index for ``dct-topk`` (Psyche): u8, u16 or u32 by chunk length."""
    if block_len <= 256:
        return 8
    return 16 if block_len <= 65536 else 32


def packed_index_bytes(count: int, width: int) -> int:
    if width == 12:
        return 3 * ((count + 1) // 2)
    return count * width // 8


def pack_indices(indices: np.ndarray, width: int) -> bytes:
    """Pack non-negative integers below 2**width."""
    if width == 12:
        return pack12(indices)
    return indices.astype({8: "<u1", 16: "<u2", 32: "<u4"}[width]).tobytes()


def unpack_indices(data: memoryview, count: int, width: int) -> np.ndarray:
    """``count`` indices (int64) from exactly ``packed_index_bytes(count, width)`` bytes."""
    expected = packed_index_bytes(count, width)
    if len(data) != expected:
        raise CodecError(f"indices: {count} {width}-bit indices need {expected} bytes, got {len(data)}")
    if width == 12:
        return unpack12(data, count)
    return np.frombuffer(data, dtype={8: "<u1", 16: "<u2", 32: "<u4"}[width]).astype(np.int64)


def pack12(indices: np.ndarray) -> bytes:
    idx = np.asarray(indices, dtype=np.uint16).reshape(-1)
    if idx.size % 2:
        idx = np.append(idx, np.uint16(0))
    pairs = idx.reshape(-1, 2)
    i1, i2 = pairs[:, 0], pairs[:, 1]
    out = np.empty((pairs.shape[0], 3), dtype=np.uint8)
    out[:, 0] = i1 & 0xFF
    out[:, 1] = ((i1 >> 8) & 0xF) | ((i2 & 0xF) << 4)
    out[:, 2] = i2 >> 4
    return out.tobytes()


def unpack12(data: memoryview, count: int) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int64)
    out = np.empty((raw.shape[0], 2), dtype=np.int64)
    out[:, 0] = raw[:, 0] | ((raw[:, 1] & 0xF) << 8)
    out[:, 1] = (raw[:, 1] >> 4) | (raw[:, 2] << 4)
    flat = out.reshape(-1)
    if flat.size > count and flat[count:].any():
        raise CodecError("indices: padding index of an odd count is not zero")
    return flat[:count]


def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Pack values below 2**bits (bits 1 or 2), the first value in the lowest bits."""
    per_byte = 8 // bits
    flat = np.asarray(codes, dtype=np.uint8).reshape(-1)
    pad = (-flat.size) % per_byte
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, dtype=np.uint8)])
    groups = flat.reshape(-1, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, :]
    return np.bitwise_or.reduce(groups << shifts, axis=1).astype(np.uint8).tobytes()


def unpack_bits(data: memoryview, count: int, bits: int, *, field: str) -> np.ndarray:
    """``count`` values of ``bits`` bits each (uint8) from exactly ceil(count·bits/8) bytes."""
    per_byte = 8 // bits
    expected = -(-count // per_byte)
    if len(data) != expected:
        raise CodecError(f"{field}: {count} {bits}-bit values need {expected} bytes, got {len(data)}")
    raw = np.frombuffer(data, dtype=np.uint8)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)[None, :]
    values = ((raw[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if values[count:].any():
        raise CodecError(f"{field}: padding bits after the last value are not zero")
    return values[:count]
