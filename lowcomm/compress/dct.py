"""Orthonormal DCT-II per block, the transform of DeMo (ALGORITHMS.md §2).

``D[k, i] = sqrt(2/n) · c_k · cos(π (2i + 1) k / 2n)`` with c_0 = 1/√2, so D is
orthogonal and the inverse is Dᵀ. A 2-D block B (c1×c2) maps to D1 · B · D2ᵀ;
this equals ``scipy.fft.dct(·, type=2, norm="ortho")`` along each axis. Blocks
come as rows of ``(num_blocks, block_len)`` from ``Blocking.to_blocks``.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=64)
def _dct_matrix_cpu(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32)


def dct_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The n×n orthonormal DCT-II matrix, float32."""
    return _dct_matrix_cpu(n).to(device)


def block_dct(blocks: torch.Tensor, edges: tuple[int, ...]) -> torch.Tensor:
    """Forward DCT of every row of ``blocks`` seen as a block of ``edges``."""
    return _apply(blocks, edges, inverse=False)


def block_idct(coeffs: torch.Tensor, edges: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``block_dct``."""
    return _apply(coeffs, edges, inverse=True)


def _apply(rows: torch.Tensor, edges: tuple[int, ...], *, inverse: bool) -> torch.Tensor:
    mats = [dct_matrix(e, rows.device) for e in edges]
    if inverse:
        mats = [m.T for m in mats]
    if len(edges) == 1:
        return rows @ mats[0].T
    c1, c2 = edges
    blocks = rows.reshape(-1, c1, c2)
    return torch.matmul(torch.matmul(mats[0], blocks), mats[1].T).reshape(rows.shape)
