"""The data-parallel baseline: the dense fp32 gradient averaged every step over the same transport.

Every replica applies the same averaged gradient with the same optimizer state, so replicas stay
identical; a joiner therefore receives the optimizer state along with the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowcomm.algorithms.base import PerStepReplica, SyncHooks
from lowcomm.algorithms.state import optimizer_step, tensors_hash
from lowcomm.collectives.base import Collective, GroupKey, RoundResult

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class DdpConfig:
    """The [ddp] section: ddp syncs every step, so its membership is agreed once per epoch of steps."""

    epoch_steps: int = 50


class DataParallel(PerStepReplica):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, collective: Collective, key: GroupKey,
                 tokens_per_step: int = 1, hooks: SyncHooks | None = None):
        super().__init__(model, collective, key, tokens_per_step, hooks)
        self.optimizer = optimizer

    def flat_gradient(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                          .to("cpu", torch.float32) for p in self.model.parameters()])

    def sync(self, round_: int, weight: float, timeout: float | None = None) -> RoundResult:
        """Replaces every local gradient by the agreed mean; the caller then steps the optimizer."""
        result = self.collective.start(self.key, round_, self.flat_gradient(), weight, donate=True).result(timeout)
        offset = 0
        for p in self.model.parameters():
            p.grad = result.aggregate[offset:offset + p.numel()].reshape(p.shape).to(p.device, p.dtype)
            offset += p.numel()
        return result

    def phi_hash(self) -> str:
        return tensors_hash(self.model.parameters())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in zip(self.names, self.model.parameters()):
            out[f"param.{name}"] = p.detach().to("cpu", torch.float32)
            state = self.optimizer.state.get(p, {})
            for k in ADAM_KEYS:
                out[f"adam.{k}.{name}"] = state[k].detach().cpu() if k in state else torch.zeros_like(out[f"param.{name}"])
            out[f"adam.step.{name}"] = torch.tensor([float(state["step"]) if "step" in state else 0.0])
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self.names, self.model.parameters()):
                p.copy_(tensors[f"param.{name}"].to(p.device, p.dtype))
                step = float(tensors[f"adam.step.{name}"][0])
                if step > 0:
                    self.optimizer.state[p] = {
                        "step": optimizer_step(self.optimizer, p, step),
                        **{k: tensors[f"adam.{k}.{name}"].to(p.device, p.dtype).clone() for k in ADAM_KEYS}}
                else:
                    self.optimizer.state.pop(p, None)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for name, p in zip(self.names, self.model.parameters()):
            shapes[f"param.{name}"] = tuple(p.shape)
            for k in ADAM_KEYS:
                shapes[f"adam.{k}.{name}"] = tuple(p.shape)
            shapes[f"adam.step.{name}"] = (1,)
        return shapes
