"""The wire frame shared by every codec and the abstract ``Codec`` interface.

Frame (all integers little-endian)::

    b"LCC" | version u8 (=1) | codec id u8 | flags u8 | body
    flags bit0: body is one zstd frame, content size declared, nothing after it
    body: dtype code u8 | ndim u8 (<= 8) | shape: ndim x u64 | codec payload

Decoding validates every field before allocating anything, caps the decoded
size with ``max_elements`` (also the bound on zstd output), and raises only
``CodecError`` on bad input.
"""

from __future__ import annotations

import abc
import enum
import math
import struct
from typing import ClassVar

import torch
import zstandard

from lowcomm.compress.errors import CodecError

MAGIC = b"LCC"
FORMAT_VERSION = 1
FLAG_ZSTD = 0x01
KNOWN_FLAGS = FLAG_ZSTD
MAX_NDIM = 8
DEFAULT_MAX_ELEMENTS = 2**31
MAX_ZSTD_LEVEL = 22

_FRAME_HEADER = struct.Struct("<3sBBB")
_BODY_HEADER = struct.Struct("<BB")
_MAX_BODY_HEADER_BYTES = _BODY_HEADER.size + 8 * MAX_NDIM
_ZSTD_MAX_RATIO = zstandard.BLOCKSIZE_MAX // 4


class WireDType(enum.IntEnum):
    """Element type of a payload on the wire (the body header's dtype code)."""

    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    UINT8 = 3
    FLOAT8_E4M3 = 4
    UINT2 = 5  # 2-bit codes, four per byte
    SIGN1 = 6  # 1-bit signs, eight per byte


