"""Unit tests for lowcomm.compress: round-trips, the uint8 rule, zstd framing and hostile input."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowcomm.compress import Codec, CodecError, get_codec, known_codecs
from lowcomm.compress.uint8 import quantization_scale, quantize

ALL_CODEC_NAMES = ["dct-topk", "dense", "fp32", "fp8", "q2", "topk", "uint8"]
FRAME_HEADER = 6  # b"LCC" | version | codec id | flags
FLAG_ZSTD = 1

SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


def float32_arrays(**float_kwargs) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, SHAPES, elements=st.floats(width=32, **float_kwargs))


def frame(codec_id: int, body: bytes, *, flags: int = 0, magic: bytes = b"LCC", version: int = 1) -> bytes:
    return magic + bytes([version, codec_id, flags]) + body


def body_header(dtype_code: int, shape: tuple[int, ...]) -> bytes:
    return bytes([dtype_code, len(shape)]) + struct.pack(f"<{len(shape)}Q", *shape)


def header_shape(blob: bytes) -> tuple[int, ...]:
    """Shape declared by a frame, parsed independently of the library."""
    body = blob[FRAME_HEADER:]
    if blob[5] & FLAG_ZSTD:
        body = zstandard.ZstdDecompressor().decompress(body)
    ndim = body[1]
    return struct.unpack_from(f"<{ndim}Q", body, 2)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# --------------------------------------------------------------------------- registry
def test_registry_names_and_alias():
    assert known_codecs() == ALL_CODEC_NAMES
    fp32 = get_codec("fp32")
    assert isinstance(fp32, Codec) and fp32.name == "dense" and fp32.dtype == "float32"
    assert get_codec("uint8").name == "uint8"
    x = torch.randn(5, 7)
    assert fp32.encode(x) == get_codec("dense", dtype="float32").encode(x)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("int4", {}),
        ("dense", {"dtype": "int8"}),
        ("uint8", {"dtype": "float32"}),
        ("dense", {"zstd_level": 99}),
        ("uint8", {"max_elements": 0}),
        ("uint8", {"check_finite": "yes"}),
        ("fp32", {"dtype": "bfloat16"}),
        ("dense", {"bogus": 1}),
    ],
)
def test_registry_rejects_bad_name_or_param(name, params):
    with pytest.raises(ValueError, match=r"known codecs: \['dct-topk', 'dense', 'fp32', 'fp8', 'q2', 'topk', 'uint8'\]"):
        get_codec(name, **params)


# --------------------------------------------------------------------------- dense
@settings(max_examples=400, deadline=None)
@given(array=float32_arrays(), zstd_level=st.sampled_from([0, 1, 3]))
def test_dense_float32_is_lossless(array, zstd_level):
    x = torch.from_numpy(array)
    codec = get_codec("dense", zstd_level=zstd_level)
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.float32
    assert same_bits(x, y)  # NaN payloads, infinities and -0.0 survive


@pytest.mark.parametrize(
    ("dtype", "torch_dtype", "unit_roundoff", "max_abs"),
    [("bfloat16", torch.bfloat16, 2.0**-8, float(np.float32(3.3e38))), ("float16", torch.float16, 2.0**-11, 65504.0)],
)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_dense_half_types_round_within_unit_roundoff(data, dtype, torch_dtype, unit_roundoff, max_abs):
    array = data.draw(float32_arrays(min_value=-max_abs, max_value=max_abs))
    x = torch.from_numpy(array)
    codec = get_codec("dense", dtype=dtype)
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, x.to(torch_dtype).to(torch.float32))
    smallest_subnormal = float(torch.finfo(torch_dtype).tiny) * float(torch.finfo(torch_dtype).eps)
    bound = unit_roundoff * x.double().abs() + smallest_subnormal / 2
    assert bool(((x.double() - y.double()).abs() <= bound).all())


def test_dense_decodes_any_wire_dtype_and_converts_inputs():
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # non-contiguous, float64
    blob = get_codec("dense", dtype="float16").encode(x)
    assert torch.equal(get_codec("fp32").decode(blob), x.float())  # the frame says float16
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(torch.tensor(7))), torch.tensor(7.0))
    grad = torch.ones(3, requires_grad=True)
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(grad)), torch.ones(3))


def test_dense_rejects_too_many_dims_on_encode():
    with pytest.raises(ValueError, match="dims"):
        get_codec("fp32").encode(torch.zeros((1,) * 9))


# --------------------------------------------------------------------------- uint8
@settings(max_examples=300, deadline=None)
@given(array=float32_arrays(allow_nan=False, allow_infinity=False))
def test_uint8_error_within_one_bin_outside_clamped_bins(array):
    x = torch.from_numpy(array).reshape(-1)
    codec = get_codec("uint8", zstd_level=0, check_finite=True)
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.float32 and y.shape == x.shape
    scale = quantization_scale(x)
    q = (x.double() / scale).round() + 128
    # A bin's mean lies inside the bin unless clamped outliers were folded into it.
    clamped = (q < 0) | (q > 255)
    polluted_bins = set(q.clamp(0, 255)[clamped].long().tolist())
    codes = q.clamp(0, 255).long()
    clean = torch.tensor([int(c) not in polluted_bins for c in codes], dtype=torch.bool)
    error = (x.double() - y.double()).abs()[clean]
    # The float32 codebook adds its own rounding, visible only for tiny (subnormal) values.
    codebook_rounding = (y.double().abs() * 2.0**-24 + 2.0**-149)[clean]
    assert bool((error <= scale * (1 + 1e-6) + codebook_rounding).all())


def test_uint8_hand_computed_codebook():
    # σ = ‖(1, −1)‖ / sqrt(1) = √2; scale = 6√2/256; ±1/scale = ±30.17 → bins 158 and 98.
    codec = get_codec("uint8", zstd_level=0)
    blob = codec.encode(torch.tensor([1.0, -1.0]))
    codebook = struct.unpack_from("<256f", blob, FRAME_HEADER + 2 + 8)
    codes = blob[FRAME_HEADER + 2 + 8 + 1024 :]
    assert list(codes) == [158, 98]
    assert codebook[158] == 1.0 and codebook[98] == -1.0
    assert sum(1 for v in codebook if v != 0.0) == 2
    assert torch.equal(codec.decode(blob), torch.tensor([1.0, -1.0]))


def test_uint8_codebook_is_per_bin_mean():
    values = [-1.0, -0.9, -0.02, 0.0, 0.01, 0.05, 0.3, 0.31, 1.0, 1.1, 2.5, -7.0]
    sigma = math.sqrt(sum(v * v for v in values)) / math.sqrt(len(values) - 1)
    scale = 6 * sigma / 256
    members: dict[int, list[float]] = {}
    for v in values:
        b = min(255, max(0, round(np.float32(v) / scale) + 128))
        members.setdefault(b, []).append(float(np.float32(v)))
    expected = [np.float32(np.mean(members[b])) if b in members else 0.0 for b in range(256)]

    codes, codebook = quantize(torch.tensor(values))
    assert codebook.dtype == torch.float32 and codebook.shape == (256,)
    assert codebook.tolist() == pytest.approx(expected, rel=1e-6, abs=0.0)
    assert codes.dtype == torch.uint8 and len(members) < 12  # some bins are shared
    blob = get_codec("uint8", zstd_level=0).encode(torch.tensor(values))
    assert struct.unpack_from("<256f", blob, FRAME_HEADER + 2 + 8) == tuple(codebook.tolist())


@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 0), (64, 64)])
def test_uint8_all_zero_decodes_to_zero(shape):
    codec = get_codec("uint8", check_finite=True)
    y = codec.decode(codec.encode(torch.zeros(shape)))
    assert y.shape == shape and not bool(y.isnan().any()) and bool((y == 0).all())


@pytest.mark.parametrize(("value", "shape"), [(3.0, (100,)), (-0.125, (7, 3)), (5.0, ()), (1e-30, (10,))])
def test_uint8_constant_tensor_is_exact(value, shape):
    x = torch.full(shape, value)
    codec = get_codec("uint8", check_finite=True)
    assert torch.allclose(codec.decode(codec.encode(x)), x, rtol=1e-6, atol=0.0)


def test_uint8_accepts_integer_input():
    codec = get_codec("uint8")
    x = torch.arange(-50, 50)
    assert torch.allclose(codec.decode(codec.encode(x)), x.float(), atol=quantization_scale(x.double()))


# --------------------------------------------------------------------------- zstd
@pytest.mark.parametrize("name", ["fp32", "uint8"])
def test_zstd_compressible_sets_flag_and_shrinks(name):
    x = torch.zeros(4096)
    packed = get_codec(name).encode(x)
    plain = get_codec(name, zstd_level=0).encode(x)
    assert packed[5] & FLAG_ZSTD and not plain[5] & FLAG_ZSTD
    assert len(packed) < len(plain) // 10
    assert torch.equal(get_codec(name).decode(packed), x)
    assert torch.equal(get_codec(name, zstd_level=0).decode(packed), x)  # decoding never needs the level


def test_zstd_incompressible_keeps_flag_off():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32, generator=g).view(torch.float32)
    blob = get_codec("fp32", zstd_level=19).encode(x)
    assert not blob[5] & FLAG_ZSTD
    assert len(blob) == len(get_codec("fp32", zstd_level=0).encode(x))
    assert same_bits(get_codec("fp32").decode(blob), x)


def test_zstd_bomb_above_cap_is_rejected():
    bomb = zstandard.ZstdCompressor(level=19).compress(body_header(0, (4_000_000,)) + bytes(16_000_000))
    assert len(bomb) < 2000
    blob = frame(1, bomb, flags=FLAG_ZSTD)
    with pytest.raises(CodecError, match="zstd body: declares 16000010 bytes, cap is"):
        get_codec("fp32", max_elements=1000).decode(blob)
    assert torch.equal(get_codec("fp32").decode(blob), torch.zeros(4_000_000))  # within the default cap


def zstd_header_declaring(content_size: int) -> bytes:
    """A zstd frame header (8-byte content size, single segment) followed by one bogus block."""
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, content_size) + b"\x01\x00\x00"


@pytest.mark.parametrize(("content_size", "reason"), [(2**40, "cap is"), (10_000_000, "frame can hold")])
def test_zstd_frame_declaring_huge_content_is_rejected_before_decompressing(content_size, reason):
    fake = zstd_header_declaring(content_size)
    assert zstandard.get_frame_parameters(fake).content_size == content_size
    with pytest.raises(CodecError, match=f"zstd body: declares {content_size} bytes.*{reason}"):
        get_codec("uint8").decode(frame(2, fake, flags=FLAG_ZSTD))


def test_zstd_frame_lying_about_small_content_size_is_rejected():
    with pytest.raises(CodecError, match="zstd body"):
        get_codec("fp32").decode(frame(1, zstd_header_declaring(64), flags=FLAG_ZSTD))


def test_zstd_frame_without_content_size_or_with_extra_data_is_rejected():
    body = body_header(0, (4,)) + bytes(16)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(body)
    with pytest.raises(CodecError, match="content size"):
        get_codec("fp32").decode(frame(1, unsized, flags=FLAG_ZSTD))
    sized = zstandard.ZstdCompressor().compress(body)
    assert torch.equal(get_codec("fp32").decode(frame(1, sized, flags=FLAG_ZSTD)), torch.zeros(4))
    with pytest.raises(CodecError, match="zstd body"):
        get_codec("fp32").decode(frame(1, sized + b"\x00", flags=FLAG_ZSTD))
    with pytest.raises(CodecError, match="zstd body"):
        get_codec("fp32").decode(frame(1, sized[:-2], flags=FLAG_ZSTD))


# --------------------------------------------------------------------------- validation
VALID_DENSE_BODY = body_header(0, (2, 3)) + bytes(24)


@pytest.mark.parametrize(
    ("blob", "field"),
    [
        (b"", "frame header"),
        (b"LC", "frame header"),
        (frame(1, VALID_DENSE_BODY, magic=b"LCD"), "magic"),
        (frame(1, VALID_DENSE_BODY, version=2), "version"),
        (frame(2, VALID_DENSE_BODY), "codec id"),
        (frame(1, VALID_DENSE_BODY, flags=0x80), "flags"),
        (frame(1, b"\x00"), "body header"),
        (frame(1, body_header(9, (2, 3)) + bytes(24)), "dtype code"),
        (frame(1, body_header(3, (2, 3)) + bytes(6)), "dtype code"),  # uint8 codes in a dense frame
        (frame(1, body_header(0, (1,) * 9) + bytes(4)), "ndim"),
        (frame(1, body_header(0, (2, 3))[:10]), "shape"),
        (frame(1, body_header(0, (2, 3)) + bytes(20)), "payload"),
        (frame(1, body_header(0, (2, 3)) + bytes(28)), "payload"),
        (frame(1, body_header(0, (2**62, 4)) + bytes(8)), "shape"),
        (frame(1, body_header(0, (0, 2**64 - 1))), "shape"),
    ],
)
def test_dense_validation_names_the_field(blob, field):
    with pytest.raises(CodecError, match=field):
        get_codec("fp32").decode(blob)


@pytest.mark.parametrize(
    ("payload", "field"),
    [(bytes(1000), "codebook"), (bytes(1024 + 5), "codes"), (bytes(1024 + 7), "codes")],
)
def test_uint8_validation_names_the_field(payload, field):
    with pytest.raises(CodecError, match=field):
        get_codec("uint8").decode(frame(2, body_header(3, (6,)) + payload))


def test_max_elements_caps_declared_shape():
    blob = get_codec("fp32", zstd_level=0).encode(torch.zeros(100))
    with pytest.raises(CodecError, match="max_elements=99"):
        get_codec("fp32", max_elements=99).decode(blob)
    assert get_codec("fp32", max_elements=100).decode(blob).shape == (100,)


def test_check_finite_rejects_non_finite_values():
    x = torch.tensor([1.0, float("nan"), float("inf")])
    dense_blob = get_codec("fp32").encode(x)
    assert same_bits(get_codec("fp32").decode(dense_blob), x)
    with pytest.raises(CodecError, match="values: 2 non-finite"):
        get_codec("fp32", check_finite=True).decode(dense_blob)

    uint8_blob = get_codec("uint8").encode(x)
    with pytest.raises(CodecError, match="codebook"):
        get_codec("uint8", check_finite=True).decode(uint8_blob)
    codebook = struct.pack("<256f", *([float("nan")] + [0.0] * 255))
    handmade = frame(2, body_header(3, (2,)) + codebook + bytes([1, 2]))
    with pytest.raises(CodecError, match="codebook: 1 non-finite"):
        get_codec("uint8", check_finite=True).decode(handmade)


def test_decode_accepts_bytes_like():
    blob = get_codec("uint8").encode(torch.ones(4))
    for view in (bytearray(blob), memoryview(blob)):
        assert torch.equal(get_codec("uint8").decode(view), torch.ones(4))

# Fuzzing of every codec lives in test_codec_family.py.
