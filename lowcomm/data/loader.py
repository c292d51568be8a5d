"""Batches for training and evaluation, cut from a corpus's token arrays.

Training: each peer owns one contiguous shard of the train tokens (shard i of n, equal split) and
samples windows at random offsets inside it, from a generator seeded by (seed, shard index), so a
peer's batches are reproducible and peers never read each other's text.

Evaluation: one fixed set of evenly spaced windows over the held-out tokens, so every algorithm
and every peer is scored on exactly the same data.

The loss of a batch (`next_token_loss`, what training and evaluation both score unless a caller
passes its own): ``model(x)``, whose output is the logits or a tuple with the logits first (the
built-in GPT returns ``(logits, None)``), then the mean cross-entropy against the targets y.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, x, y) -> scalar loss


def logits_of(output) -> torch.Tensor:
    """The logits in a model's output: the output itself, or the first element of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``model(x)``'s logits [B, T, V] against the next tokens y [B, T]."""
    logits = logits_of(model(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class TokenShard:
    """Shard `shard_index` of `num_shards` of `tokens`; `next_batch()` draws (x, y) int64 [B, T]."""

    def __init__(self, tokens: np.ndarray, shard_index: int, num_shards: int,
                 context: int, batch_size: int, seed: int):
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} is outside 0..{num_shards - 1}")
        # Boundaries i*n//k cover every token exactly once; shard sizes differ by at most one.
        self.start = shard_index * len(tokens) // num_shards
        self.stop = (shard_index + 1) * len(tokens) // num_shards
        if self.stop - self.start < context + 1:
            raise ValueError(f"a shard of {self.stop - self.start} tokens cannot hold one window of "
                             f"context {context} + 1; use fewer shards or a smaller context")
        self.tokens = tokens[self.start:self.stop]
        self.context = context
        self.batch_size = batch_size
        self.rng = np.random.default_rng([seed, shard_index])

    def __iter__(self) -> "TokenShard":
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def next_batch(self) -> Batch:
        offsets = self.rng.integers(0, len(self.tokens) - self.context, size=self.batch_size)
        return _windows(self.tokens, offsets, self.context)


def heldout_batches(tokens: np.ndarray, context: int, batch_size: int, n_batches: int) -> list[Batch]:
    """`n_batches` fixed batches of windows spaced evenly from the start to the end of `tokens`."""
    n_windows = batch_size * n_batches
    last_offset = len(tokens) - context - 1
    if last_offset < 0:
        raise ValueError(f"{len(tokens)} held-out tokens cannot hold a window of context {context} + 1")
    offsets = np.linspace(0, last_offset, n_windows).round().astype(np.int64)
    return [_windows(tokens, offsets[i:i + batch_size], context)
            for i in range(0, n_windows, batch_size)]


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], loss_fn: LossFn = next_token_loss) -> float:
    """Mean loss of `model` over `batches`, in eval mode; the model's training mode is restored."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        losses = [loss_fn(model, x.to(device), y.to(device)).item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def _windows(tokens: np.ndarray, offsets: np.ndarray, context: int) -> Batch:
    """Inputs tokens[o : o+T] and next-token targets tokens[o+1 : o+T+1] for each offset o."""
    rows = np.stack([np.asarray(tokens[o:o + context + 1], dtype=np.int64) for o in offsets])
    rows = torch.from_numpy(rows)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
