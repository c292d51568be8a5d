"""The inner optimizer every local-update algorithm runs between syncs: AdamW with linear warm-up.

This module owns the [inner] section of the run config; the optimizer itself is built by the
runtime's trainer (runtime.trainer) and the pipeline's stage server (pipeline.server) for now.
"""

from __future__ import annotations

from dataclasses import dataclass


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
