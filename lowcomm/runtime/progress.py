"""Where a training peer stands: the bookkeeping its parts (state sync, evaluation, the loop) share."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Progress:
    step: int = 0  # inner steps of the global schedule this replica stands at
    steps_done: int = 0  # inner steps this process computed
    tokens_global: int = 0  # tokens in the global model (every contributor's)
    last_members: frozenset[str] = field(default_factory=frozenset)  # of the last round applied
    last_contributors: frozenset[str] = field(default_factory=frozenset)  # of the last round applied: φ's voters
    pending_eval: tuple[int, bool] | None = None  # (tokens added, led a round) since the last evaluation check

    def eval_due(self, tokens: float = 0, leader: bool = False) -> None:
        """A round added ``tokens`` (and this peer led it), or the final evaluation is due (no arguments)."""
        added, led = self.pending_eval or (0, False)
        self.pending_eval = (added + tokens, led or leader)
