"""The [pipeline] section: the model cut into stages served by changing sets of peers (ALGORITHMS.md §5-§6)."""

from __future__ import annotations

from dataclasses import dataclass

RECOVERIES = ("checkfree", "checkpoint")
STAGE_SYNC_ALGOS = ("diloco", "sparseloco")  # how a stage's replicas sync with each other


@dataclass
class PipelineConfig:
    stages: int = 1  # S > 1: pipeline mode (`simulate --stages`); must divide model.n_layers
    round_s: float = 15.0  # a stage's replicas sync every round_s seconds of DHT time (weighted by steps)
    checkfree_plus: bool = True  # S >= 4: swap the end stages' blocks on odd microbatches, replicate embed/head
    recovery: str = "checkfree"  # checkfree | checkpoint (the restart baseline: every stage back to its checkpoint)
    checkpoint_every_rounds: int = 0  # K > 0: every K rounds each stage's leader writes the stage (run_stage_checkpoints)
    hop_timeout_s: float = 30.0  # one forward or backward call; a timeout retries on another replica
    stage_wait_s: float = 180.0  # how long a driver waits for a stage with no replica before dropping a microbatch
    rebalance_every_rounds: int = 2  # a rebalancing check after every such round (0: only the test hook)
    hysteresis: float = 0.1  # a move must lift the weaker of its two stages above (1 + this) x the target's total

    @property
    def replicate_ends(self) -> bool:
        return self.checkfree_plus and self.stages >= 4
