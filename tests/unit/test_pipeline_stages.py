"""Pipeline pieces in-process: the stage split, CheckFree(+) against hand computations, the 8-bit
activation codec, and the stage server's stateless backward and input validation."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.compress.blockwise8 import BLOCK, decode_blockwise8, encode_blockwise8
from lowcomm.compress.errors import CodecError
from lowcomm.config import default_config
from lowcomm.models.gpt import GPT
from lowcomm.pipeline.activations import ActivationError, pack, pack_tokens, unpack
from lowcomm.pipeline.checkfree import LR_SCALE, NORM_EPS, rebuild_stage, weighted_blocks
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import StageModule, hop_order, initial_stage
from lowcomm.proto import wire_pb2

Reply = wire_pb2.StageReply


def small_config(stages: int = 2, layers: int = 4):
    return default_config().override({"model.d_model": 32, "model.n_heads": 2, "model.n_layers": layers,
                                       "model.context": 16, "inner.batch_size": 4, "pipeline.stages": stages})


# ---- the split -------------------------------------------------------------------------------

@pytest.mark.parametrize("stages", [1, 2, 4])
def test_the_stages_chained_compute_the_whole_model(stages):
    config = small_config(stages)
    torch.manual_seed(0)
    model = GPT(config.model)
    parts = [StageModule.from_model(model, s, stages, replicate_ends=stages >= 4) for s in range(stages)]
    x = torch.randint(0, 256, (3, 16))
    h = x
    for hop in hop_order(stages, 0, swap_ends=False):
        h = parts[hop.stage](h, embed=hop.embed, head=hop.head)
    torch.testing.assert_close(h, model(x)[0], rtol=0, atol=0)


def test_checkfree_plus_swaps_the_end_stages_on_odd_microbatches():
    assert [(h.stage, h.embed, h.head) for h in hop_order(4, 0, True)] == [
        (0, True, False), (1, False, False), (2, False, False), (3, False, True)]
    assert [(h.stage, h.embed, h.head) for h in hop_order(4, 1, True)] == [
        (1, True, False), (0, False, False), (3, False, False), (2, False, True)]
    assert [h.stage for h in hop_order(4, 1, False)] == [0, 1, 2, 3]
    replicated = [initial_stage(small_config(4).model, 0, s, 4, True) for s in range(4)]
    assert [m.embed is not None for m in replicated] == [True, True, False, False]
    assert [m.head is not None for m in replicated] == [False, False, True, True]
    # replicas start as copies of the original
    torch.testing.assert_close(replicated[1].embed.token.weight, replicated[0].embed.token.weight)


def test_a_model_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="divide"):
        small_config(3, layers=4)


# ---- CheckFree -------------------------------------------------------------------------------

def test_checkfree_weights_the_neighbours_by_their_gradient_norms():
    prev = {"blocks.0.w": torch.tensor([1.0, 2.0]), "embed.token.weight": torch.tensor([9.0])}
    nxt = {"blocks.0.w": torch.tensor([3.0, 6.0])}
    out = weighted_blocks(prev, nxt, norm_prev=1.0, norm_next=3.0)
    w1, w3 = 1.0 + NORM_EPS, 3.0 + NORM_EPS  # by hand: (ω1·W1 + ω3·W3) / (ω1 + ω3)
    torch.testing.assert_close(out["blocks.0.w"], torch.tensor([(w1 * 1 + w3 * 3) / (w1 + w3),
                                                                (w1 * 2 + w3 * 6) / (w1 + w3)]))
    assert set(out) == {"blocks.0.w"}
    assert LR_SCALE == pytest.approx(1.1)


def test_checkfree_rebuilds_a_middle_stage_and_copies_its_replicated_embedding():
    config = small_config(4)
    stages = [initial_stage(config.model, s, s, 4, True) for s in range(4)]  # different seeds: distinct weights
    phi = [dict(m.named_parameters()) for m in stages]
    expected = stages[1].shapes()
    out, method = rebuild_stage(1, 4, expected, {0: (phi[0], 2.0), 2: (phi[2], 0.5)}, fallback={})
    assert method == "checkfree"
    name = "blocks.0.attn.qkv.weight"
    w0, w2 = 2.0 + NORM_EPS, 0.5 + NORM_EPS
    torch.testing.assert_close(out[name], (w0 * phi[0][name] + w2 * phi[2][name]) / (w0 + w2))
    torch.testing.assert_close(out["embed.token.weight"], phi[0]["embed.token.weight"])  # stage 1's replica


def test_checkfree_plus_copies_the_neighbour_of_a_lost_end_stage():
    config = small_config(4)
    stages = [initial_stage(config.model, s, s, 4, True) for s in range(4)]
    phi = [dict(m.named_parameters()) for m in stages]
    first, method = rebuild_stage(0, 4, stages[0].shapes(), {1: (phi[1], 1.0)}, fallback={})
    assert method == "checkfree+"
    for name in first:  # blocks from stage 1, the embedding from stage 1's replica of it
        torch.testing.assert_close(first[name], phi[1][name])
    last, _ = rebuild_stage(3, 4, stages[3].shapes(), {2: (phi[2], 1.0)}, fallback={})
    torch.testing.assert_close(last["head.linear.weight"], phi[2]["head.linear.weight"])
    with pytest.raises(ValueError, match="neighbour"):
        rebuild_stage(1, 4, stages[1].shapes(), {0: (phi[0], 1.0)}, fallback={})


def test_without_replicas_a_lost_end_stage_gets_a_fresh_embedding_and_says_so():
    config = small_config(2)
    stages = [initial_stage(config.model, s, s, 2, False) for s in range(2)]
    fresh = dict(initial_stage(config.model, 7, 0, 2, False).named_parameters())
    out, method = rebuild_stage(0, 2, stages[0].shapes(), {1: (dict(stages[1].named_parameters()), 1.0)}, fresh)
    assert method == "checkfree+ (fresh embed)"
    torch.testing.assert_close(out["embed.token.weight"], fresh["embed.token.weight"])


# ---- activations -----------------------------------------------------------------------------

def test_blockwise8_round_trip_is_within_half_a_step_per_block():
    x = torch.randn(5, 7, 33) * torch.logspace(-3, 2, 33)
    codes, scales = encode_blockwise8(x)
    assert len(codes) == x.numel() and len(scales) == 4 * math.ceil(x.numel() / BLOCK)
    y = decode_blockwise8(codes, scales, tuple(x.shape))
    flat, err = x.reshape(-1), (x - y).abs().reshape(-1)
    for b in range(0, flat.numel(), BLOCK):
        step = flat[b:b + BLOCK].abs().max() / 127
        assert err[b:b + BLOCK].max() <= step / 2 + 1e-7


@pytest.mark.parametrize("damage", ["short codes", "short scales", "negative scale", "nan scale", "huge shape"])
def test_blockwise8_refuses_malformed_input(damage):
    codes, scales = encode_blockwise8(torch.randn(100))
    shape = (100,)
    if damage == "short codes":
        codes = codes[:-1]
    elif damage == "short scales":
        scales = scales[:-4]
    elif damage == "negative scale":
        scales = torch.tensor([-1.0, 1.0]).numpy().tobytes()
    elif damage == "nan scale":
        scales = torch.tensor([float("nan"), 1.0]).numpy().tobytes()
    else:
        shape = (1 << 20, 1 << 20)
    with pytest.raises(CodecError):
        decode_blockwise8(codes, scales, shape)
    with pytest.raises(CodecError, match="NaN"):
        encode_blockwise8(torch.tensor([1.0, float("inf")]))


# ---- the stage server ------------------------------------------------------------------------

def server_pair(config, stage: int):
    servers = [StageServer(config, initial_stage(config.model, 0, stage, 2, False), stage) for _ in range(2)]
    for s in servers:
        s.ready = True
    return servers


def call(stage: int, **fields):
    return wire_pb2.StageCall(stage=stage, **fields)


def test_a_backward_on_another_replica_equals_one_on_the_same_replica():
    """Stateless backward: the call carries the input, so which replica serves it does not matter."""
    config = small_config(2)
    a, b = server_pair(config, 1)
    x = pack(torch.randn(4, 16, 32))
    y = pack_tokens(torch.randint(0, 256, (4, 16)))
    assert a.forward(call(1, input=x, head=True, targets=y)).status == Reply.OK
    ra, rb = a.backward(call(1, input=x, head=True, targets=y)), b.backward(call(1, input=x, head=True, targets=y))
    assert ra.status == rb.status == Reply.OK and ra.loss == rb.loss
    torch.testing.assert_close(unpack(ra.output, 1 << 20), unpack(rb.output, 1 << 20))
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(pa, pb)  # the same inner step on both
    assert a.step == b.step == 1


def test_the_pipeline_gradient_matches_the_whole_model():
    config = small_config(2)
    torch.manual_seed(0)
    model = GPT(config.model)
    stages = [StageModule.from_model(model, s, 2, False) for s in range(2)]
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    _, loss = model(x, y)
    loss.backward()
    servers = [StageServer(config, stages[s], s) for s in range(2)]
    captured = {}
    for s in servers:
        s.ready = True
        s._inner_step = lambda s=s: captured.update({f"{s.stage}.{n}": p.grad.clone()
                                                      for n, p in s.module.named_parameters()})
    h = servers[0].forward(call(0, input=pack_tokens(x), embed=True)).output
    last = servers[1].backward(call(1, input=h, head=True, targets=pack_tokens(y)))
    servers[0].backward(call(0, input=pack_tokens(x), embed=True, grad_output=last.output))
    assert last.loss == pytest.approx(loss.item(), rel=1e-2)  # 8-bit activations: close, not equal
    whole = dict(model.named_parameters())
    for name, grad in [("blocks.0.mlp.fc.weight", "0.blocks.0.mlp.fc.weight"),
                       ("blocks.2.mlp.fc.weight", "1.blocks.0.mlp.fc.weight"),
                       ("head.linear.weight", "1.head.linear.weight")]:
        cos = torch.nn.functional.cosine_similarity(whole[name].grad.reshape(-1), captured[grad].reshape(-1), dim=0)
        assert cos > 0.99, f"{name}: cosine {cos:.4f}"


def test_the_server_refuses_what_it_cannot_serve():
    config = small_config(2)
    server = server_pair(config, 1)[0]
    before = [p.detach().clone() for p in server.module.parameters()]
    assert server.forward(call(0, input=pack(torch.randn(2, 16, 32)))).status == Reply.WRONG_STAGE
    with pytest.raises(ActivationError, match="expected"):
        server.forward(call(1, input=pack(torch.randn(2, 16, 31))))  # wrong width
    with pytest.raises(ActivationError):
        server.forward(call(1, input=wire_pb2.Activation(shape=[2, 16, 32], codes=b"\0" * 10)))  # truncated
    with pytest.raises(ActivationError, match="token ids"):
        server.forward(call(1, input=pack(torch.randn(2, 16, 32)), head=True,
                            targets=pack_tokens(torch.full((2, 16), 999))))
    huge = wire_pb2.Activation(shape=[2, 16, 32], codes=b"\x7f" * 1024, scales=torch.tensor(
        [3e38] * 16).numpy().tobytes())
    with pytest.raises(ActivationError, match="not finite"):  # an overflowing input never reaches the weights
        server.backward(call(1, input=huge, head=True, targets=pack_tokens(torch.zeros(2, 16, dtype=torch.long))))
    for p, b in zip(server.module.parameters(), before):
        torch.testing.assert_close(p, b)
    server.ready = False
    assert server.forward(call(1, input=pack(torch.randn(2, 16, 32)))).status == Reply.BUSY


def test_a_rebuilt_stage_trains_with_its_scaled_lr():
    config = small_config(2)
    server = server_pair(config, 1)[0]
    server.load(server.module, 1, lr_scale=LR_SCALE, step=1000)
    assert server.lr_at(1000) == pytest.approx(config.inner.lr * LR_SCALE)


def test_stage_checkpoints_keep_what_a_restart_needs(tmp_path):
    from lowcomm.runtime.stage_checkpoints import KEEP, StageCheckpoints

    store = StageCheckpoints(tmp_path / "ckpt", stages=2)
    assert store.consistent_round() is None
    for round_ in (1, 2, 3):
        store.write(1, round_, b"one")
    for round_ in range(1, 9):  # stage 1 is down from round 4 on: stage 0 keeps writing
        store.write(0, round_, b"zero")
    assert store.consistent_round() == 3
    assert store.rounds(0) == [3, 4, 5, 6, 7, 8]  # round 3 and after are kept: the restart needs round 3
    assert store.path(1, 3).read_bytes() == b"one"
    for round_ in (9, 10, 11):
        store.write(1, round_, b"one")
    store.write(0, 9, b"zero")
    assert store.consistent_round() == 9 and store.rounds(0) == [7, 8, 9][-KEEP:]
    store.pin(9)  # a restart loads round 9: newer rounds everywhere must not prune it
    for round_ in (12, 13, 14, 15):
        store.write(0, round_, b"zero")
        store.write(1, round_, b"one")
    assert 9 in store.rounds(0) and 9 in store.rounds(1)
    assert not list((tmp_path / "ckpt").glob(".*tmp*"))  # written atomically, nothing left behind
