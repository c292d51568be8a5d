"""Helpers shared by the algorithms for hashing, exporting and loading replica state."""

from __future__ import annotations

import hashlib

import torch


def tensors_hash(tensors) -> str:
    """sha256 of the float32 bytes of the tensors, in order: equal iff the replicas are bit-identical."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def optimizer_step(optimizer: torch.optim.Optimizer, param: torch.Tensor, step: float) -> torch.Tensor:
    """The ``step`` entry of ``param``'s optimizer state, placed as torch's own ``load_state_dict`` places it:
    a CPU scalar, or a float32 scalar on the parameter's device where its group is fused or capturable
    (those kernels read the step on the device and refuse a CPU one)."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step))
