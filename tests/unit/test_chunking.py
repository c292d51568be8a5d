"""Block chunking (compress.chunking): flat positions from the cached offset tables, and no table held
for a blocking past the bound (the shapes and chunk sizes come from the wire)."""

from __future__ import annotations

import torch

from lowcomm.compress import chunking
from lowcomm.compress.chunking import Blocking


def flat_by_blocks(blocking: Blocking) -> torch.Tensor:
    """Flat position of every (block, in-block index), straight from the block layout: ``to_blocks`` of
    the tensor of positions."""
    positions = torch.arange(max(1, torch.Size(blocking.shape).numel()), dtype=torch.float64)
    return blocking.to_blocks(positions.reshape(blocking.shape)).to(torch.int64)


def test_flat_indices_name_the_positions_to_blocks_lays_out():
    for shape, s in (((256, 128), 64), ((384,), 64), ((12, 10), 4), ((7, 3, 5), 4), ((97,), 8), ((), 64)):
        blocking = Blocking.of(shape, s)
        expected = flat_by_blocks(blocking)
        local = torch.arange(blocking.block_len).repeat(blocking.num_blocks, 1)
        assert torch.equal(blocking.flat_indices(local), expected.reshape(-1)), shape
        # a few in-block indices per block, in any order, as a payload holds them
        picked = torch.stack([torch.randperm(blocking.block_len)[:2] for _ in range(blocking.num_blocks)]) \
            if blocking.block_len >= 2 else local
        assert torch.equal(blocking.flat_indices(picked), expected.gather(1, picked).reshape(-1)), shape


def test_blockings_with_more_entries_than_the_bound_are_not_held():
    chunking._cached_offsets.cache_clear()
    big = Blocking.of((1 << 17,), 1)  # 2^17 blocks of one entry
    assert torch.equal(big.flat_indices(torch.zeros(big.num_blocks, 1, dtype=torch.int64)),
                       torch.arange(1 << 17))
    assert chunking._cached_offsets.cache_info().currsize == 0
