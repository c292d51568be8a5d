"""Golden trajectories for the algorithm tests: JSON fixtures under tests/fixtures/, rewritten only
when LOWCOMM_REGEN_FIXTURES=1 (as torchft's golden tests); otherwise the stored file is the truth."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VECTORS = Path(__file__).resolve().parents[2] / "shared" / "vectors"  # ../shared beside the checkout
REGEN_FLAG = "LOWCOMM_REGEN_FIXTURES"


def golden(name: str, produce: Callable[[], dict]) -> dict:
    """The fixture ``name``: ``produce()`` written to disk under the flag, else the stored JSON."""
    path = FIXTURES / f"{name}.json"
    if os.environ.get(REGEN_FLAG) == "1":
        data = produce()
        FIXTURES.mkdir(exist_ok=True)
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        return json.loads(path.read_text())
    if not path.exists():
        pytest.fail(f"{path} is missing: regenerate it with {REGEN_FLAG}=1 and commit it")
    return json.loads(path.read_text())


def tensor(data) -> torch.Tensor:
    return torch.tensor(data, dtype=torch.float32)


def tolist(t) -> list:
    return (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)).astype(np.float32).tolist()


def random_inputs(seed: int, shape, scale: float = 1.0) -> list:
    g = torch.Generator().manual_seed(seed)
    return tolist(torch.randn(*shape, generator=g) * scale)


def assert_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6, msg: str = "") -> None:
    np.testing.assert_allclose(np.asarray(tolist(actual)), np.asarray(expected, dtype=np.float32),
                               rtol=rtol, atol=atol, err_msg=msg)


def demo_reference() -> tuple[dict, dict]:
    """shared/vectors/demo_reference.json (bloc97/DeMo's own optimizer) and the DemoConfig fields of its hyper-parameters."""
    path = VECTORS / "demo_reference.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: the shared/ folder must sit beside the checkout (see README)")
    ref = json.loads(path.read_text())
    hyper = ref["hyper"]
    return ref, {"lr": hyper["lr"], "beta": hyper["compression_decay"], "topk": hyper["compression_topk"],
                 "chunk": hyper["compression_chunk"], "weight_decay": hyper["weight_decay"]}
