"""The typed fault plan (runtime.faults) and the one inner step (algorithms.inner) both peers run."""

from __future__ import annotations

import pytest
import torch

from lowcomm.algorithms.inner import InnerConfig, InnerOptimizer, NonFiniteGradient
from lowcomm.runtime.faults import Fault, FaultPlan


def test_a_fault_fires_at_its_round_or_from_it_on():
    once, onwards = FaultPlan.parse("stall-sync@3"), FaultPlan.parse("stall-sync@3+")
    assert [once.at(Fault.STALL_SYNC, r) for r in (2, 3, 4)] == [False, True, False]
    assert [onwards.at(Fault.STALL_SYNC, r) for r in (2, 3, 4)] == [False, True, True]
    assert not once.at(Fault.LATE_ANNOUNCE, 3)
    assert FaultPlan.parse("rebalance@r2") == FaultPlan(Fault.REBALANCE, 2)
    assert str(onwards) == "stall-sync@3+"
    assert FaultPlan.parse(None).kind is None and not FaultPlan.parse("").at(Fault.DRIFT_PHI, 0)


@pytest.mark.parametrize("text", ["stall@3", "stall-sync", "stall-sync@", "drift-phi@x"])
def test_a_malformed_fault_is_refused_with_what_to_write(text):
    with pytest.raises(ValueError, match="fault"):
        FaultPlan.parse(text)


def _param(grad: list[float]) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(len(grad)))
    p.grad = torch.tensor(grad)
    return p


def test_the_lr_warms_up_linearly_and_scales():
    inner = InnerOptimizer([_param([0.0])], InnerConfig(lr=1e-2, warmup_steps=4), lr_scale=2.0)
    assert [inner.lr_at(s) for s in (0, 1, 3, 10)] == pytest.approx([0.5e-2, 1e-2, 2e-2, 2e-2])


def test_clipping_bounds_the_norm_and_reports_it():
    p = _param([3.0, 4.0])
    inner = InnerOptimizer([p], InnerConfig(grad_clip=1.0))
    assert inner.clip() == pytest.approx(1.0)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    unclipped = _param([3.0, 4.0])
    assert InnerOptimizer([unclipped], InnerConfig(grad_clip=0.0)).clip() == pytest.approx(5.0)
    assert unclipped.grad.tolist() == [3.0, 4.0]


def test_a_non_finite_gradient_never_reaches_the_weights():
    p = _param([1.0, float("nan")])
    inner = InnerOptimizer([p], InnerConfig(lr=0.1, warmup_steps=0, weight_decay=0.0))
    with pytest.raises(NonFiniteGradient):
        inner.clip()
    assert p.grad is None
    inner.step(0)
    assert p.detach().tolist() == [1.0, 1.0]
