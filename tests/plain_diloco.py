"""Plain DiLoCo and data-parallel training, written from the setup alone: the reference lowcomm is held to.

No lowcomm code runs here but the model class and the corpus's token array. The setup:

- R replicas of one model, initialised by ``torch.manual_seed(seed)`` then the model's constructor;
- AdamW (lr, betas, weight decay) with a linear warm-up to lr over the first ``warmup`` steps,
  ``lr * (step + 1) / warmup``, then constant;
- replica r owns the r-th contiguous R-th of the training tokens and draws each batch of B windows
  of T + 1 tokens at uniform random offsets inside it, from ``numpy.random.default_rng([seed, r])``
  (``sampler="torch"``: from a torch generator seeded ``1000 * seed + r`` instead;
  ``sharding="interleaved"``: replica r owns every R-th block of ``block`` tokens instead, blocks
  r, r + R, ..., and draws each window inside one of its blocks);
- DiLoCo: every H steps Δ_r = φ − θ_r, Δ̄ their fp32 mean, outer SGD (lr, momentum, Nesterov) on φ
  kept in fp32, every replica then copies φ; the AdamW states carry over between rounds
  (``reset_inner=True``: each round starts a fresh AdamW);
- ddp: one model, each step's gradient the mean over the R replicas' batches (one batch of R·B);
- the result is φ after the last full round (DiLoCo) or the model after the last step (ddp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Setup:
    replicas: int = 4
    steps: int = 2000
    seed: int = 0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup: int = 50
    batch: int = 16
    context: int = 64
    inner_steps: int = 30  # H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    sampler: str = "numpy"  # "numpy" | "torch"
    sharding: str = "contiguous"  # "contiguous" | "interleaved"
    block: int = 4096  # tokens per block of the interleaved sharding
    reset_inner: bool = False


class Shard:
    def __init__(self, tokens: np.ndarray, r: int, setup: Setup):
        n = len(tokens)
        self.setup = setup
        if setup.sharding == "interleaved":
            self.tokens = tokens
            self.blocks = np.arange(r, n // setup.block, setup.replicas)
        else:
            self.tokens = tokens[r * n // setup.replicas:(r + 1) * n // setup.replicas]
        self.high = len(self.tokens) - setup.context
        if setup.sampler == "numpy":
            self.rng = np.random.default_rng([setup.seed, r])
        else:
            self.gen = torch.Generator().manual_seed(1000 * setup.seed + r)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.setup
        if s.sharding == "interleaved":
            blocks = self.blocks[self.rng.integers(0, len(self.blocks), size=s.batch)]
            offsets = blocks * s.block + self.rng.integers(0, s.block - s.context, size=s.batch)
        elif s.sampler == "numpy":
            offsets = self.rng.integers(0, self.high, size=s.batch)
        else:
            offsets = torch.randint(0, self.high, (s.batch,), generator=self.gen).numpy()
        rows = torch.from_numpy(np.stack([self.tokens[o:o + s.context + 1].astype(np.int64) for o in offsets]))
        return rows[:, :-1], rows[:, 1:]


def _adamw(model: torch.nn.Module, s: Setup) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)


def _set_lr(opt: torch.optim.Optimizer, s: Setup, step: int) -> None:
    for g in opt.param_groups:
        g["lr"] = s.lr * min(1.0, (step + 1) / s.warmup)


def diloco(make_model, tokens: np.ndarray, s: Setup) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """Plain DiLoCo: (a model holding φ after the last full round, the replicas' live models θ_r)."""
    torch.manual_seed(s.seed)
    models = [make_model()]
    models += [make_model() for _ in range(s.replicas - 1)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    phi = [p.detach().clone().float() for p in models[0].parameters()]
    for p in phi:
        p.requires_grad_(True)
    outer = torch.optim.SGD(phi, lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.outer_momentum > 0)
    inner = [_adamw(m, s) for m in models]
    shards = [Shard(tokens, r, s) for r in range(s.replicas)]
    for step in range(s.steps):
        for m, opt, shard in zip(models, inner, shards):
            x, y = shard.batch()
            opt.zero_grad(set_to_none=True)
            m(x, y)[1].backward()
            _set_lr(opt, s, step)
            opt.step()
        if (step + 1) % s.inner_steps == 0:
            with torch.no_grad():
                params = [list(m.parameters()) for m in models]
                for i, ph in enumerate(phi):  # Δ̄ = mean_r (φ − θ_r)
                    ph.grad = sum(ph.detach() - ps[i].detach().float() for ps in params) / s.replicas
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m in models:
                    for p, ph in zip(m.parameters(), phi):
                        p.copy_(ph)
            if s.reset_inner:
                inner = [_adamw(m, s) for m in models]
    final = make_model()
    with torch.no_grad():
        for p, ph in zip(final.parameters(), phi):
            p.copy_(ph)
    return final, models


def ddp(make_model, tokens: np.ndarray, s: Setup) -> torch.nn.Module:
    """Plain data parallelism: one model, the mean gradient of R batches of B per step."""
    torch.manual_seed(s.seed)
    model = make_model()
    opt = _adamw(model, s)
    shards = [Shard(tokens, r, s) for r in range(s.replicas)]
    for step in range(s.steps):
        batches = [shard.batch() for shard in shards]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        _set_lr(opt, s, step)
        opt.step()
    return model


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, tokens: np.ndarray, context: int, batch: int = 64) -> float:
    """Mean next-token loss over every non-overlapping window of ``context`` + 1 tokens of ``tokens``."""
    model.eval()
    n = (len(tokens) - 1) // context
    total, count = 0.0, 0
    for start in range(0, n, batch):
        idx = np.arange(start, min(n, start + batch)) * context
        rows = torch.from_numpy(np.stack([tokens[o:o + context + 1].astype(np.int64) for o in idx]))
        loss = model(rows[:, :-1], rows[:, 1:])[1]
        total += float(loss) * len(idx)
        count += len(idx)
    model.train()
    return total / count
