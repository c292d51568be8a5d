"""Replicas, trainers and stage servers on their devices: a swarm whose members train on different
devices applies the same aggregate, state downloaded onto another device is the same state, and what
arrives as bytes lands on the device the peer trains on.

Parametrized by `devices.DEVICES` and `devices.DEVICE_PAIRS`: every item runs on the CPU here; the
CUDA items (a replica on the GPU beside one on the CPU) run where torch sees a GPU.
"""

from __future__ import annotations

import pytest
import torch
from devices import DEVICE_PAIRS, DEVICES, needs_cuda, state_bytes
from threads import in_threads
from torch import nn

from lowcomm.algorithms.base import ReplicaSpec, SyncHooks
from lowcomm.algorithms.ddp import DdpConfig
from lowcomm.algorithms.demo import DemoConfig
from lowcomm.algorithms.diloco import DilocoConfig
from lowcomm.algorithms.noloco import NoLoCoConfig
from lowcomm.algorithms.noloco_replica import NoLoCo
from lowcomm.algorithms.registry import algorithm
from lowcomm.algorithms.sparseloco import SparseLoCoConfig
from lowcomm.algorithms.state import optimizer_step, tensors_hash
from lowcomm.algorithms.streaming import StreamingConfig
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import LocalGroup
from lowcomm.config import RunConfig, default_config
from lowcomm.pipeline.activations import pack, pack_tokens, unpack
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import initial_stage
from lowcomm.proto import wire_pb2
from lowcomm.runtime.stage_state import _load_adam
from lowcomm.runtime.state_transfer import decode_state, encode_state
from lowcomm.runtime.trainer import LocalTrainer, resolve_device

WAIT_S = 60.0  # a bound on rounds that only a broken test reaches; never asserted


class Net(nn.Module):
    """Two "transformer blocks" (Streaming DiLoCo strides fragments over blocks.<b>.), 2-D and 1-D tensors."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Module() for _ in range(2))
        for block, (rows, cols) in zip(self.blocks, [(16, 24), (24, 16)]):
            block.w = nn.Parameter(torch.randn(rows, cols, generator=g))
            block.b = nn.Parameter(torch.randn(cols, generator=g))


H, STEPS = 2, 4
ALGOS = {
    "diloco": RunConfig(diloco=DilocoConfig(inner_steps=H, codec="uint8")),
    "diloco-overlap": RunConfig(diloco=DilocoConfig(inner_steps=H, codec="fp32", overlap=True)),
    "streaming-diloco": RunConfig(diloco=DilocoConfig(inner_steps=H), streaming=StreamingConfig(
        fragments=2, fragment_sync_delay=0, codec="fp8")),
    "sparseloco": RunConfig(sparseloco=SparseLoCoConfig(inner_steps=H, topk=8, chunk=8)),
    "sparseloco-overlap": RunConfig(sparseloco=SparseLoCoConfig(inner_steps=H, topk=8, chunk=8, overlap=True)),
    "demo": RunConfig(demo=DemoConfig(lr=0.01, topk=8, chunk=8)),
    "demo-sign": RunConfig(demo=DemoConfig(lr=0.01, topk=8, chunk=8, sign=True, weight_decay=0.1)),
    "ddp": RunConfig(ddp=DdpConfig(epoch_steps=STEPS)),
}


def gradients(r: int, step: int, model: nn.Module) -> list[torch.Tensor]:
    """Replica r's gradient at `step`, drawn on the CPU (one generator for every device), on the model's device."""
    g = torch.Generator().manual_seed(1000 * r + step)
    return [torch.randn(p.shape, generator=g).to(p.device) for p in model.parameters()]


def algo_of(name: str):
    """The registry's algorithm of a variant named here (diloco-overlap: diloco with overlap on)."""
    return algorithm(name if name == "streaming-diloco" else name.split("-")[0])


def replica(name: str, model: nn.Module, collective, hooks: SyncHooks | None = None):
    config = ALGOS[name]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    spec = ReplicaSpec(model, config, collective, GroupKey(f"devices-{name}"), tokens_per_step=64,
                       optimizer=optimizer, hooks=hooks or SyncHooks(timeout_s=WAIT_S, total_steps=STEPS))
    return algo_of(name).replica(spec), optimizer


def group_for(name: str, members: int, model: nn.Module) -> LocalGroup:
    algo, config = algo_of(name), ALGOS[name]
    shapes = [tuple(p.shape) for p in model.parameters()]
    return LocalGroup(members, combiner=algo.combiner(config, shapes), codec=algo.codec(config), timeout_s=WAIT_S)


