import math

import pytest
import torch

from lowcomm.models.gpt import GPT, Block, Embedding, Head, ModelConfig


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig())


def test_default_model_has_about_0_87m_parameters(model):
    # embed 256*128 + 64*128, 4 blocks of 198,272, head LayerNorm 256 + 128*256 (no bias)
    assert model.num_parameters() == 867_072


def test_parts_are_separate_modules_for_pipeline_stages(model):
    assert isinstance(model.embed, Embedding)
    assert isinstance(model.head, Head)
    assert len(model.blocks) == 4 and all(isinstance(b, Block) for b in model.blocks)
    # not tied: the head owns its own weight, so stage 0 and the last stage share nothing
    assert model.head.linear.weight.data_ptr() != model.embed.token.weight.data_ptr()


def test_init_is_deterministic_given_the_seed():
    torch.manual_seed(3)
    a = GPT(ModelConfig())
    torch.manual_seed(3)
    b = GPT(ModelConfig())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.all(a.blocks[0].attn.qkv.bias == 0)
    assert abs(a.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.002


def test_forward_shapes_and_initial_loss_is_near_uniform(model):
    idx = torch.randint(0, 256, (2, 64))
    logits, loss = model(idx)
    assert logits.shape == (2, 64, 256) and loss is None
    _, loss = model(idx, torch.randint(0, 256, (2, 64)))
    assert loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.1


def test_attention_is_causal(model):
    model.eval()
    idx = torch.randint(0, 256, (1, 64))
    changed = idx.clone()
    changed[0, 40] = (changed[0, 40] + 1) % 256
    before, _ = model(idx)
    after, _ = model(changed)
    assert torch.allclose(before[:, :40], after[:, :40], atol=1e-6)
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_rejects_sequences_longer_than_the_context(model):
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_a_few_steps_on_one_batch_lower_the_loss(model):
    x = torch.randint(0, 256, (4, 64))
    y = torch.roll(x, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(10):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model(x, y)[1].item() < first - 0.5
