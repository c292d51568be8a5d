"""The local half of a peer: model, data shard, inner optimizer with its lr schedule, evaluation.

One torch thread per peer process (oversubscribed cores make every deadline flaky).
"""

from __future__ import annotations

import time

import torch

from lowcomm.config import RunConfig
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
    def __init__(self, config: RunConfig, shard_index: int, num_shards: int, device: torch.device):
        self.config = config
        self.device = device
        torch.manual_seed(config.run.seed)  # every peer starts from the same φ_0
        self.model = GPT(config.model).to(device)
        corpus = load_corpus(config.data)
        self.shard = TokenShard(corpus.train, shard_index, num_shards, config.model.context,
                                config.inner.batch_size, config.run.seed)
        self.eval_batches = heldout_batches(corpus.heldout, config.model.context, config.inner.batch_size,
                                            config.data.eval_batches)
        inner = config.inner
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                                           weight_decay=inner.weight_decay)
        self.tokens_per_step = inner.batch_size * config.model.context
        self.compute_s = 0.0

    def lr_at(self, step: int) -> float:
        warmup = self.config.inner.warmup_steps
        return self.config.inner.lr * min(1.0, (step + 1) / warmup) if warmup > 0 else self.config.inner.lr

    def forward_backward(self) -> float:
        t0 = time.perf_counter()
        x, y = self.shard.next_batch()
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.model(x.to(self.device), y.to(self.device))
        loss.backward()
        if self.config.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.inner.grad_clip)
        self.compute_s += time.perf_counter() - t0
        return loss.item()

    def optimizer_step(self, step: int) -> None:
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.step()
        self.compute_s += time.perf_counter() - t0

    def evaluate(self) -> float:
        return evaluate(self.model, [(x.to(self.device), y.to(self.device)) for x, y in self.eval_batches])
