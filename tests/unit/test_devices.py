"""Device independence of the wire, and `--device`: what crosses the wire (codec frames, activations,
token ids, state, pair payloads) is the same CPU bytes whatever device a tensor lives on, and a peer
resolves auto, cpu, cuda and cuda:N as docs/devices.md says.

Parametrized by `devices.DEVICES` (the CPU everywhere, "cuda" where torch sees a GPU) and checked with
`devices.Foreign` (a tensor on which nothing may be computed before it is copied to the CPU). The CUDA
branches of device resolution run with torch.cuda's answers patched.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICES, NO_GPU, Foreign, ForeignComputation, foreign, state_bytes

from lowcomm.algorithms.state import tensors_hash
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import InProcessGroup
from lowcomm.collectives.pair_payload import TensorListFormat
from lowcomm.compress import SparseCodec, get_codec
from lowcomm.compress.blockwise8 import encode_blockwise8
from lowcomm.config import ConfigError
from lowcomm.pipeline.activations import pack, pack_tokens, unpack, unpack_tokens
from lowcomm.runtime.preflight import check_device
from lowcomm.runtime.state_transfer import encode_state
from lowcomm.runtime.trainer import device_label, pick_device, resolve_device

WAIT_S = 60.0  # a bound on rounds that only a broken test reaches; never asserted


def test_a_foreign_tensor_can_only_be_copied_to_the_cpu():
    x = torch.randn(3, 4)
    f = foreign(x)
    assert f.shape == (3, 4) and f.dtype == torch.float32 and f.dim() == 2 and type(f.detach()) is Foreign
    copied = f.detach().to("cpu")
    assert type(copied) is torch.Tensor and torch.equal(copied, x)
    assert type(f.to(device="cpu", dtype=torch.float32)) is torch.Tensor
    for compute in (lambda: f + 1, lambda: f.to(torch.float64), lambda: f.to("cpu", torch.bfloat16),
                    lambda: f.numpy(), lambda: f.reshape(-1), lambda: torch.zeros_like(f)):
        with pytest.raises(ForeignComputation):
            compute()


# ---- codecs: the same bytes from every device -------------------------------------------------

CODECS = [
    ("dense", {"dtype": "float32"}), ("dense", {"dtype": "bfloat16"}), ("dense", {"dtype": "float16"}),
    ("uint8", {}), ("fp8", {}), ("q2", {}),
    *[("topk", {"k": 8, "chunk": 16, "values": v}) for v in ("q2", "fp8", "uint8", "float32", "bfloat16", "float16")],
    ("dct-topk", {"k": 8, "chunk": 16}), ("dct-topk", {"k": 8, "chunk": 16, "sign": True}),
    ("dct-topk", {"k": 8, "chunk": 16, "dtype": "bfloat16"}),
]
CODEC_IDS = [f"{name}-{'-'.join(str(v) for v in params.values()) or 'default'}" for name, params in CODECS]


def sample(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 32 x 48 tensor with ties (repeated magnitudes: top-k must break them the same way) and zeros."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 48, generator=g)
    x[3] = 0.5  # a whole row of equal values
    x[5, ::2] = -0.5
    x[7] = 0.0  # an all-zero row (dct-topk's zero list)
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize(("name", "params"), CODECS, ids=CODEC_IDS)
def test_a_codec_writes_the_same_bytes_from_every_device(name, params, dtype, device):
    codec = get_codec(name, **params)
    x = sample(dtype)
    reference = codec.encode(x)
    assert codec.encode(x.to(device)) == reference
    assert codec.encode(foreign(x)) == reference  # nothing computed on the input's own device
    decoded = codec.decode(reference)
    assert decoded.device.type == "cpu" and decoded.dtype == torch.float32 and decoded.shape == x.shape
    assert torch.equal(decoded.to(device).cpu(), decoded)  # the receiver moves it where it trains, exactly


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "params"), [c for c in CODECS if c[0] in ("topk", "dct-topk")],
                         ids=[i for i, c in zip(CODEC_IDS, CODECS) if c[0] in ("topk", "dct-topk")])
def test_error_feedback_gets_the_cpu_result_on_its_own_device(name, params, device):
    """What a sparse codec says was transmitted is computed with the bytes, on the CPU, and handed back
    on the residual's device: the same values there as a CPU residual gets."""
    codec = get_codec(name, **params)
    assert isinstance(codec, SparseCodec)
    x = sample()
    blob, transmitted = codec.encode_with_transmitted(x)
    on_device_blob, on_device = codec.encode_with_transmitted(x.to(device))
    assert on_device_blob == blob and on_device.device.type == device
    assert torch.equal(on_device.cpu(), transmitted)
    foreign_blob, from_foreign = codec.encode_with_transmitted(foreign(x))
    assert foreign_blob == blob and torch.equal(from_foreign, transmitted)
    indices, values = codec.select(foreign(x))
    assert indices.device.type == values.device.type == "cpu"
    assert torch.equal(indices, codec.select(x)[0]) and torch.equal(values, codec.select(x)[1])