class Codec(abc.ABC):
    """Turns a tensor into self-describing bytes and back.

    Subclasses set ``name`` and ``codec_id`` and implement the payload hooks;
    framing, zstd and header validation live here.

    Args:
        zstd_level: zstd level for the body, 0 = off. The compressed body is
            kept only when it is smaller.
        max_elements: decode refuses blobs declaring more elements than this.
        check_finite: decode raises ``CodecError`` on non-finite values.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    accepted_dtypes: ClassVar[frozenset[WireDType]]
    lossless: bool = False  # decode(encode(x)) == x for every finite float32 x

    def __init__(
        self,
        *,
        zstd_level: int = 1,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        check_finite: bool = False,
    ) -> None:
        if isinstance(zstd_level, bool) or not isinstance(zstd_level, int) or not 0 <= zstd_level <= MAX_ZSTD_LEVEL:
            raise ValueError(f"zstd_level must be an int in [0, {MAX_ZSTD_LEVEL}], got {zstd_level!r}")
        if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
            raise ValueError(f"max_elements must be a positive int, got {max_elements!r}")
        if not isinstance(check_finite, bool):
            raise ValueError(f"check_finite must be a bool, got {check_finite!r}")
        self.zstd_level = zstd_level
        self.max_elements = max_elements
        self.check_finite = check_finite

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(zstd_level={self.zstd_level}, "
            f"max_elements={self.max_elements}, check_finite={self.check_finite})"
        )

    # ------------------------------------------------------------------ encode
    def encode(self, tensor: torch.Tensor) -> bytes:
        """Encode ``tensor`` (any device, any real dtype) into one frame; the bytes are the same on every device."""
        tensor = self._check_encodable(tensor)
        dtype_code, payload = self._encode_payload(tensor)
        return self._frame(tuple(tensor.shape), dtype_code, payload)

    def raw_size(self, shape: tuple[int, ...]) -> int:
        """Exact size of the frame for a tensor of ``shape`` when zstd is off (no encoding)."""
        return _FRAME_HEADER.size + _BODY_HEADER.size + 8 * len(shape) + self._payload_size(tuple(shape))

    def _check_encodable(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_complex():
            raise ValueError(f"codec {self.name!r} does not encode complex tensors")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"tensor has {tensor.dim()} dims; the wire format allows at most {MAX_NDIM}")
        # Every codec computes on the CPU copy, so the bytes do not depend on the device the tensor
        # lives on: an accelerator's kernels (casts, DCT, top-k ties, reductions) round and order
        # differently. The copy is exact; a CPU tensor is used as it is.
        return tensor.detach().to("cpu")

    def _frame(self, shape: tuple[int, ...], dtype_code: WireDType, payload) -> bytes:
        """The frame of ``payload`` (bytes or a buffer), copied once when zstd is off."""
        head = _BODY_HEADER.pack(dtype_code, len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        if self.zstd_level > 0:
            body = head + payload
            compressed = zstandard.ZstdCompressor(level=self.zstd_level, write_content_size=True).compress(body)
            if len(compressed) < len(body):
                return _FRAME_HEADER.pack(MAGIC, FORMAT_VERSION, self.codec_id, FLAG_ZSTD) + compressed
            return _FRAME_HEADER.pack(MAGIC, FORMAT_VERSION, self.codec_id, 0) + body
        return b"".join((_FRAME_HEADER.pack(MAGIC, FORMAT_VERSION, self.codec_id, 0), head, payload))

    def encoded_size(self, tensor: torch.Tensor) -> int:
        """Bytes ``encode(tensor)`` produces (zstd makes it data dependent)."""
        return len(self.encode(tensor))

    # ------------------------------------------------------------------ decode
    def decode(self, blob: bytes) -> torch.Tensor:
        """Decode one frame into a CPU tensor of the original shape.

        Raises:
            CodecError: the blob is malformed, too large, or (with
                ``check_finite``) holds non-finite values.
        """
        dtype_code, shape, payload = self._open(blob)
        return self._decode_payload(dtype_code, shape, payload).reshape(shape)

    def _open(self, blob: bytes) -> tuple[WireDType, tuple[int, ...], memoryview]:
        """Validate frame and body header: (dtype code, shape, payload)."""
        return self._parse_body(self._unframe(memoryview(blob).cast("B")))

    def _unframe(self, blob: memoryview) -> memoryview:
        if len(blob) < _FRAME_HEADER.size:
            raise CodecError(f"frame header: {len(blob)} bytes, need {_FRAME_HEADER.size}")
        magic, version, codec_id, flags = _FRAME_HEADER.unpack_from(blob)
        if magic != MAGIC:
            raise CodecError(f"magic: expected {MAGIC!r}, got {bytes(magic)!r}")
        if version != FORMAT_VERSION:
            raise CodecError(f"version: expected {FORMAT_VERSION}, got {version}")
        if codec_id != self.codec_id:
            raise CodecError(f"codec id: {self.name!r} decodes id {self.codec_id}, blob has id {codec_id}")
        if flags & ~KNOWN_FLAGS:
            raise CodecError(f"flags: unknown bits set in {flags:#04x}")
        body = blob[_FRAME_HEADER.size :]
        if flags & FLAG_ZSTD:
            body = memoryview(self._decompress(body))
        return body

    def _decompress(self, frame: memoryview) -> bytes:
        # zstd allocates the declared content size up front, so bound it before decompressing:
        # by the cap that max_elements implies, and by what this many compressed bytes can hold
        # (the densest zstd block is RLE: 4 bytes for BLOCKSIZE_MAX bytes of output).
        cap = _MAX_BODY_HEADER_BYTES + self._max_payload_bytes(self.max_elements)
        try:
            declared = zstandard.get_frame_parameters(frame).content_size
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd body: bad frame header ({exc})") from None
        if declared in (0, zstandard.CONTENTSIZE_UNKNOWN):
            raise CodecError("zstd body: frame does not declare its content size")
        if declared > cap:
            raise CodecError(f"zstd body: declares {declared} bytes, cap is {cap} (max_elements={self.max_elements})")
        if declared > len(frame) * _ZSTD_MAX_RATIO:
            raise CodecError(f"zstd body: declares {declared} bytes, more than a {len(frame)}-byte frame can hold")
        try:
            return zstandard.ZstdDecompressor().decompress(frame, max_output_size=cap, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd body: {exc}") from None

    def _parse_body(self, body: memoryview) -> tuple[WireDType, tuple[int, ...], memoryview]:
        if len(body) < _BODY_HEADER.size:
            raise CodecError(f"body header: {len(body)} bytes, need {_BODY_HEADER.size}")
        raw_dtype, ndim = _BODY_HEADER.unpack_from(body)
        try:
            dtype_code = WireDType(raw_dtype)
        except ValueError:
            raise CodecError(f"dtype code: unknown value {raw_dtype}") from None
        if dtype_code not in self.accepted_dtypes:
            accepted = sorted(d.name.lower() for d in self.accepted_dtypes)
            raise CodecError(f"dtype code: codec {self.name!r} accepts {accepted}, got {dtype_code.name.lower()}")
        if ndim > MAX_NDIM:
            raise CodecError(f"ndim: {ndim} exceeds the limit of {MAX_NDIM}")
        shape_end = _BODY_HEADER.size + 8 * ndim
        if len(body) < shape_end:
            raise CodecError(f"shape: truncated, {ndim} dims need {8 * ndim} bytes")
        shape = struct.unpack_from(f"<{ndim}Q", body, _BODY_HEADER.size)
        for axis, size in enumerate(shape):
            if size > self.max_elements:
                raise CodecError(f"shape: dim {axis} = {size} exceeds max_elements={self.max_elements}")
        numel = math.prod(shape)
        if numel > self.max_elements:
            raise CodecError(f"shape: {numel} elements exceed max_elements={self.max_elements}")
        return dtype_code, shape, body[shape_end:]

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _encode_payload(self, tensor: torch.Tensor) -> tuple[WireDType, bytes]:
        """Payload bytes for ``tensor`` (detached, on the CPU), with the header's dtype code."""

    @abc.abstractmethod
    def _decode_payload(self, dtype_code: WireDType, shape: tuple[int, ...], payload: memoryview) -> torch.Tensor:
        """Float32 CPU tensor of ``shape`` (or flat); must check ``payload``'s length itself."""

    @abc.abstractmethod
    def _max_payload_bytes(self, numel: int) -> int:
        """Largest payload a valid blob of ``numel`` elements can carry."""

    @abc.abstractmethod
    def _payload_size(self, shape: tuple[int, ...]) -> int:
        """Exact payload bytes ``_encode_payload`` gives for a tensor of ``shape``."""
