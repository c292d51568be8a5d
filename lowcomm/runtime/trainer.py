"""The local half of a training peer: model, data shard, the inner optimizer (algorithms.inner), evaluation.

One torch thread per peer process (oversubscribed cores make every deadline flaky).
"""

from __future__ import annotations

import time

import torch

from lowcomm.algorithms.inner import InnerOptimizer, NonFiniteGradient
from lowcomm.data.corpus import load_corpus
from lowcomm.data.loader import TokenShard, evaluate, heldout_batches
from lowcomm.models.gpt import GPT


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(requested)


class LocalTrainer:
    def __init__(self, config, shard_index: int, num_shards: int, device: torch.device):
        self.config = config
        self.device = device
        torch.manual_seed(config.run.seed)  # every peer starts from the same φ_0
        self.model = GPT(config.model).to(device)
        corpus = load_corpus(config.data)
        self.shard = TokenShard(corpus.train, shard_index, num_shards, config.model.context,
                                config.inner.batch_size, config.run.seed)
        self.eval_batches = heldout_batches(corpus.heldout, config.model.context, config.inner.batch_size,
                                            config.data.eval_batches)
        self.inner = InnerOptimizer(self.model.parameters(), config.inner)
        self.optimizer = self.inner.optimizer
        self.tokens_per_step = config.inner.batch_size * config.model.context
        self.compute_s = 0.0
        self.skipped_steps = 0  # steps whose gradient was not finite (dropped before any sync or update)

    def lr_at(self, step: int) -> float:
        return self.inner.lr_at(step)

    def forward_backward(self) -> float:
        t0 = time.perf_counter()
        x, y = self.shard.next_batch()
        self.inner.zero_grad()
        _, loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        try:
            self.inner.clip()
        except NonFiniteGradient:  # the gradients are dropped: this step contributes nothing
            self.skipped_steps += 1
        self.compute_s += time.perf_counter() - t0
        return loss.item()

    def optimizer_step(self, step: int) -> None:
        t0 = time.perf_counter()
        self.inner.step(step)
        self.compute_s += time.perf_counter() - t0

    def evaluate(self) -> float:
        return evaluate(self.model, [(x.to(self.device), y.to(self.device)) for x, y in self.eval_batches])
