"""Tensors crossing a stage boundary as protobuf `Activation`s: 8-bit blockwise floats or int64 token ids.

Everything received is validated (shape, sizes, finiteness, token range) before it reaches a model;
a shape with a dimension of 0 is refused too (no hop carries an empty batch or sequence, and the
model cannot take one).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lowcomm.compress.blockwise8 import decode_blockwise8, encode_blockwise8
from lowcomm.compress.errors import CodecError
from lowcomm.proto import wire_pb2

MAX_NDIM = 4


class ActivationError(ValueError):
    """A received activation is malformed or does not fit what the stage expects."""


def pack(x: torch.Tensor) -> wire_pb2.Activation:
    codes, scales = encode_blockwise8(x)
    return wire_pb2.Activation(shape=list(x.shape), codes=codes, scales=scales)


def pack_tokens(idx: torch.Tensor) -> wire_pb2.Activation:
    codes = idx.detach().to("cpu").to(torch.int64).numpy().astype("<i8").tobytes()  # token ids on any device
    return wire_pb2.Activation(shape=list(idx.shape), codes=codes, tokens=True)


def unpack(message: wire_pb2.Activation, max_elements: int) -> torch.Tensor:
    shape = _shape(message, max_elements)
    if message.tokens:
        raise ActivationError("expected activations, got token ids")
    try:
        return decode_blockwise8(message.codes, message.scales, shape, max_elements)
    except CodecError as e:
        raise ActivationError(str(e)) from None


def unpack_tokens(message: wire_pb2.Activation, vocab_size: int, max_elements: int) -> torch.Tensor:
    shape = _shape(message, max_elements)
    if not message.tokens or len(shape) != 2:
        raise ActivationError("expected a [batch, seq] tensor of token ids")
    if len(message.codes) != 8 * math.prod(shape):
        raise ActivationError(f"{len(message.codes)} bytes for {math.prod(shape)} int64 token ids")
    idx = np.frombuffer(message.codes, dtype="<i8")
    if idx.size and (idx.min() < 0 or idx.max() >= vocab_size):
        raise ActivationError(f"token ids outside 0..{vocab_size - 1}")
    return torch.from_numpy(idx.astype(np.int64)).reshape(shape)


def _shape(message: wire_pb2.Activation, max_elements: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in message.shape)
    if not 1 <= len(shape) <= MAX_NDIM or 0 in shape or math.prod(shape) > max_elements:
        raise ActivationError(f"activation shape {shape} has no dims, a dim of 0, more than {MAX_NDIM} dims or "
                              f"more than {max_elements} values")
    return shape
