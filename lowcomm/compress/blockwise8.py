"""8-bit blockwise quantization for activations and their gradients at pipeline stage boundaries.

The flattened tensor is cut into blocks of BLOCK values; each block is sent as int8 codes and one
float32 scale (the block's absolute maximum / 127):

    scale_b = max|x_b| / 127   (1 where the block is all zeros)
    q = round(x / scale_b) in [-127, 127]        decode: x̂ = q · scale_b

That is 1 + 4/BLOCK bytes per value (1.06 for BLOCK = 64), a quarter of fp32, with a per-block
error of at most scale_b / 2. Decoding validates sizes and scales before it allocates anything.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lowcomm.compress.errors import CodecError
from lowcomm.compress.finite import all_finite

BLOCK = 64
MAX_ELEMENTS = 1 << 26


def encode_blockwise8(x: torch.Tensor) -> tuple[bytes, bytes]:
    """(int8 codes, float32 scales) of a floating tensor; refuses NaN or Inf."""
    flat = x.detach().to("cpu").to(torch.float32).reshape(-1)  # computed on the CPU: the same bytes on any device
    if not all_finite(flat):
        raise CodecError("blockwise8: the tensor holds NaN or Inf")
    blocks = -(-flat.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[:flat.numel()] = flat
    padded = padded.view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[:flat.numel()].numpy().tobytes(), scales.numpy().tobytes()


def decode_blockwise8(codes: bytes, scales: bytes, shape: tuple[int, ...],
                      max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """The float32 tensor of `shape` that `encode_blockwise8` described; CodecError on anything malformed."""
    if any(int(d) < 0 for d in shape):
        raise CodecError(f"blockwise8: negative dimension in shape {tuple(shape)}")
    numel = math.prod(int(d) for d in shape)
    if numel > max_elements:
        raise CodecError(f"blockwise8: {numel} values exceed the limit of {max_elements}")
    blocks = -(-numel // BLOCK)
    if len(codes) != numel:
        raise CodecError(f"blockwise8: {len(codes)} code bytes for {numel} values")
    if len(scales) != 4 * blocks:
        raise CodecError(f"blockwise8: {len(scales)} scale bytes for {blocks} blocks (4 each expected)")
    scale = np.frombuffer(scales, dtype="<f4")
    if not np.isfinite(scale).all() or (scale <= 0).any():
        raise CodecError("blockwise8: a block scale is not a finite positive number")
    q = np.frombuffer(codes, dtype=np.int8).astype(np.float32)
    padded = np.zeros(blocks * BLOCK, dtype=np.float32)
    padded[:numel] = q
    with np.errstate(over="ignore"):
        values = (padded.reshape(blocks, BLOCK) * scale[:, None]).reshape(-1)[:numel]
    if not np.isfinite(values).all():
        raise CodecError("blockwise8: decoded values are not finite (a scale overflows float32)")
    return torch.from_numpy(values.copy()).reshape(tuple(int(d) for d in shape))
