"""Tests for fp8, q2, topk and dct-topk (reference vectors, properties, sizes, validation) and
fuzzing of every codec: mutated blobs must raise only CodecError."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowcomm.compress import CodecError, SparseCodec, get_codec, scatter_mean
from lowcomm.compress.chunking import Blocking, chunk_edge
from lowcomm.compress.dct import block_dct
from lowcomm.compress.packing import pack12, unpack12
from lowcomm.compress.q2 import quantize2

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "vectors"
FRAME_HEADER = 6
RTOL, ATOL = 1e-6, 1e-7  # ALGORITHMS.md "Comparing with the reference vectors"


def load_vectors(name: str) -> dict:
    path = VECTORS / name
    if not path.exists():
        pytest.fail(f"{path} is missing: the shared/ folder must sit beside the checkout (see README)")
    return json.loads(path.read_text())


def ortho_dct_ii(x: np.ndarray) -> np.ndarray:
    """DCT-II with orthonormal scaling along every axis, as scipy defines it."""
    return scipy.fft.dctn(x, type=2, norm="ortho")


# --------------------------------------------------------------------------- vectors: codecs.json
def test_dct_vectors():
    vectors = load_vectors("codecs.json")
    one_d = vectors["dct_ortho_1d_arange8"]
    out = block_dct(torch.tensor(one_d["input"], dtype=torch.float32).reshape(1, -1), (8,))
    np.testing.assert_allclose(out.reshape(-1).numpy(), one_d["output"], rtol=1e-5, atol=1e-5)
    two_d = vectors["dct_ortho_2d_block_4x6"]
    out = block_dct(torch.tensor(two_d["input"], dtype=torch.float32).reshape(1, 24), (4, 6)).reshape(4, 6)
    np.testing.assert_allclose(out.numpy(), two_d["output"], rtol=1e-5, atol=1e-5)


def test_chunk_edge_vectors():
    for case in load_vectors("codecs.json")["chunk_edge_largest_divisor_le_s"]:
        assert chunk_edge(case["n"], case["s"]) == case["edge"], case


def test_pack12_vector_both_ways():
    case = load_vectors("codecs.json")["pack12"]
    packed = pack12(np.array(case["indices"]))
    assert list(packed) == case["bytes"]
    assert unpack12(memoryview(packed), len(case["indices"])).tolist() == case["indices"]


def test_quant2bit_vector():
    case = load_vectors("codecs.json")["quant2bit_templar"]
    codes, lookup, shift, scale = quantize2(torch.tensor(case["input"], dtype=torch.float32))
    assert (case["bins"], case["range"]) == (4, 6)
    assert codes.tolist() == case["codes"]
    np.testing.assert_allclose(lookup.numpy(), case["lookup"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose([shift, scale], [case["shift"], case["scale"]], rtol=RTOL, atol=ATOL)
    decoded = get_codec("q2").decode(get_codec("q2").encode(torch.tensor(case["input"], dtype=torch.float32)))
    np.testing.assert_allclose(decoded.numpy(), case["dequant"], rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- vectors: Templar's compressor
def test_topk_q2_matches_templar_reconstructions_and_clipped_aggregate():
    ref = load_vectors("sparseloco_reference.json")
    codec = get_codec("topk", chunk=ref["target_chunk"], k=ref["k"], values="q2")
    contributions: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    shapes = {}
    for peer in ref["peers"]:
        x = torch.tensor(peer["input"], dtype=torch.float32)
        blob = codec.encode(x)
        np.testing.assert_allclose(codec.decode(blob).numpy(), np.array(peer["reconstruction"]), rtol=RTOL, atol=ATOL)
        indices, values, shape = codec.decode_sparse(blob)
        # Templar's packed indices name the same coordinates (top-k order itself is unstable).
        blocking = Blocking.of(shape, ref["target_chunk"])
        theirs = unpack12(memoryview(bytes(peer["packed_idx"])), len(indices))
        their_flat = blocking.flat_indices(torch.from_numpy(theirs).reshape(blocking.num_blocks, -1))
        assert sorted(their_flat.tolist()) == sorted(indices.tolist())
        contributions.setdefault(peer["param"], []).append((indices, values))
        shapes[peer["param"]] = shape
    for param, contribs in contributions.items():
        norms = torch.stack([values.norm() for _, values in contribs])
        median = norms.median()  # torch's lower middle, as the reference
        clipped = [(i, v * torch.clamp(median / (n + 1e-8), max=1.0)) for (i, v), n in zip(contribs, norms)]
        aggregate = scatter_mean(clipped, shapes[param])
        np.testing.assert_allclose(aggregate.numpy(), np.array(ref[f"aggregate_{param}"]), rtol=RTOL, atol=ATOL)


def test_scatter_mean_counts_contributors_by_index_not_by_value():
    contributions = [
        (torch.tensor([0, 2]), torch.tensor([4.0, 0.0])),  # sends coordinate 2 with the value 0
        (torch.tensor([2, 3]), torch.tensor([6.0, 1.0])),
    ]
    assert scatter_mean(contributions, (5,)).tolist() == [4.0, 0.0, 3.0, 1.0, 0.0]


# --------------------------------------------------------------------------- DCT against scipy
@pytest.mark.parametrize("shape", [(64, 64), (96, 100), (7, 13), (13, 7), (128,), (97,), (101, 3), (2, 3, 10), ()])
def test_block_dct_matches_scipy_per_block(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    codec = get_codec("dct-topk", chunk=64)
    coeffs = codec.transform(x)
    blocking = codec.blocking(shape)
    view = x.reshape(blocking.view).numpy().astype(np.float64)
    expected = np.zeros_like(view)
    if len(blocking.view) == 1:
        (c,) = blocking.edges
        for start in range(0, view.shape[0], c):
            expected[start : start + c] = ortho_dct_ii(view[start : start + c])
    else:
        c1, c2 = blocking.edges
        for r in range(0, view.shape[0], c1):
            for c in range(0, view.shape[1], c2):
                expected[r : r + c1, c : c + c2] = ortho_dct_ii(view[r : r + c1, c : c + c2])
    np.testing.assert_allclose(coeffs.reshape(blocking.view).numpy(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(codec.inverse(coeffs).numpy(), x.numpy(), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- properties
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=48)
FINITE = st.floats(width=32, min_value=-1e6, max_value=1e6, allow_nan=False)
finite_arrays = hnp.arrays(np.float32, SHAPES, elements=FINITE)


@settings(max_examples=200, deadline=None)
@given(finite_arrays)
def test_fp8_error_within_e4m3_rounding(array):
    x = torch.from_numpy(array.copy())
    codec = get_codec("fp8", zstd_level=0)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == torch.float32
    if x.numel() == 0:
        return
    rows = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
    scale = rows.abs().amax(dim=1, keepdim=True) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    bound = torch.maximum(rows.abs() * 2**-4, scale * 2**-10) * 1.001 + 1e-30
    assert bool(((y.reshape(rows.shape) - rows).abs() <= bound).all())


@settings(max_examples=200, deadline=None)
@given(finite_arrays)
def test_q2_decodes_each_value_to_the_mean_of_its_bin(array):
    x = torch.from_numpy(array.copy()).reshape(-1)
    codes, lookup, shift, _ = quantize2(x)
    y = get_codec("q2").decode(get_codec("q2").encode(x))
    for b in range(4):
        members = x[codes == b].double()
        if members.numel():
            centered = members - torch.tensor(shift, dtype=torch.float32).double()
            assert math.isclose(float(lookup[b]), float(centered.mean()), rel_tol=1e-4, abs_tol=1e-5 * (1 + float(x.abs().max())))
            decoded = y[codes == b]
            slack = 1e-5 * (1 + float(x.abs().max()))  # float32 rounding of lookup + shift
            assert float(decoded.min()) >= float(members.min()) - slack
            assert float(decoded.max()) <= float(members.max()) + slack


SPARSE_CONFIGS = [
    ("topk", {"k": 8}),
    ("topk", {"k": 5, "chunk": 16, "values": "float32"}),
    ("topk", {"k": 64, "values": "fp8"}),
    ("topk", {"k": 3, "chunk": 7, "values": "uint8"}),
    ("dct-topk", {"k": 8}),
    ("dct-topk", {"k": 3, "chunk": 16, "sign": True}),
    ("dct-topk", {"k": 4, "dtype": "bfloat16"}),
]


@pytest.mark.parametrize(("name", "params"), SPARSE_CONFIGS)
@settings(max_examples=40, deadline=None)
@given(array=finite_arrays)
def test_sparse_residual_is_what_error_feedback_keeps(name, params, array):
    x = torch.from_numpy(array.copy())
    codec: SparseCodec = get_codec(name, zstd_level=0, **params)
    blob, transmitted = codec.encode_with_transmitted(x)
    assert blob == codec.encode(x)
    assert transmitted.shape == x.shape
    indices, selected = codec.select(x)
    blocking = codec.blocking(tuple(x.shape))
    assert indices.numel() == blocking.num_blocks * (codec.effective_k(blocking.block_len) if blocking.num_blocks else 0)
    assert indices.unique().numel() == indices.numel()
    coeffs = codec.transform(x).reshape(-1)
    torch.testing.assert_close(selected, coeffs[indices], rtol=0, atol=0)
    # Every kept entry is at least as large as every dropped entry of its block.
    if indices.numel():
        keep = torch.zeros(coeffs.numel(), dtype=torch.bool)
        keep[indices] = True
        flat_blocks = blocking.flat_indices(torch.arange(blocking.block_len).repeat(blocking.num_blocks, 1)).reshape(
            blocking.num_blocks, -1
        )
        magnitude, kept = coeffs.abs()[flat_blocks], keep[flat_blocks]
        min_kept = torch.where(kept, magnitude, torch.full_like(magnitude, math.inf)).amin(dim=1)
        max_dropped = torch.where(~kept, magnitude, torch.zeros_like(magnitude)).amax(dim=1)
        assert bool((min_kept >= max_dropped).all())
    residual_coeffs = codec.transform(x - transmitted).reshape(-1)
    dropped = torch.ones(coeffs.numel(), dtype=torch.bool)
    dropped[indices] = False
    scale = 1e-4 * (1 + float(x.abs().max())) if x.numel() else 0.0
    if name == "topk":
        # Exactly: the residual keeps x where nothing was sent, x − decode(x) where something was.
        assert torch.equal(transmitted, codec.decode(blob))
        assert torch.equal((x - transmitted).reshape(-1)[dropped], x.reshape(-1)[dropped])
    elif params.get("sign"):
        # DeMo subtracts the unquantized selected coefficients, not the ±1 the wire carries.
        torch.testing.assert_close(residual_coeffs[dropped], coeffs[dropped], rtol=0, atol=scale)
        torch.testing.assert_close(residual_coeffs[indices], torch.zeros(indices.numel()), rtol=0, atol=scale)
    else:
        torch.testing.assert_close(transmitted, codec.decode(blob), rtol=0, atol=scale)
        torch.testing.assert_close(residual_coeffs[dropped], coeffs[dropped], rtol=0, atol=scale)


def expected_size(name: str, params: dict, shape: tuple[int, ...]) -> int:
    """Frame size from the formulas in the codec docs, computed independently of the library."""
    header = FRAME_HEADER + 2 + 8 * len(shape)
    chunk = params.get("chunk", 64)
    view = (1,) if not shape else shape if len(shape) <= 2 else (shape[0], math.prod(shape[1:]))
    edges = [max(d for d in range(1, min(n, chunk) + 1) if n % d == 0) if n else 1 for n in view]
    length = math.prod(edges)
    blocks = math.prod(n // e for n, e in zip(view, edges)) if math.prod(view) else 0
    if name == "topk":
        k = params.get("k", 64)
        k = length if length < 2 else min(max(2, k - k % 2), length - length % 2)
        count = blocks * k
        index_bytes = 3 * ((count + 1) // 2) if length <= 4096 else count * (2 if length <= 65536 else 4)
        values = params.get("values", "q2")
        value_bytes = {"q2": 20 + -(-count // 4), "fp8": 4 + count, "uint8": 1024 + count, "float32": 4 * count}[values]
    else:
        count = blocks * min(params.get("k", 32), length)
        index_bytes = count * (1 if length <= 256 else 2 if length <= 65536 else 4)
        value_bytes = -(-count // 8) + 4 if params.get("sign") else count * {"float32": 4, "bfloat16": 2}[params.get("dtype", "float32")]
    return header + 8 + index_bytes + value_bytes


@pytest.mark.parametrize(("name", "params"), SPARSE_CONFIGS)
@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (96, 100), (70,), (67,), (3, 4, 5), (), (0,), (1,), (5000,)])
def test_sparse_sizes_match_the_formula(name, params, shape):
    codec = get_codec(name, zstd_level=0, **params)
    blob = codec.encode(torch.randn(shape))
    assert len(blob) == expected_size(name, params, shape) == codec.raw_size(shape)


@pytest.mark.parametrize(("name", "shape", "expected"), [("fp8", (10, 7), 6 + 2 + 16 + 10 * (4 + 7)), ("q2", (10,), 6 + 2 + 8 + 20 + 3)])
def test_dense_quantizer_sizes(name, shape, expected):
    codec = get_codec(name, zstd_level=0)
    assert len(codec.encode(torch.randn(shape))) == expected == codec.raw_size(shape)


def test_sparse_payload_of_a_4096_block_hits_the_target_density():
    # SparseLoCo production: 64 of 4096 per block, 2-bit values, 12-bit indices: 1.56% density and
    # 64·(1.5 + 0.25) bytes per block against 16384 bytes of float32.
    x = torch.randn(256, 256)
    codec = get_codec("topk", k=64, zstd_level=0)
    assert codec.raw_size(x.shape) == FRAME_HEADER + 2 + 16 + 8 + 16 * 64 * 3 // 2 + 20 + 16 * 64 // 4
    assert x.numel() * 4 / codec.raw_size(x.shape) > 140


# --------------------------------------------------------------------------- zero and degenerate tensors
ALL_NEW = [("fp8", {}), ("q2", {}), *SPARSE_CONFIGS]


@pytest.mark.parametrize(("name", "params"), ALL_NEW)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0), (64, 64), (7, 1, 3)])
def test_zeros_encode_to_zeros(name, params, shape):
    codec = get_codec(name, check_finite=True, **params)
    y = codec.decode(codec.encode(torch.zeros(shape)))
    assert y.shape == torch.Size(shape) and y.dtype == torch.float32
    assert bool((y == 0).all())


@pytest.mark.parametrize("name", ["fp8", "q2"])
@pytest.mark.parametrize("value", [3.0, -0.125, 1e-30])
def test_constant_tensors_decode_close(name, value):
    codec = get_codec(name)
    y = codec.decode(codec.encode(torch.full((50,), value)))
    torch.testing.assert_close(y, torch.full((50,), value), rtol=2**-4, atol=0)


def test_sparse_codecs_accept_other_dtypes_and_keep_the_device():
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    for name in ("topk", "dct-topk"):
        codec = get_codec(name)
        blob, transmitted = codec.encode_with_transmitted(x)
        assert transmitted.dtype == torch.float32 and transmitted.device == x.device
        assert codec.decode(blob).shape == x.shape


def test_decoder_reads_the_value_format_from_the_blob():
    x = torch.randn(40, 40)
    blob = get_codec("topk", values="fp8").encode(x)
    torch.testing.assert_close(get_codec("topk").decode(blob), get_codec("topk", values="fp8").decode(blob))


# --------------------------------------------------------------------------- validation
def open_body(blob: bytes) -> tuple[bytes, bytes]:
    """(frame header + body header + shape, payload) of an uncompressed blob."""
    assert blob[5] == 0, "test blobs are built with zstd off"
    ndim = blob[FRAME_HEADER + 1]
    split = FRAME_HEADER + 2 + 8 * ndim
    return blob[:split], blob[split:]


def topk_blob(**params) -> tuple[bytes, bytes]:
    torch.manual_seed(1)
    return open_body(get_codec("topk", zstd_level=0, chunk=8, k=2, **params).encode(torch.randn(16)))


def with_indices(head: bytes, payload: bytes, indices: list[int]) -> bytes:
    return head + payload[:8] + pack12(np.array(indices)) + payload[8 + 6 :]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda h, p: h + struct.pack("<II", 0, 2) + p[8:], "chunk"),
        (lambda h, p: h + struct.pack("<II", 8, 9) + p[8:], "k"),
        (lambda h, p: h + struct.pack("<II", 8, 0) + p[8:], "k"),
        (lambda h, p: h + p[:10], "indices"),
        (lambda h, p: with_indices(h, p, [1, 9, 0, 3]), "indices"),
        (lambda h, p: with_indices(h, p, [4, 4, 0, 3]), "indices"),
        (lambda h, p: h + p[:-1], "values"),
        (lambda h, p: h + p + b"\0", "values"),
        (lambda h, p: h[:-2 - 8] + bytes([9, 1]) + h[-8:] + p, "dtype code"),
    ],
)
def test_topk_validation_names_the_field(mutate, field):
    head, payload = topk_blob()
    with pytest.raises(CodecError, match=field):
        get_codec("topk").decode(mutate(head, payload))


def test_q2_non_finite_lookup_is_rejected_when_checking():
    head, payload = open_body(get_codec("q2", zstd_level=0).encode(torch.randn(9)))
    bad = head + struct.pack("<f", math.nan) + payload[4:]
    with pytest.raises(CodecError, match="lookup"):
        get_codec("q2", check_finite=True).decode(bad)
    assert torch.isnan(get_codec("q2").decode(bad)).all()


def test_q2_padding_bits_must_be_zero():
    head, payload = open_body(get_codec("q2", zstd_level=0).encode(torch.randn(5)))
    with pytest.raises(CodecError, match="codes"):
        get_codec("q2").decode(head + payload[:-1] + bytes([payload[-1] | 0xC0]))


def test_fp8_scales_must_be_positive_and_finite():
    head, payload = open_body(get_codec("fp8", zstd_level=0).encode(torch.randn(2, 3)))
    for scale in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(CodecError, match="scale"):
            get_codec("fp8").decode(head + struct.pack("<f", scale) + payload[4:])


def test_fp8_nan_codes_rejected_when_checking():
    head, payload = open_body(get_codec("fp8", zstd_level=0).encode(torch.randn(4)))
    bad = head + payload[:4] + bytes([0x7F]) + payload[5:]
    with pytest.raises(CodecError, match="non-finite"):
        get_codec("fp8", check_finite=True).decode(bad)


def test_sign_padding_bits_and_zero_list_are_checked():
    head, payload = open_body(get_codec("dct-topk", zstd_level=0, chunk=8, k=3, sign=True).encode(torch.randn(8)))
    signs, zero_count = payload[:-4], payload[-4:]
    assert zero_count == bytes(4)
    with pytest.raises(CodecError, match="signs"):
        get_codec("dct-topk").decode(head + signs[:-1] + bytes([signs[-1] | 0x80]) + zero_count)
    for zeros in ([1, 1], [3], [2, 1], [0, 1, 2, 3]):
        bad = head + signs + struct.pack(f"<I{len(zeros)}I", len(zeros), *zeros)
        with pytest.raises(CodecError, match="zeros"):
            get_codec("dct-topk").decode(bad)
    good = head + signs + struct.pack("<II", 1, 2)
    assert get_codec("dct-topk").decode_sparse(good)[1].tolist()[2] == 0.0


@pytest.mark.parametrize(("params", "message"), [({"k": 0}, "k must"), ({"chunk": 2**21}, "chunk must"), ({"values": "int4"}, "values must"), ({"k": True}, "k must")])
def test_topk_bad_params(params, message):
    with pytest.raises(ValueError, match=message):
        get_codec("topk", **params)


# --------------------------------------------------------------------------- fuzzing
FUZZ_CASES = 10_000
FUZZ_SHAPES = [(), (0,), (1,), (5,), (2, 3), (4, 1, 2), (40,), (16, 12), (70,)]


def seed_blobs(name: str, params: dict, rng: random.Random) -> list[bytes]:
    blobs = []
    for shape in FUZZ_SHAPES:
        for zstd_level in (0, 3):
            codec = get_codec(name, zstd_level=zstd_level, **params)
            numel = math.prod(shape)
            blobs.append(codec.encode(torch.tensor([rng.gauss(0, 1) for _ in range(numel)]).reshape(shape)))
            blobs.append(codec.encode(torch.zeros(shape)))
    return blobs


def mutate(blob: bytes, rng: random.Random, seeds: list[bytes]) -> bytes:
    data = bytearray(blob)
    kind = rng.randrange(7)
    if kind == 0:
        return bytes(data[: rng.randrange(len(data) + 1)])
    if kind == 1:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 2:
        return bytes(data) + rng.randbytes(rng.randint(1, 64))
    if kind == 3:  # a header or sparse-header byte
        i = rng.randrange(min(len(data), 60))
        data[i] = rng.randrange(256)
        return bytes(data)
    if kind == 4:
        other = rng.choice(seeds)
        return bytes(data[: rng.randrange(len(data) + 1)]) + other[rng.randrange(len(other) + 1) :]
    if kind == 5:
        return bytes(data[:FRAME_HEADER]) + rng.randbytes(rng.randint(0, 200))
    return rng.randbytes(rng.randint(0, 200))


def declared_shape(blob: bytes) -> tuple[int, ...]:
    import zstandard

    body = blob[FRAME_HEADER:]
    if blob[5] & 1:
        body = zstandard.ZstdDecompressor().decompress(body)
    return struct.unpack_from(f"<{body[1]}Q", body, 2)


FUZZ_CONFIGS = [("dense", {}), ("dense", {"dtype": "bfloat16"}), ("uint8", {}), ("fp8", {}), ("q2", {}), ("topk", {"k": 4, "chunk": 8}), ("topk", {"k": 2, "values": "fp8"}), ("dct-topk", {"k": 3, "chunk": 8}), ("dct-topk", {"k": 2, "sign": True})]


@pytest.mark.parametrize(("name", "params"), FUZZ_CONFIGS)
def test_fuzzed_blobs_raise_only_codec_error(name, params):
    rng = random.Random(f"fuzz-{name}-{sorted(params.items())}")
    seeds = seed_blobs(name, params, rng)
    decoders = [get_codec(name), get_codec(name, check_finite=True, max_elements=1000)]
    outcomes = {"rejected": 0, "decoded": 0}
    for case in range(FUZZ_CASES):
        blob = mutate(rng.choice(seeds), rng, seeds)
        decoder = decoders[case % 2]
        try:
            y = decoder.decode(blob)
            if isinstance(decoder, SparseCodec):
                indices, values, shape = decoder.decode_sparse(blob)
                assert indices.numel() == values.numel()
                assert indices.numel() == 0 or 0 <= int(indices.min()) <= int(indices.max()) < math.prod(shape)
        except CodecError:
            outcomes["rejected"] += 1
            continue
        outcomes["decoded"] += 1
        assert y.dtype == torch.float32
        assert tuple(y.shape) == declared_shape(blob)
    assert outcomes["rejected"] > 1000 and outcomes["decoded"] > 100, outcomes
