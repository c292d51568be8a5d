"""Helpers shared by the algorithms for hashing and exporting replica state."""

from __future__ import annotations

import hashlib

import torch


def tensors_hash(tensors) -> str:
    """sha256 of the float32 bytes of the tensors, in order: equal iff the replicas are bit-identical."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]
