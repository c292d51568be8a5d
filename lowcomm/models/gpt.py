"""A small byte-level GPT in the style of nanoGPT: the model every lowcomm algorithm trains.

Three parts, in order: `Embedding` (token + learned position), a list of pre-LN `Block`s, and
`Head` (final LayerNorm + linear to the vocabulary). The head's weight is NOT tied to the token
embedding so that the model can be cut into pipeline stages: stage 0 owns `embed`, the last stage
owns `head`, and no parameter is shared between stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dataclasses import dataclass

from torch import nn

INIT_STD = 0.02


@dataclass
class ModelConfig:
    """The [model] section: the GPT's shape (byte-level by default: 256 tokens), or a factory of one's own.

    `factory` = "package.module:callable" builds the run's model instead of the GPT (models.factory):
    the callable gets this section and returns a torch module; the shape fields mean what it makes
    of them, but `vocab_size` must cover the data's token ids and `context` is the window length."""

    factory: str = ""  # "": the built-in GPT; "package.module:callable": a user's model (models.factory)
    vocab_size: int = 256
    d_model: int = 128  # divisible by n_heads
    n_layers: int = 4  # divisible by pipeline.stages
    n_heads: int = 4
    context: int = 64  # tokens per sequence


class Embedding(nn.Module):
    """Token embedding plus a learned absolute position embedding."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.context = config.context
        self.token = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq_len = idx.shape[1]
        if seq_len > self.context:
            raise ValueError(f"sequence of {seq_len} tokens is longer than model.context = {self.context}")
        positions = torch.arange(seq_len, device=idx.device)
        return self.token(idx) + self.position(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError("model.d_model must be divisible by model.n_heads")
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        # [B, T, C] -> [B, heads, T, C / heads]
        q, k, v = (t.view(batch, seq_len, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, d_model)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits (its own weight, not tied)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.linear = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.ln(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.head = Head(config)
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: int64 [B, T] -> logits [B, T, vocab]; loss is the mean cross-entropy if targets given."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    """Deterministic given torch's RNG: N(0, 0.02) weights, zero biases, LayerNorm left at (1, 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)

