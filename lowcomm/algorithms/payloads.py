"""Peers' encoded tensors → scatter-mean contributions, checked against the shape the receiver expects.

A contribution is (flat indices int64, values float32). Sparse codecs give the coordinates the
sender kept; any other codec gives every coordinate, so one scatter-mean serves both (ALGORITHMS.md:
the mean is over the contributions received, never over R).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowcomm.compress import Codec, SparseCodec

Contribution = tuple[torch.Tensor, torch.Tensor]


class PayloadShapeError(ValueError):
    """A peer's payload decodes to another shape than the parameter it claims to update.

    Drop that peer's contribution for the round (and report it): the sender runs another model.
    """


def decode_contribution(blob: bytes, codec: Codec, shape: tuple[int, ...]) -> Contribution:
    """One peer's payload for a parameter of ``shape``; raises ``CodecError`` or ``PayloadShapeError``."""
    if isinstance(codec, SparseCodec):
        indices, values, got = codec.decode_sparse(blob)
    else:
        decoded = codec.decode(blob)
        got, values = tuple(decoded.shape), decoded.reshape(-1)
        indices = torch.arange(values.numel(), dtype=torch.int64)
    if tuple(got) != tuple(shape):
        raise PayloadShapeError(f"payload has shape {tuple(got)}, expected {tuple(shape)}")
    return indices, values


def decode_contributions(blobs: Sequence[bytes], codec: Codec, shape: tuple[int, ...]) -> list[Contribution]:
    return [decode_contribution(blob, codec, shape) for blob in blobs]