def train(name: str, devices: tuple[str, str]):
    """Two replicas of `name`, replica r's model on devices[r], STEPS steps of the runtime's loop on fixed
    gradients; returns (models, replicas, the gradient each applied at its last step)."""
    models = [Net(seed=0).to(d) for d in devices]
    group = group_for(name, len(devices), models[0])
    made = [replica(name, m, group.member(r)) for r, m in enumerate(models)]
    reps = [rep for rep, _ in made]
    applied: list[list[torch.Tensor]] = [[] for _ in devices]

    def loop(r):
        model, (rep, optimizer) = models[r], made[r]
        for step in range(STEPS):
            grads = gradients(r, step, model)
            if rep.per_step:  # ddp and DeMo: the round is this step, on the gradients
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
                assert rep.on_gradients(step) is True
                applied[r] = [p.grad.detach().cpu() for p in model.parameters()]
                if rep.steps_inner_optimizer:
                    optimizer.step()
            else:
                with torch.no_grad():
                    for p, g in zip(model.parameters(), grads):
                        p.sub_(g, alpha=0.05)
                assert rep.after_inner_step(step + 1) is True
        rep.finish()

    in_threads(loop, len(devices))
    return models, reps, applied


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize("name", list(ALGOS))
def test_replicas_on_different_devices_apply_the_same_aggregate(name, devices):
    """Every member applies the same decoded aggregate; φ and the outer state stay on the CPU, the model
    on its own device. What is guaranteed bitwise (docs/devices.md): φ of the round-based algorithms, and
    DeMo's parameters (the same signs, applied with one IEEE multiply and add); ddp's inner optimizer
    steps on the device, so only the averaged gradient it applies is compared across devices."""
    models, reps, applied = train(name, devices)
    for model, device in zip(models, devices):
        assert all(p.device.type == device for p in model.parameters())
    for rep in reps:
        phi = getattr(rep, "phi", None)
        if phi is not None:  # the round-based algorithms: φ on the CPU in float32
            assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in phi)
        assert rep.round > 0
    if name == "ddp":
        assert all(torch.equal(a, b) for a, b in zip(*applied))  # the same mean gradient, bit for bit
        if devices[0] != devices[1]:
            return  # each device's optimizer step rounds its own way: see docs/devices.md
    assert reps[0].phi_hash() == reps[1].phi_hash()


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize("name", [*ALGOS, "noloco"])
def test_state_downloaded_onto_another_device_is_the_same_state(name, devices):
    """A replica's state, as the bytes a joiner downloads, loads into a replica whose model is on the
    other device: its model lands there, its φ and outer state on the CPU, and it serves the same bytes
    and the same φ hash onwards."""
    source_device, target_device = devices
    if name == "noloco":  # no rounds here (its pair exchange needs gRPC): its φ and momentum after one step
        models = [Net(seed=0).to(source_device)]
        reps = [NoLoCo(models[0], NoLoCoConfig(inner_steps=H), LocalGroup(1).member(0), GroupKey("devices"))]
        with torch.no_grad():
            for p, g in zip(models[0].parameters(), gradients(0, 0, models[0])):
                p.sub_(g, alpha=0.05)
        reps[0].momentum = [torch.randn(m.shape, generator=torch.Generator().manual_seed(5)) for m in reps[0].momentum]
    else:
        models, reps, _ = train(name, (source_device, source_device))
    if name == "ddp":  # Adam's moments and step travel with ddp's state: give the source some
        adam = torch.optim.AdamW(models[0].parameters(), lr=1e-3)
        for p, g in zip(models[0].parameters(), gradients(0, 9, models[0])):
            p.grad = g
        adam.step()
        reps[0].optimizer = adam
    source = reps[0]
    snapshot = encode_state(source.state_tensors(), source.round, 0, "cfg", source.phi_hash())
    target_model = Net(seed=1).to(target_device)
    if name == "noloco":
        target = NoLoCo(target_model, NoLoCoConfig(inner_steps=H), LocalGroup(1).member(0), GroupKey("devices"))
    else:
        target, _ = replica(name, target_model, group_for(name, 1, target_model).member(0))
    if name == "ddp":
        target.optimizer = torch.optim.AdamW(target_model.parameters(), lr=1e-3)
    received = decode_state(snapshot.blob, target.expected_shapes())
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in received.values())
    target.load_state_tensors(received)
    assert all(p.device.type == target_device for p in target_model.parameters())
    phi = getattr(target, "phi", None)
    if phi is not None:
        assert all(t.device.type == "cpu" for t in phi)
    if name == "ddp":
        for p in target_model.parameters():
            state = target.optimizer.state[p]
            assert state["exp_avg"].device == p.device and state["step"].device.type == "cpu"
    assert target.phi_hash() == source.phi_hash()
    again = encode_state(target.state_tensors(), source.round, 0, "cfg", target.phi_hash())
    assert state_bytes(again.blob) == state_bytes(snapshot.blob)


OPTIMIZERS = [pytest.param("cpu", {}, id="cpu-plain"), pytest.param("cpu", {"fused": True}, id="cpu-fused"),
              *[pytest.param("cuda", flags, id=f"cuda-{name}", marks=needs_cuda)
                for name, flags in (("plain", {}), ("fused", {"fused": True}), ("capturable", {"capturable": True}))]]


