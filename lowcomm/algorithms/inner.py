"""The inner optimizer every local-update algorithm runs between syncs: AdamW with linear warm-up.

This module owns the [inner] section of the run config and `InnerOptimizer`, the one inner step
that the training peer's trainer (runtime.trainer) and the pipeline's stage server
(pipeline.server) both run: the gradient norm (clipped when `grad_clip` > 0), a guard that drops a
non-finite gradient before it reaches the weights, then AdamW at the warmed-up lr times a scale
(CheckFree raises a rebuilt stage's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class InnerConfig:
    """The [inner] section: AdamW's hyper-parameters, the warm-up, the batch and gradient clipping."""

    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    warmup_steps: int = 50  # linear warm-up from lr / warmup_steps (0: none)
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    batch_size: int = 16  # sequences per inner step
    grad_clip: float = 0.0  # max global gradient norm (0: no clipping)


class NonFiniteGradient(ValueError):
    """The gradient had an inf or NaN: the step was skipped and the gradients dropped."""


class InnerOptimizer:
    def __init__(self, params: Iterable[torch.nn.Parameter], config: InnerConfig, lr_scale: float = 1.0):
        self.config = config
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(config.beta1, config.beta2),
                                           weight_decay=config.weight_decay)
        self.lr_scale = lr_scale
        self.grad_norm = 0.0  # of the last step's gradient, after clipping

    def lr_at(self, step: int) -> float:
        warmup = self.config.warmup_steps
        return self.config.lr * (min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0) * self.lr_scale

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip(self) -> float:
        """Clips the gradients in place (when `grad_clip` > 0) and returns their norm after clipping.

        Raises NonFiniteGradient, with the gradients dropped, when the norm is not finite."""
        params = [p for p in self.params if p.grad is not None]
        limit = self.config.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, limit if limit > 0 else float("inf"))
        if not torch.isfinite(norm):  # a poisoned gradient never reaches the weights
            self.zero_grad()
            raise NonFiniteGradient("the gradient is not finite; the step was skipped")
        self.grad_norm = min(float(norm), limit) if limit > 0 else float(norm)
        return self.grad_norm

    def step(self, step: int) -> None:
        """AdamW on the gradients in the parameters at ``lr_at(step)``."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.step()
