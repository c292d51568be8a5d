"""all_finite: exact where torch.isfinite(x).all() is, in one pass for the common case."""

from __future__ import annotations

import pytest
import torch

from lowcomm.compress.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 777, 262143])
def test_a_non_finite_entry_anywhere_is_found(dtype, bad, at):
    values = torch.randn(262144, generator=torch.Generator().manual_seed(at)).to(dtype)
    assert all_finite(values)
    values[at] = bad
    assert not all_finite(values) and not bool(torch.isfinite(values).all())


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((1000,), torch.finfo(torch.float32).max)
    assert not torch.isfinite(big.sum())  # the one-pass answer is inconclusive here ...
    assert all_finite(big)  # ... and the entries are checked one by one
    big[500] = float("inf")
    assert not all_finite(big)


def test_an_infinity_of_each_sign_is_not_finite():
    values = torch.zeros(10)
    values[2], values[7] = float("inf"), float("-inf")  # their sum is NaN
    assert not all_finite(values)


def test_empty_integer_and_boolean_tensors_are_finite():
    assert all_finite(torch.empty(0)) and all_finite(torch.arange(5)) and all_finite(torch.ones(3, dtype=torch.bool))