@pytest.mark.parametrize("device", DEVICES)
def test_activations_and_token_ids_cross_a_stage_boundary_as_the_same_bytes(device):
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    assert encode_blockwise8(h.to(device)) == encode_blockwise8(h) == encode_blockwise8(foreign(h))
    assert encode_blockwise8(h.to(device, torch.bfloat16)) == encode_blockwise8(h.to(torch.bfloat16))
    tokens = pack_tokens(idx)
    assert pack_tokens(idx.to(device)) == tokens == pack_tokens(foreign(idx))
    assert torch.equal(unpack_tokens(tokens, 256, 1 << 20), idx)
    assert pack(h.to(device)) == pack(h) and unpack(pack(h), 1 << 20).device.type == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_state_and_pair_payloads_are_the_same_bytes_from_every_device(device):
    tensors = {"phi.a": torch.randn(4, 5), "momentum.a": torch.randn(4, 5), "phi.b": torch.randn(7)}
    snapshot = encode_state(tensors, 3, 10, "cfg", "hash")
    moved = {k: v.to(device) for k, v in tensors.items()}
    assert state_bytes(encode_state(moved, 3, 10, "cfg", "hash").blob) == state_bytes(snapshot.blob)
    from_foreign = encode_state({k: foreign(v) for k, v in tensors.items()}, 3, 10, "cfg", "hash")
    assert state_bytes(from_foreign.blob) == state_bytes(snapshot.blob)
    assert tensors_hash(moved.values()) == tensors_hash(tensors.values())
    assert tensors_hash(map(foreign, tensors.values())) == tensors_hash(tensors.values())
    shapes = [tuple(t.shape) for t in tensors.values()]
    for codec in ("fp32", "bf16", "uint8"):
        payload = TensorListFormat(codec, shapes)
        assert payload.encode(list(moved.values())) == payload.encode(list(tensors.values()))
        assert all(t.device.type == "cpu" for t in payload.decode(payload.encode(list(moved.values()))))


def test_the_in_process_group_takes_payloads_from_any_device():
    group = InProcessGroup(2)
    key = GroupKey("devices")
    handles = [group.replica(0).start(key, 0, torch.ones(3)), group.replica(1).start(key, 0, foreign(torch.ones(3)))]
    assert all(torch.equal(h.result(WAIT_S).aggregate, torch.ones(3)) for h in handles)


# ---- --device: which device a peer picks, and the one-line error when it cannot -----------------

@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def gpus(monkeypatch):
    """torch.cuda answering as on a machine with `count` GPUs (set by calling the fixture's result)."""
    made: list[torch.device] = []

    def have(count: int, current: int = 0) -> list[torch.device]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: made.append(torch.device(device)))
        return made
    return have


def test_without_a_gpu_auto_and_cpu_train_on_the_cpu(no_cuda):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cpu")
    check_device("auto")
    check_device("cpu")


@pytest.mark.parametrize("requested", ["cuda", "cuda:0", "cuda:1"])
def test_without_a_gpu_cuda_is_refused_in_one_line(no_cuda, requested):
    for check in (resolve_device, pick_device, check_device):
        with pytest.raises(ConfigError) as refused:
            check(requested)
        message = str(refused.value)
        assert message.startswith(f"--device {requested}: torch sees no CUDA device here") and "\n" not in message
        assert message.endswith("use --device cpu or auto")


def test_with_gpus_each_name_resolves_to_an_indexed_device(gpus):
    made = gpus(2, current=1)
    assert resolve_device("auto") == torch.device("cuda", 1)  # the current one, as torch's "cuda" means
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert made == []  # resolving sets nothing
    assert pick_device("cuda:0") == torch.device("cuda", 0) and made == [torch.device("cuda", 0)]
    assert pick_device("cpu") == torch.device("cpu") and len(made) == 1  # a CPU peer leaves CUDA alone
    check_device("cuda:1")


def test_a_peer_says_which_gpu_it_trains_on(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"Example GPU {torch.device(device).index}")
    assert device_label(torch.device("cuda", 1)) == "cuda:1 Example GPU 1"
    assert device_label(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "x" * 200)
    assert len(device_label(torch.device("cuda", 0))) == 64  # a peer record's labels are short


@pytest.mark.parametrize(("count", "requested", "hint"), [(1, "cuda:1", "use --device cuda:0 or cpu"),
                                                          (2, "cuda:2", "use --device cuda:0..cuda:1 or cpu")])
def test_a_gpu_index_beyond_the_machine_is_refused_in_one_line(gpus, count, requested, hint):
    gpus(count)
    for check in (resolve_device, check_device):
        with pytest.raises(ConfigError) as refused:
            check(requested)
        message = str(refused.value)
        assert message.startswith(f"--device {requested}: torch sees {count} CUDA device(s), numbered from 0")
        assert hint in message and "\n" not in message


@pytest.mark.parametrize("requested", ["gpu", "cuda:", "cuda:x", "mps", ""])
def test_a_name_that_is_no_device_is_refused(requested):
    with pytest.raises(ConfigError, match="not a device; use auto, cpu, cuda or cuda:N"):
        resolve_device(requested)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU.replace(
    "the CPU variant of this test ran instead", "test_with_gpus_each_name_resolves_to_an_indexed_device checks the "
    "same rule with torch.cuda's answers patched"))
def test_pick_device_makes_the_named_gpu_the_current_one():
    before = torch.cuda.current_device()
    last = torch.cuda.device_count() - 1
    try:
        assert pick_device(f"cuda:{last}") == torch.device("cuda", last)
        assert torch.cuda.current_device() == last
        assert torch.empty(1, device="cuda").device == torch.device("cuda", last)
    finally:
        torch.cuda.set_device(before)
