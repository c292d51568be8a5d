"""DeMo, decoupled momentum (ALGORITHMS.md §2): one optimizer step per parameter, in two halves.

    p ← p·(1 − ηλ)                            # decoupled weight decay
    δ ← β·δ + η·g                             # lr folded into the residual δ
    C = DCT_chunks(δ); (idx, val) = top-k per chunk of |C|
    δ ← δ − IDCT(scatter(idx, val))           # error feedback: subtract what is transmitted
    U = IDCT(scatter-mean over workers of (idx, val))
    p ← p − η·sign(U)                         # the lr applies twice: keep it

`compress_residual` is the sender's half (δ update, payload, error feedback) and `apply_payloads`
the receiver's (scatter-mean of every worker's payload, decay, sign step); the transport
all-gathers the payloads between them. Weight decay sits in the second half: p is not read in
between, so the result equals the reference order, and the first half never touches p.
The transform and top-k are the ``dct-topk`` codec; in 1-bit ``sign`` mode the payload carries
signs and error feedback subtracts the unquantized selected component (Psyche), which the codec's
``encode_with_transmitted`` already returns. State: one residual δ per parameter (`DemoState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowcomm.algorithms.payloads import Contribution, decode_contributions
from lowcomm.compress import SparseCodec, get_codec, scatter_mean


# while step t's U travels, the model holds the shared parameters ("late", Psyche's) or runs ahead of
# them by the replica's own update −η·sign(transmitted_t) ("eager"), taken back when U_t lands
OVERLAP_UPDATES = ("eager", "late")


@dataclass
class DemoConfig:
    lr: float = 1e-3  # η; ALGORITHMS.md fixes none: lowcomm's default for the reference model
    beta: float = 0.999  # compression_decay
    topk: int = 32  # compression_topk, per chunk
    chunk: int = 64  # compression_chunk s: chunk edge = largest divisor of each dimension ≤ s
    weight_decay: float = 0.0  # λ
    sign: bool = False  # 1-bit values on the wire (Psyche production)
    overlap: bool = False  # each step's update lands one step late (demo_replica: Psyche production)
    overlap_update: str = "eager"  # one of OVERLAP_UPDATES: what the model holds while a step's U travels
    zero_band: float = 0.0  # |U| ≤ zero_band·max|mean coefficient| counts as 0 (see aggregate_update)

    def codec(self) -> SparseCodec:
        return get_codec("dct-topk", k=self.topk, chunk=self.chunk, sign=self.sign)


@dataclass
class DemoState:
    """The residuals δ, one per parameter, float32 like the parameters they shadow."""

    deltas: list[torch.Tensor]

    @classmethod
    def zeros_like(cls, params: Sequence[torch.Tensor]) -> DemoState:
        return cls([torch.zeros_like(p, dtype=torch.float32) for p in params])


@torch.no_grad()
def compress_residual(delta: torch.Tensor, grad: torch.Tensor, config: DemoConfig, codec: SparseCodec,
                      transmitted_out: list | None = None) -> bytes:
    """δ ← βδ + ηg, returns the payload of δ's top-k DCT coefficients and removes them from δ (in place)."""
    if config.beta != 1:
        delta.mul_(config.beta)
    delta.add_(grad.to(delta.dtype), alpha=config.lr)
    payload, transmitted = codec.encode_with_transmitted(delta)
    delta.sub_(transmitted.to(delta.device))
    if transmitted_out is not None:
        transmitted_out.append(transmitted)
    return payload


@torch.no_grad()
def aggregate_update(payloads: Sequence[bytes], codec: SparseCodec, shape: tuple[int, ...],
                     zero_band: float = 0.0) -> torch.Tensor:
    """U = IDCT(scatter-mean of the workers' coefficients): mean over the workers that sent each one.

    With 1-bit values the mean coefficients are multiples of 1/R, and their inverse DCT is often
    exactly 0 in exact arithmetic (cosines cancel); the float result is then rounding noise whose
    sign depends on the kernel, so replicas on different hardware could step apart. A positive
    ``zero_band`` snaps those to 0 (no step there); 0 keeps the reference's plain sign.
    """
    return combine(decode_contributions(payloads, codec, tuple(shape)), codec, shape, zero_band)


@torch.no_grad()
def combine(contributions: Sequence[Contribution], codec: SparseCodec, shape: tuple[int, ...],
            zero_band: float = 0.0) -> torch.Tensor:
    """U from decoded contributions: ``aggregate_update`` past decoding, and what every member of a
    networked round computes from the payloads it gathered (see ``aggregate_update``)."""
    coeffs = scatter_mean(list(contributions), tuple(shape))
    update = codec.inverse(coeffs)
    if zero_band > 0 and coeffs.numel():
        update[update.abs() <= zero_band * coeffs.abs().max()] = 0.0
    return update


@torch.no_grad()
def apply_update(param: torch.Tensor, update: torch.Tensor, config: DemoConfig) -> None:
    """p ← p·(1 − ηλ) − η·sign(U), in place (sign(0) = 0: an untouched coordinate only decays)."""
    if config.weight_decay != 0:
        param.mul_(1.0 - config.lr * config.weight_decay)
    param.add_(update.to(param.device, param.dtype).sign(), alpha=-config.lr)


def apply_payloads(param: torch.Tensor, payloads: Sequence[bytes], config: DemoConfig,
                   codec: SparseCodec) -> torch.Tensor:
    """The receiver's half for one parameter; returns U (for logging or tests)."""
    update = aggregate_update(payloads, codec, tuple(param.shape), config.zero_band)
    apply_update(param, update, config)
    return update


def compress_all(state: DemoState, grads: Sequence[torch.Tensor], config: DemoConfig,
                 codec: SparseCodec, transmitted: list | None = None) -> list[bytes]:
    """The sender's half over a parameter list: one payload per parameter; ``transmitted``, where
    given, receives what each payload removed from its residual."""
    if len(grads) != len(state.deltas):
        raise ValueError(f"{len(grads)} gradients for {len(state.deltas)} residuals")
    return [compress_residual(delta, grad, config, codec, transmitted) for delta, grad in zip(state.deltas, grads)]


def apply_all(params: Sequence[torch.Tensor], gathered: Sequence[Sequence[bytes]], config: DemoConfig,
              codec: SparseCodec) -> None:
    """The receiver's half over a parameter list; ``gathered[w]`` is worker w's `compress_all` output."""
    for i, param in enumerate(params):
        apply_payloads(param, [worker[i] for worker in gathered], config, codec)
