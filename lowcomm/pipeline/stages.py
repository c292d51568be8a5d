"""The model cut into S contiguous pipeline stages, and the order a microbatch visits them.

Every stage holds n_layers / S transformer blocks (so neighbouring stages have identical shapes,
which CheckFree needs); stage 0 also holds the embedding and stage S−1 the head (ALGORITHMS.md §6).
With `replicate_ends` (CheckFree+, S ≥ 4) stage 1 holds a replica of the embedding and stage S−2
one of the head, and odd microbatches run the blocks of stages 0↔1 and S−2↔S−1 in swapped order:
the first hop (stage 1) then runs its embedding replica, the last hop (stage S−2) its head replica,
so each end stage's neighbour learns to stand in for it.

Parameter names are local to the stage (`blocks.0.…`, `embed.…`, `head.…`), so a stage's tensors
line up name for name with its neighbour's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowcomm.models.gpt import GPT, Block, Embedding, Head, ModelConfig


@dataclass(frozen=True)
class Hop:
    stage: int
    embed: bool  # the hop starts with the embedding (its input is token ids)
    head: bool  # the hop ends with the head (the loss is computed there)


def blocks_of(stage: int, stages: int, n_layers: int) -> range:
    if stages < 1 or n_layers % stages:
        raise ValueError(f"model.n_layers = {n_layers} cannot be cut into {stages} stages of equal size; "
                         "pick pipeline.stages dividing n_layers")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")
    per = n_layers // stages
    return range(stage * per, (stage + 1) * per)


def hop_order(stages: int, microbatch: int, swap_ends: bool) -> list[Hop]:
    """The stages a microbatch visits, in order: 0..S−1, or with CheckFree+ on odd microbatches 1,0,…,S−1,S−2."""
    order = list(range(stages))
    if swap_ends and microbatch % 2 == 1:
        order[0], order[1] = order[1], order[0]
        order[-1], order[-2] = order[-2], order[-1]
    return [Hop(s, embed=i == 0, head=i == stages - 1) for i, s in enumerate(order)]


def holds_embedding(stage: int, stages: int, replicate_ends: bool) -> bool:
    return stage == 0 or (replicate_ends and stage == 1)


def holds_head(stage: int, stages: int, replicate_ends: bool) -> bool:
    return stage == stages - 1 or (replicate_ends and stage == stages - 2)


class StageModule(nn.Module):
    """One stage's blocks, with the embedding and/or head it holds (replicas included)."""

    def __init__(self, config: ModelConfig, stage: int, stages: int, replicate_ends: bool):
        super().__init__()
        self.stage, self.stages = stage, stages
        self.embed = Embedding(config) if holds_embedding(stage, stages, replicate_ends) else None
        self.blocks = nn.ModuleList(Block(config) for _ in blocks_of(stage, stages, config.n_layers))
        self.head = Head(config) if holds_head(stage, stages, replicate_ends) else None

    @classmethod
    def from_model(cls, model: GPT, stage: int, stages: int, replicate_ends: bool) -> "StageModule":
        """Stage `stage` of a whole model, weights copied (replicas get the same weights as the original)."""
        module = cls(model.config, stage, stages, replicate_ends)
        with torch.no_grad():
            if module.embed is not None:
                module.embed.load_state_dict(model.embed.state_dict())
            for local, index in zip(module.blocks, blocks_of(stage, stages, model.config.n_layers)):
                local.load_state_dict(model.blocks[index].state_dict())
            if module.head is not None:
                module.head.load_state_dict(model.head.state_dict())
        return module

    def forward(self, x: torch.Tensor, embed: bool, head: bool) -> torch.Tensor:
        if embed:
            if self.embed is None:
                raise ValueError(f"stage {self.stage} holds no embedding")
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if head:
            if self.head is None:
                raise ValueError(f"stage {self.stage} holds no head")
            x = self.head(x)
        return x

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.named_parameters()}


def initial_stage(config: ModelConfig, seed: int, stage: int, stages: int, replicate_ends: bool) -> StageModule:
    """φ_0 of a stage: the stage's slice of the whole model every peer builds from the run's seed."""
    torch.manual_seed(seed)
    return StageModule.from_model(GPT(config), stage, stages, replicate_ends)
