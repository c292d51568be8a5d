"""lowcomm's production DiLoCo and ddp, run in process, against the plain reference (tests/plain_diloco.py).

The production path (lowcomm.runtime.in_process: the trainers, the registry's replicas, the sharded
reduce's combiner calls) and the reference share nothing but the model class and the token array,
so these tests hold the whole runtime's math (data shards and sampling, the warm-up, the inner
AdamW carried over rounds, token weights, the outer Nesterov step, φ evaluated after the last full
round) to the setup. A smaller model than the default keeps them to seconds.

Tolerances: with the fp32 codec the two differ only by the order of float sums (a weighted mean
against a plain one): 4e-6 in the weights after 3 rounds, 4e-4 to 5e-4 after 8, and no difference
in the held-out loss to 1e-6. WEIGHT_TOL = 2e-3 and LOSS_TOL = 1e-4 hold that with margin, while a
one-step shift of the warm-up (1e-2 in the weights), an outer momentum of 0.89 instead of 0.9
(1.2e-2, 6e-4 in the loss), another sampler (0.12) or a fresh AdamW every round (0.28, 2% in the
loss) is far outside them. The uint8 codec is lossy by design: its final loss stays within 1%.
The reference takes the plain mean, so these runs set `diloco.aggregate = "mean"` (the default
median-norm clip is held near the reference in test_robust_aggregate.py).
"""

from __future__ import annotations

import plain_diloco as plain
import pytest
import torch

from lowcomm.config import default_config
from lowcomm.data.corpus import load_corpus
from lowcomm.data.loader import evaluate
from lowcomm.models.gpt import GPT
from lowcomm.runtime.in_process import run_in_process

SMALL = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2}
STEPS = 240  # 8 rounds of H = 30
WEIGHT_TOL = 2e-3
LOSS_TOL = 1e-4


@pytest.fixture(scope="module")
def tokens():
    return load_corpus(default_config().data).train


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _config(**overrides):
    return default_config().override({**SMALL, "run.steps": STEPS, **overrides})


@pytest.fixture(scope="module")
def reference(tokens):
    config = _config()
    phi, _ = plain.diloco(lambda: GPT(config.model), tokens, plain.Setup(steps=STEPS))
    return phi


def test_production_diloco_fp32_is_the_reference(reference):
    run = run_in_process(_config(**{"diloco.codec": "fp32", "diloco.aggregate": "mean"}), peers=4)
    assert [r["round"] for r in run.rounds] == list(range(STEPS // 30))
    assert all(len(r["contributors"]) == 4 for r in run.rounds)
    with run.replicas[0].global_model() as model:
        assert _max_diff(model, reference) < WEIGHT_TOL
    assert abs(run.final_loss / evaluate(reference, run.trainers[0].eval_batches) - 1) < LOSS_TOL
    for replica in run.replicas[1:]:  # every peer holds the same φ
        assert replica.phi_hash() == run.replicas[0].phi_hash()


def test_the_reference_is_sensitive_to_each_factor(tokens, reference):
    """The tolerance separates: a warm-up one step longer, the smallest change measured, is outside it."""
    config = _config()
    phi, _ = plain.diloco(lambda: GPT(config.model), tokens, plain.Setup(steps=STEPS, warmup=51))
    assert _max_diff(phi, reference) > 4 * WEIGHT_TOL


def test_production_diloco_uint8_stays_near_the_reference(reference):
    run = run_in_process(_config(**{"diloco.aggregate": "mean"}), peers=4)  # the default codec: uint8
    with run.replicas[0].global_model() as model:
        ref_loss = evaluate(reference, run.trainers[0].eval_batches)
        assert abs(run.final_loss / ref_loss - 1) < 0.01
        assert _max_diff(model, reference) > WEIGHT_TOL  # lossy: it does differ


def test_production_ddp_is_the_reference(tokens):
    config = _config(**{"run.algo": "ddp", "run.steps": 60})
    run = run_in_process(config, peers=4)
    ref = plain.ddp(lambda: GPT(config.model), tokens, plain.Setup(steps=60))
    with run.replicas[0].global_model() as model:
        assert _max_diff(model, ref) < WEIGHT_TOL
