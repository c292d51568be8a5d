"""Block chunking shared by the sparse codecs (ALGORITHMS.md §2 and §3).

Each dimension n is cut by its largest divisor ≤ s (``chunk_edge``), so a 2-D
tensor becomes a grid of c1×c2 blocks and a 1-D tensor a row of c-element
chunks. Tensors of 3 or more dimensions are viewed as 2-D ``(shape[0], rest)``
and a 0-D tensor as one element; neither reference defines them, and this keeps
every tensor on the 1-D or 2-D rules. ``to_blocks`` lays each block out as one
row (row-major inside the block), which is the order top-k indices refer to.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


def chunk_edge(n: int, s: int) -> int:
    """Largest divisor of ``n`` that is ≤ ``s`` (1 for n = 0)."""
    if n <= 0:
        return 1
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for divisor in (d, n // d):
                if best < divisor <= s:
                    best = divisor
    return best


@dataclass(frozen=True)
class Blocking:
    """How a tensor of ``shape`` is cut: its 1-D or 2-D view and the block edges."""

    shape: tuple[int, ...]
    view: tuple[int, ...]  # (n,) or (rows, cols)
    edges: tuple[int, ...]  # one edge per view dimension

    @classmethod
    def of(cls, shape: tuple[int, ...], s: int) -> Blocking:
        return _blocking(tuple(shape), s)

    @classmethod
    def _build(cls, shape: tuple[int, ...], s: int) -> Blocking:
        if len(shape) == 0:
            view: tuple[int, ...] = (1,)
        elif len(shape) <= 2:
            view = tuple(shape)
        else:
            view = (shape[0], math.prod(shape[1:]))
        return cls(tuple(shape), view, tuple(chunk_edge(n, s) for n in view))

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        return tuple(n // e for n, e in zip(self.view, self.edges))

    @functools.cached_property
    def num_blocks(self) -> int:
        return math.prod(self.grid) if math.prod(self.view) else 0

    @functools.cached_property
    def block_len(self) -> int:
        return math.prod(self.edges)

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``(num_blocks, block_len)`` copy of ``x``, one block per row."""
        if len(self.view) == 1:
            return x.reshape(self.num_blocks, self.block_len)
        (g1, g2), (c1, c2) = self.grid, self.edges
        return x.reshape(g1, c1, g2, c2).permute(0, 2, 1, 3).reshape(self.num_blocks, self.block_len)

    def from_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Inverse of ``to_blocks``: a tensor of ``shape``."""
        if len(self.view) == 1:
            return blocks.reshape(self.shape)
        (g1, g2), (c1, c2) = self.grid, self.edges
        return blocks.reshape(g1, g2, c1, c2).permute(0, 2, 1, 3).reshape(self.shape)

    def flat_indices(self, local: torch.Tensor) -> torch.Tensor:
        """Flat positions in the whole tensor of per-block indices ``local`` (num_blocks, k)."""
        local = local.to(torch.int64)
        if self.num_blocks + self.block_len <= _MAX_CACHED_OFFSETS:
            starts, offsets = _cached_offsets(self)
            return (starts + offsets[local]).reshape(-1)
        # a large blocking: work in proportion to the indices sent, not to the blocks a sender declared
        block = torch.arange(self.num_blocks, dtype=torch.int64).unsqueeze(1)
        if len(self.view) == 1:
            return (block * self.block_len + local).reshape(-1)
        (_, g2), (c1, c2) = self.grid, self.edges
        rows = (block // g2) * c1 + local // c2
        cols = (block % g2) * c2 + local % c2
        return (rows * self.view[1] + cols).reshape(-1)


# Blockings are small and a decoder meets the same few shapes every round; the shapes and chunk come
# from the wire, so both caches are bounded, and offset tables only of blockings up to 2^16 entries
# (at most 64 × 512 KiB held, whatever a sender declares).
_MAX_CACHED_OFFSETS = 1 << 16


@functools.lru_cache(maxsize=1024)
def _blocking(shape: tuple[int, ...], s: int) -> Blocking:
    return Blocking._build(shape, s)


@functools.lru_cache(maxsize=64)
def _cached_offsets(blocking: Blocking) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat position of each block's first entry, as a column; flat offset of each in-block index
    from it): a flat position is their sum."""
    block = torch.arange(blocking.num_blocks, dtype=torch.int64).unsqueeze(1)
    local = torch.arange(blocking.block_len, dtype=torch.int64)
    if len(blocking.view) == 1:
        return block * blocking.block_len, local
    (_, g2), (c1, c2) = blocking.grid, blocking.edges
    cols = blocking.view[1]
    return (block // g2) * c1 * cols + (block % g2) * c2, (local // c2) * cols + local % c2

