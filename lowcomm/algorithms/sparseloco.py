"""SparseLoCo (ALGORITHMS.md §3): error feedback instead of outer momentum, chunked top-k + 2-bit values.

Per round, per parameter, on every replica r:

    e_r ← β·e_r + Δ_r                                   # Δ_r = φ − θ_r, the pseudo-gradient
    Δ̂_r = Q(TopK_chunk(e_r));  e_r ← e_r − dequant(Δ̂_r)  # EF absorbs sparsification and quantization
    φ ← φ − η_out · scatter-mean_r(clip(Δ̂_r))

`compress_pseudo_gradient` is the sender's half (EF update and payload) and `aggregate` +
`outer_step` the receiver's; the transport all-gathers the payloads between them. 1-D tensors
(biases, norms) travel as plain float32 (lowcomm's rule), so their residual empties every round.
`clip` (production robustness) scales each peer's dequantized values of a parameter by
min(1, median_norm / (‖v_i‖ + 1e-8)), median over peers, lower middle for an even count as
torch's; it applies to dense 1-D payloads too. State: one residual e per parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowcomm.algorithms.payloads import Contribution, decode_contributions
from lowcomm.compress import Codec, SparseCodec, get_codec, scatter_mean

CLIP_EPS = 1e-8


@dataclass
class SparseLoCoConfig:
    inner_steps: int = 30  # H (production); 15 in the 500M sweep
    outer_lr: float = 1.0  # η_out
    beta: float = 0.95  # error-feedback decay
    topk: int = 64  # k per chunk (clamped even by the codec)
    chunk: int = 64  # target chunk edge (largest divisor ≤ chunk)
    values: str = "q2"  # value codec of the kept entries
    clip: bool = True  # per-peer median-norm clip before the scatter-mean
    overlap: bool = False  # one-step-delay overlap (ALGORITHMS.md §1); error feedback sees Δ_t unchanged
    overlap_apply: str = "arrival"  # when the overlap applies an aggregate: one of algorithms.overlapped.APPLY
    overlap_lead: float = 0.1  # as diloco.overlap_lead

    def codec_for(self, shape: tuple[int, ...]) -> Codec:
        """top-k for tensors of 2 or more dimensions, dense float32 for 0-D and 1-D ones."""
        return _codec(len(shape) <= 1, self.topk, self.chunk, self.values)


@functools.lru_cache(maxsize=16)
def _codec(dense: bool, topk: int, chunk: int, values: str) -> Codec:
    return get_codec("dense", dtype="float32") if dense else get_codec("topk", k=topk, chunk=chunk, values=values)


@dataclass
class SparseLoCoState:
    """The error-feedback residuals e, one per parameter (float32)."""

    errors: list[torch.Tensor]

    @classmethod
    def zeros_like(cls, params: Sequence[torch.Tensor]) -> SparseLoCoState:
        return cls([torch.zeros_like(p, dtype=torch.float32) for p in params])


@torch.no_grad()
def compress_pseudo_gradient(error: torch.Tensor, pseudo_gradient: torch.Tensor, beta: float, codec: Codec) -> bytes:
    """e ← βe + Δ; returns the payload of e and removes what the receivers will decode from e (in place)."""
    error.mul_(beta).add_(pseudo_gradient.to(error.dtype))
    if isinstance(codec, SparseCodec):
        payload, transmitted = codec.encode_with_transmitted(error)
    else:
        payload = codec.encode(error)
        transmitted = codec.decode(payload).reshape(error.shape)
    error.sub_(transmitted.to(error.device))
    return payload


def median_norm_clip(contributions: Sequence[Contribution]) -> list[Contribution]:
    """Scale each peer's values by min(1, median_norm / (‖v_i‖ + 1e-8)); torch's median (lower middle)."""
    if not contributions:
        return []
    norms = torch.stack([values.norm() for _, values in contributions])
    median = norms.median()
    return [(indices, values * torch.clamp(median / (norm + CLIP_EPS), max=1.0))
            for (indices, values), norm in zip(contributions, norms)]


@torch.no_grad()
def aggregate(payloads: Sequence[bytes], codec: Codec, shape: tuple[int, ...], clip: bool = True) -> torch.Tensor:
    """The (optionally clipped) scatter-mean of the peers' payloads for one parameter of ``shape``."""
    return combine(decode_contributions(payloads, codec, tuple(shape)), shape, clip)


@torch.no_grad()
def combine(contributions: Sequence[Contribution], shape: tuple[int, ...], clip: bool = True) -> torch.Tensor:
    """The (optionally clipped) scatter-mean of decoded contributions: ``aggregate`` past decoding,
    and what every member of a networked round computes from the payloads it gathered."""
    if clip and contributions:
        contributions = median_norm_clip(contributions)
    return scatter_mean(list(contributions), tuple(shape))


@torch.no_grad()
def outer_step(phi: torch.Tensor, aggregated: torch.Tensor, outer_lr: float) -> None:
    """φ ← φ − η_out · aggregate, in place."""
    phi.sub_(aggregated.to(phi.device, phi.dtype), alpha=outer_lr)


def compress_all(state: SparseLoCoState, pseudo_gradients: Sequence[torch.Tensor],
                 config: SparseLoCoConfig) -> list[bytes]:
    """The sender's half over a parameter list: one payload per parameter."""
    if len(pseudo_gradients) != len(state.errors):
        raise ValueError(f"{len(pseudo_gradients)} pseudo-gradients for {len(state.errors)} residuals")
    return [compress_pseudo_gradient(e, delta, config.beta, config.codec_for(tuple(e.shape)))
            for e, delta in zip(state.errors, pseudo_gradients)]


def apply_all(phi: Sequence[torch.Tensor], gathered: Sequence[Sequence[bytes]], config: SparseLoCoConfig) -> None:
    """The receiver's half over a parameter list; ``gathered[r]`` is peer r's `compress_all` output."""
    for i, p in enumerate(phi):
        shape = tuple(p.shape)
        aggregated = aggregate([peer[i] for peer in gathered], config.codec_for(shape), shape, config.clip)
        outer_step(p, aggregated, config.outer_lr)