@pytest.mark.parametrize(("device", "flags"), OPTIMIZERS)
def test_an_optimizer_step_count_is_placed_as_torch_places_it(device, flags):
    """`optimizer_step` puts the step where torch itself keeps it: on the parameter's device for fused and
    capturable groups, on the CPU otherwise; a state loaded that way (a stage's inner AdamW) steps on."""
    p = nn.Parameter(torch.randn(4, device=device))
    optimizer = torch.optim.AdamW([p], lr=1e-3, **flags)
    p.grad = torch.ones_like(p)
    optimizer.step()
    expected = optimizer.state[p]["step"]
    placed = optimizer_step(optimizer, p, 1.0)
    assert placed.device == expected.device and placed.dtype == expected.dtype and float(placed) == 1.0
    _load_adam(optimizer, nn.ParameterList([p]), {"adam.exp_avg.0": torch.zeros(4), "adam.exp_avg_sq.0": torch.ones(4)},
               step=3)
    assert optimizer.state[p]["exp_avg"].device == p.device and optimizer.state[p]["step"].device == expected.device
    p.grad = torch.ones_like(p)
    optimizer.step()  # a step count on the wrong device fails here
    assert float(optimizer.state[p]["step"]) == 4.0


def test_a_capturable_group_gets_its_step_on_the_parameter_device():
    """Placement only (torch steps a capturable optimizer on an accelerator, not on the CPU)."""
    p = nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([p], lr=1e-3, capturable=True)
    placed = optimizer_step(optimizer, p, 2.0)
    assert placed.device == p.device and placed.dtype == torch.float32 and float(placed) == 2.0


# ---- a peer's trainer and a stage server on their device ---------------------------------------

def small_config():
    return default_config().override({"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 2,
                                      "model.context": 16, "inner.batch_size": 2, "data.eval_batches": 1})


@pytest.mark.parametrize("device", DEVICES)
def test_a_peer_trainer_trains_on_its_device_from_the_same_start(device):
    config = small_config()
    cpu = LocalTrainer(config, 0, 4, torch.device("cpu"))
    trainer = LocalTrainer(config, 0, 4, resolve_device(device))
    assert all(p.device.type == device for p in trainer.model.parameters())
    assert tensors_hash(trainer.model.parameters()) == tensors_hash(cpu.model.parameters())  # φ_0 built on the CPU
    loss = trainer.forward_backward()
    trainer.optimizer_step(0)
    assert loss == pytest.approx(cpu.forward_backward(), rel=1e-3) and trainer.compute_s > 0
    assert all(s["exp_avg"].device.type == device for s in trainer.optimizer.state.values())
    assert trainer.evaluate() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_stage_server_takes_the_wire_bytes_onto_its_device(device):
    config = default_config().override({"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 2,
                                        "model.context": 16, "inner.batch_size": 2, "pipeline.stages": 2})
    servers = {d: StageServer(config, initial_stage(config.model, 0, 0, 2, False), 0, device=torch.device(d))
               for d in ("cpu", device)}
    for server in servers.values():
        server.ready = True
    x = pack_tokens(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)))
    call = wire_pb2.StageCall(stage=0, input=x, embed=True)
    replies = {d: s.forward(call) for d, s in servers.items()}
    out, reference = unpack(replies[device].output, 1 << 20), unpack(replies["cpu"].output, 1 << 20)
    assert out.device.type == "cpu" and out.shape == (2, 16, 32)
    # one 8-bit code apart at most where the device's forward rounds differently (equal on the CPU)
    torch.testing.assert_close(out, reference, rtol=0, atol=2 * float(reference.abs().max()) / 127)
    server = servers[device]
    grad = pack(torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2)))
    assert server.backward(wire_pb2.StageCall(stage=0, input=x, embed=True, grad_output=grad)).status == \
        wire_pb2.StageReply.OK
    assert all(p.device.type == device for p in server.module.parameters())
    assert all(s["exp_avg"].device.type == device for s in server.optimizer.state.values())
    server.phi = {n: p.detach().cpu() for n, p in server.module.named_parameters()}  # φ arrives on the CPU
    assert all(t.device.type == device for t in server.phi.values())
    assert server.forward(wire_pb2.StageCall(stage=0, input=x, embed=True, use_phi=True)).status == \
        wire_pb2.StageReply.OK


def test_the_seeded_model_forks_the_rng_of_the_current_gpu_only(monkeypatch):
    """A peer on cuda:1 of a machine with 4 GPUs builds φ_0 forking the CPU's and cuda:1's RNG, not every GPU's."""
    import contextlib

    from lowcomm.models.factory import build_model

    forked = []

    @contextlib.contextmanager
    def fork_rng(devices=None, **kwargs):
        forked.append(list(devices))
        yield

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.random, "fork_rng", fork_rng)
    monkeypatch.setattr(torch, "manual_seed", lambda seed: None)  # the patched CUDA state has no generators
    build_model(default_config().model, seed=0)
    assert forked == [[1]]
