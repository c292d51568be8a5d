"""A training peer's held-out evaluations of the global model.

The leader of a round evaluates whenever the run's global tokens cross a multiple of
`data.eval_every_tokens`; every peer evaluates once at the end. The model is scored with the
replica's global parameters in it (Streaming DiLoCo and the overlap hold a live θ apart from φ).
"""

from __future__ import annotations

from lowcomm.algorithms.base import Replica
from lowcomm.runtime.progress import Progress
from lowcomm.runtime.runlog import RunLog


class Evaluation:
    def __init__(self, evaluate, replica: Replica, progress: Progress, log: RunLog, every_tokens: int,
                 total_steps: int):
        self.evaluate = evaluate  # () -> held-out loss of the model as it is
        self.replica, self.progress, self.log = replica, progress, log
        self.every_tokens, self.total_steps = every_tokens, total_steps
        self.last_loss: float | None = None  # of the latest evaluation this peer ran

    def run_due(self) -> None:
        """Evaluates if the rounds since the last check crossed the interval (as their leader), or at the end."""
        if self.progress.pending_eval is None:
            return
        added, led = self.progress.pending_eval
        self.progress.pending_eval = None
        p, every = self.progress, self.every_tokens
        final = p.step >= self.total_steps
        crossed = p.tokens_global // every != (p.tokens_global - added) // every
        if final or (led and crossed):
            with self.replica.global_model():
                loss = self.evaluate()
            self.last_loss = loss
            self.log.write("eval", round=self.replica.round, step=p.step, tokens=p.tokens_global, loss=loss,
                           final=final, phi_hash=self.replica.phi_hash())
