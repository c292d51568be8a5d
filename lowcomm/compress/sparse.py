"""Chunked top-k codecs: the shared selection, wire layout and sparse API.

``topk`` and ``dct-topk`` cut a tensor into blocks (``chunking``), optionally
transform each block, keep the k largest-magnitude entries per block and send
their in-block indices plus their values. Payload::

    chunk u32 | k u32 | indices (num_blocks·k, packed by width) | values

The header's dtype code says how the values travel. Beyond ``encode``/``decode``
the sparse codecs offer what error feedback and scatter-mean aggregation need:
``select``, ``transmitted``, ``encode_with_transmitted`` (one pass for both),
``decode_sparse`` and ``inverse`` (back from the coefficient domain).
"""

from __future__ import annotations

import abc
import math
import struct

import numpy as np
import torch

from lowcomm.compress.base import Codec, WireDType
from lowcomm.compress.chunking import Blocking
from lowcomm.compress.errors import CodecError
from lowcomm.compress.packing import pack_indices, packed_index_bytes, unpack_indices

_HEADER = struct.Struct("<II")
MAX_CHUNK = 2**20


def scatter_mean(contributions: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, ...]) -> torch.Tensor:
    """Per coordinate, the mean over the contributions that sent it (0 where none did).

    Counts contributors by index, not by non-zero value (ALGORITHMS.md: never divide by R).
    """
    numel = math.prod(shape)
    sums = torch.zeros(numel, dtype=torch.float32)
    counts = torch.zeros(numel, dtype=torch.float32)
    for indices, values in contributions:
        sums.index_add_(0, indices, values.to(torch.float32))
        counts.index_add_(0, indices, torch.ones(indices.numel(), dtype=torch.float32))
    return torch.where(counts > 0, sums / counts.clamp(min=1), sums).reshape(shape)


