"""The inner optimizer every local-update algorithm runs between syncs: AdamW with linear warm-up.

This module owns the [inner] section of the run config and `InnerOptimizer`, the one inner step
that the training peer's trainer (runtime.trainer) and the pipeline's stage server
(pipeline.server) both run: the gradient norm (clipped when `grad_clip` > 0), a guard that drops a
non-finite gradient before it reaches the weights, then AdamW at the warmed-up lr times a scale
(CheckFree raises a rebuilt stage's). `TorchInner` puts a user's own torch optimizer (the Python
API, lowcomm.api) behind the same calls: the same clipping and guard, its own learning rate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


def clip_gradients(params: list[torch.nn.Parameter], limit: float, drop: Callable[[], None]) -> float:
    """The gradients' global norm after clipping them to `limit` (0: no clipping); a norm that is not
    finite calls `drop()` (the gradients are dropped) and raises NonFiniteGradient."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None],
                                          limit if limit > 0 else float("inf"))
    if not torch.isfinite(norm):  # a poisoned gradient never reaches the weights
        drop()
        raise NonFiniteGradient("the gradient is not finite; the step was skipped")
    return min(float(norm), limit) if limit > 0 else float(norm)


class InnerOptimizer:
    schedules_lr = True  # lr_at is the run's [inner] schedule (DeMo follows its warm-up)

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
        self.grad_norm = clip_gradients(self.params, self.config.grad_clip, self.zero_grad)
        return self.grad_norm

    def step(self, step: int) -> None:
        """AdamW on the gradients in the parameters at ``lr_at(step)``."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.step()


class TorchInner:
    """A user's torch optimizer as the inner step: InnerOptimizer's calls, the user's own learning rate.

    `step` runs ``optimizer.step()`` then ``scheduler.step()`` when a scheduler is given; `lr_at` only
    reports the first group's lr (nothing here sets it). Clipping and the non-finite guard are
    InnerOptimizer's (`grad_clip` 0: no clipping)."""

    schedules_lr = False

    def __init__(self, optimizer: torch.optim.Optimizer, grad_clip: float = 0.0, scheduler=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer is a {type(optimizer).__name__}; pass a torch.optim.Optimizer over the "
                            "model's parameters")
        if not grad_clip >= 0:
            raise ValueError(f"grad_clip = {grad_clip}: must be >= 0 (0: no clipping)")
        self.optimizer, self.scheduler, self.grad_clip = optimizer, scheduler, grad_clip
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.grad_norm = 0.0

    def lr_at(self, step: int) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip(self) -> float:
        self.grad_norm = clip_gradients(self.params, self.grad_clip, self.zero_grad)
        return self.grad_norm

    def step(self, step: int) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