def _top_k_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the positions of the k largest entries, in no particular order."""
    length = magnitude.shape[1]
    if magnitude.device.type == "cpu" and 0 < k < length:
        # numpy's introselect is 2-3x faster than torch.topk on CPU for these row lengths.
        return torch.from_numpy(np.argpartition(magnitude.numpy(), length - k, axis=1)[:, length - k :])
    return magnitude.topk(k, dim=1, sorted=False).indices


class SparseCodec(Codec):
    """Shared machinery of ``topk`` and ``dct-topk``; subclasses pick transform, k rule, widths and values."""

    def __init__(self, *, chunk: int = 64, k: int = 32, **frame_params) -> None:
        super().__init__(**frame_params)
        for field, value in (("chunk", chunk), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHUNK:
                raise ValueError(f"{field} must be an int in [1, {MAX_CHUNK}], got {value!r}")
        self.chunk = chunk
        self.k = k

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", chunk={self.chunk}, k={self.k})"

    # ---------------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def effective_k(self, block_len: int) -> int:
        """Entries kept per block of ``block_len``."""

    @abc.abstractmethod
    def index_width(self, block_len: int) -> int:
        """Bits per index on the wire."""

    @abc.abstractmethod
    def _encode_values(self, values: torch.Tensor) -> tuple[WireDType, bytes, torch.Tensor]:
        """(dtype code, bytes, the values the receiver will decode) for flat float32 CPU values."""

    @abc.abstractmethod
    def _decode_values(self, dtype_code: WireDType, count: int, data: memoryview) -> torch.Tensor:
        """Flat float32 values; validates ``data``'s length."""

    @abc.abstractmethod
    def _values_size(self, count: int) -> int:
        """Exact bytes of ``count`` encoded values."""

    def _transform(self, blocks: torch.Tensor, blocking: Blocking) -> torch.Tensor:
        return blocks

    def _inverse(self, blocks: torch.Tensor, blocking: Blocking) -> torch.Tensor:
        return blocks

    def _transmitted_values(self, selected: torch.Tensor, wire: torch.Tensor) -> torch.Tensor:
        """What error feedback subtracts: by default exactly what the receiver decodes."""
        return wire

    # ---------------------------------------------------------------- public sparse API
    def blocking(self, shape: tuple[int, ...]) -> Blocking:
        return Blocking.of(tuple(shape), self.chunk)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat indices int64, values float32) kept from ``x``, in the codec's domain, on CPU."""
        blocking, local, values = self._select(self._check_encodable(x))
        return blocking.flat_indices(local.cpu()), values.reshape(-1).cpu()

    def transmitted(self, x: torch.Tensor) -> torch.Tensor:
        """The dense part of ``x`` that error feedback subtracts (same device as ``x``)."""
        return self.encode_with_transmitted(x)[1]

    def encode_with_transmitted(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """``(encode(x), transmitted(x))`` from one selection, computed on the CPU (the bytes do not
        depend on ``x``'s device); ``transmitted`` is moved back to ``x``'s device."""
        device = x.device
        x = self._check_encodable(x)
        blocking, local, selected = self._select(x)
        dtype_code, payload, wire = self._payload(blocking, local, selected)
        kept = self._transmitted_values(selected, wire.reshape(selected.shape))
        coeffs = torch.zeros(blocking.num_blocks, blocking.block_len)
        coeffs.scatter_(1, local, kept)
        dense = blocking.from_blocks(self._inverse(coeffs, blocking))
        return self._frame(tuple(x.shape), dtype_code, payload), dense.to(device)

    def decode_sparse(self, blob: bytes) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(flat indices int64, values float32, shape): the coordinates the sender kept.

        For ``dct-topk`` the indices address the block-DCT coefficients laid out
        like the tensor; ``inverse`` maps a dense coefficient tensor back.
        """
        dtype_code, shape, payload = self._open(blob)
        blocking, local, values = self._parse_sparse(dtype_code, shape, payload)
        return blocking.flat_indices(local), values.reshape(-1), shape

    def inverse(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Map a dense tensor in the codec's domain back to values (identity for ``topk``)."""
        blocking = self.blocking(tuple(coeffs.shape))
        return blocking.from_blocks(self._inverse(blocking.to_blocks(coeffs.to(torch.float32)), blocking))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """The codec's domain of ``x``, laid out like ``x`` (identity for ``topk``)."""
        blocking = self.blocking(tuple(x.shape))
        return blocking.from_blocks(self._transform(blocking.to_blocks(x.to(torch.float32)), blocking))

    # ---------------------------------------------------------------- encode
    def _select(self, x: torch.Tensor) -> tuple[Blocking, torch.Tensor, torch.Tensor]:
        blocking = self.blocking(tuple(x.shape))
        blocks = self._transform(blocking.to_blocks(x.to(torch.float32)), blocking)
        k = self.effective_k(blocking.block_len) if blocking.num_blocks else 0
        return blocking, (local := _top_k_indices(blocks.abs(), k)), blocks.gather(1, local)

    def _payload(self, blocking: Blocking, local: torch.Tensor, selected: torch.Tensor) -> tuple[WireDType, bytes, torch.Tensor]:
        width = self.index_width(blocking.block_len)
        indices = pack_indices(local.cpu().numpy(), width)
        dtype_code, values, wire = self._encode_values(selected.reshape(-1).cpu())
        return dtype_code, _HEADER.pack(self.chunk, local.shape[1]) + indices + values, wire

    def _encode_payload(self, tensor: torch.Tensor) -> tuple[WireDType, bytes]:
        dtype_code, payload, _ = self._payload(*self._select(tensor))
        return dtype_code, payload

    def _payload_size(self, shape: tuple[int, ...]) -> int:
        blocking = self.blocking(shape)
        count = blocking.num_blocks * (self.effective_k(blocking.block_len) if blocking.num_blocks else 0)
        return _HEADER.size + packed_index_bytes(count, self.index_width(blocking.block_len)) + self._values_size(count)

    # ---------------------------------------------------------------- decode
    def _parse_sparse(
        self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview
    ) -> tuple[Blocking, torch.Tensor, torch.Tensor]:
        if len(payload) < _HEADER.size:
            raise CodecError(f"sparse header: need {_HEADER.size} bytes (chunk, k), got {len(payload)}")
        chunk, k = _HEADER.unpack_from(payload)
        if not 1 <= chunk <= MAX_CHUNK:
            raise CodecError(f"chunk: {chunk} outside [1, {MAX_CHUNK}]")
        blocking = Blocking.of(shape, chunk)
        length, blocks = blocking.block_len, blocking.num_blocks
        if k > length:
            raise CodecError(f"k: {k} exceeds the chunk length {length}")
        if blocks and k < 1:
            raise CodecError("k: 0 entries per chunk")
        count = blocks * k
        width = self.index_width(length)
        index_end = _HEADER.size + packed_index_bytes(count, width)
        if len(payload) < index_end:
            raise CodecError(f"indices: truncated, {count} {width}-bit indices need {index_end - _HEADER.size} bytes")
        local = unpack_indices(payload[_HEADER.size : index_end], count, width).reshape(blocks, k)
        if count and int(local.max()) >= length:
            raise CodecError(f"indices: {int(local.max())} out of range for chunks of {length}")
        if k > 1 and (np.diff(np.sort(local, axis=1), axis=1) == 0).any():
            raise CodecError("indices: an index repeats within a chunk")
        values = self._decode_values(dtype_code, count, payload[index_end:])
        return blocking, torch.from_numpy(local), values.reshape(blocks, k)

    def _decode_payload(self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview) -> torch.Tensor:
        blocking, local, values = self._parse_sparse(dtype_code, shape, payload)
        coeffs = torch.zeros(blocking.num_blocks, blocking.block_len)
        coeffs.scatter_(1, local, values)
        return blocking.from_blocks(self._inverse(coeffs, blocking))

    def _max_payload_bytes(self, numel: int) -> int:
        return _HEADER.size + 4 * numel + self._max_values_bytes(numel)

    @abc.abstractmethod
    def _max_values_bytes(self, count: int) -> int:
        """Largest encoding of ``count`` values any accepted dtype allows."""
