"""The owners' robust aggregates (collectives.robust, `diloco.aggregate`) against hostile parts.

Honest parts are a common direction m plus noise; hostile ones are an honest part scaled by 1e6,
or sign-flipped and scaled. Every bound below is one the plain mean breaks by orders of
magnitude, so a rule that stops defending fails here. The in-process runs hold the default
median-norm clip near the plain reference with honest peers, and show one peer sending Δ×1e6
wrecking DiLoCo under `mean` but not under `median-clip`.
"""

from __future__ import annotations

import math
import random

import plain_diloco as plain
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowcomm.algorithms.registry import algorithm
from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.local import LocalCollective, LocalGroup
from lowcomm.collectives.robust import (AGGREGATES, Aggregate, Part, centered_clip, median_clip, trim_count,
                                        trimmed_mean, weighted_mean)
from lowcomm.config import default_config
from lowcomm.data.corpus import load_corpus
from lowcomm.data.loader import evaluate
from lowcomm.models.gpt import GPT
from lowcomm.runtime import in_process
from lowcomm.runtime.in_process import run_in_process
from lowcomm.runtime.trainer import LocalTrainer

DIM = 1000
PARTS = 8


def honest(count: int = PARTS, seed: int = 0, noise: float = 0.1) -> tuple[torch.Tensor, list[Part]]:
    """A common direction m (norm 1) and ``count`` parts m + noise (norm ≈ ``noise``), weights in [100, 300)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(DIM, generator=g)
    m /= m.norm()
    parts = []
    for _ in range(count):
        weight = 100.0 + 200.0 * float(torch.rand(1, generator=g))
        parts.append((m + noise * torch.randn(DIM, generator=g) / math.sqrt(DIM), weight))
    return m, parts


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm())


@pytest.mark.parametrize("name", AGGREGATES)
def test_with_honest_parts_every_aggregate_is_close_to_the_weighted_mean(name):
    _, parts = honest()
    mean = weighted_mean(parts)
    assert distance(Aggregate(name)(parts), mean) < 0.03 * float(mean.norm())  # the parts' noise: 0.1


def test_mean_is_the_plain_weighted_sum_in_sender_order_bit_for_bit():
    _, parts = honest()
    expected = sum(v * w for v, w in parts) / sum(w for _, w in parts)
    assert torch.equal(Aggregate("mean")(parts), expected)
    assert torch.equal(Aggregate()(parts), expected)  # Aggregate's default: defences off


def test_one_part_times_1e6_moves_median_clip_by_at_most_its_clipped_share():
    """Honest parts of norm 1: the median stays 1, so the hostile part (another direction × 1e6) is
    clipped to length 1 and moves the aggregate by at most w/W × (1 + 1) from its honest value. The
    plain mean moves by ~1e6·w/W."""
    g = torch.Generator().manual_seed(1)
    parts = [(v / v.norm(), w) for v, w in ((torch.randn(DIM, generator=g), 100.0 + 50 * i) for i in range(PARTS))]
    hostile = 5
    attacked = list(parts)
    attacked[hostile] = (torch.randn(DIM, generator=g) * 1e6, parts[hostile][1])
    share = parts[hostile][1] / sum(w for _, w in parts)
    clip = Aggregate("median-clip")
    moved = distance(clip(attacked), clip(parts))
    assert moved <= 2 * share + 1e-5
    assert distance(weighted_mean(attacked), weighted_mean(parts)) > 1e5 * share  # without the clip: wrecked
    assert float(clip(attacked).norm()) <= 1.0 + 1e-5  # a weighted mean of parts no longer than the median


@pytest.mark.parametrize("attack", [-1.0, -100.0, 1e6, -1e6])
def test_trimmed_mean_and_centered_clip_bound_a_hostile_minority_of_2_of_8(attack):
    """Parts 2 and 6 send ``attack`` × their honest part. Trimmed mean (f = 0.25: 2 values off each end)
    keeps every coordinate within the honest parts' range; CenteredClip lands within 0.25 of the
    honest mean (‖m‖ = 1; measured 0.16 for the sign flips, whose clipped pull CenteredClip's fixed
    point keeps). The plain mean is 0.48 away for a sign flip alone, 24 for ×−100."""
    m, parts = honest()
    hostile = {2, 6}
    attacked = [(v * attack, w) if i in hostile else (v, w) for i, (v, w) in enumerate(parts)]
    honest_parts = [p for i, p in enumerate(parts) if i not in hostile]
    target = weighted_mean(honest_parts)
    stacked = torch.stack([v for v, _ in honest_parts])

    trimmed = trimmed_mean(attacked, 0.25)
    assert trim_count(PARTS, 0.25) == 2
    assert bool((trimmed >= stacked.min(0).values - 1e-6).all() and (trimmed <= stacked.max(0).values + 1e-6).all())
    assert distance(trimmed, target) < 0.1  # within the honest parts' own noise (0.1 each)

    centered = centered_clip(attacked, 1.0)
    assert distance(centered, target) < 0.25
    assert distance(weighted_mean(attacked), target) > 0.45  # what the defences are measured against
    assert distance(Aggregate("centered-clip")(attacked), centered) == 0.0


def test_trim_keeps_at_least_one_value_and_small_shards_take_the_mean():
    assert [trim_count(n, 0.49) for n in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 2]
    _, parts = honest(count=2)
    assert torch.equal(trimmed_mean(parts, 0.49), weighted_mean(parts))


def test_centered_clip_starts_from_the_median_clipped_mean_and_identical_parts_stay_put():
    v = torch.linspace(-1, 1, DIM)
    parts = [(v.clone(), 1.0 + i) for i in range(4)]
    assert torch.allclose(centered_clip(parts, 1.0), v, atol=1e-6)
    _, parts = honest()
    assert distance(centered_clip(parts, 1.0, iterations=0), weighted_mean(median_clip(parts))) == 0.0


@pytest.mark.parametrize("name", AGGREGATES)
def test_the_owners_reply_does_not_depend_on_arrival_order(name):
    """DenseMean.close sorts by sender: every insertion order of the parts gives the same bytes."""
    combiner = DenseMean("fp32", 1, Aggregate(name))
    _, parts = honest()
    parts[3] = (parts[3][0] * 1e6, parts[3][1])
    senders = [f"peer-{i}" for i in range(PARTS)]
    replies = set()
    for seed in range(5):
        order = list(range(PARTS))
        random.Random(seed).shuffle(order)
        replies.add(combiner.close({senders[i]: parts[i] for i in order}, (0, DIM)))
    assert len(replies) == 1


@settings(max_examples=60, deadline=None)
@given(count=st.integers(2, 9), dim=st.integers(1, 40), scale=st.floats(-1e6, 1e6), seed=st.integers(0, 2**16))
def test_property_one_hostile_part_never_lengthens_the_median_clip_beyond_the_longest_honest_part(
        count, dim, scale, seed):
    """Every clipped part is at most the median norm long, and with one hostile part among ≥ 2 the
    lower median is at most the longest honest norm; the weighted mean of such parts is no longer.
    (The plain mean breaks this for any |scale| large enough.)"""
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(dim, generator=g) * float(torch.rand(1, generator=g) * 3), 1.0 + i) for i in range(count)]
    longest = max(float(v.norm()) for v, _ in parts[1:])
    attacked = [(parts[0][0] * scale, parts[0][1])] + parts[1:]
    assert float(Aggregate("median-clip")(attacked).norm()) <= longest * (1 + 1e-5) + 1e-6


def test_the_registry_gives_diloco_and_streaming_the_configured_aggregate_and_ddp_the_mean():
    config = default_config()
    shapes = [(4, 3), (5,)]
    for name in ("diloco", "streaming-diloco"):
        combiner = algorithm(name).combiner(config, shapes)
        assert isinstance(combiner, DenseMean) and combiner.name == algorithm(name).codec(config)
        assert combiner.aggregate == Aggregate("median-clip", 0.25, 1.0)
    tuned = config.override({"diloco.aggregate": "trimmed-mean", "diloco.trim_fraction": 0.1})
    assert algorithm("diloco").combiner(tuned, shapes).aggregate == Aggregate("trimmed-mean", 0.1, 1.0)
    assert algorithm("ddp").combiner(config, shapes) is None  # the runtime's plain DenseMean


# ---------------------------------------------------------------------- in-process runs
SMALL = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "diloco.codec": "fp32"}
STEPS = 120  # 4 rounds of H = 30
HOSTILE = "peer-3"


def _config(**overrides):
    return default_config().override({**SMALL, "run.steps": STEPS, **overrides})


class _Scaled(LocalCollective):
    """A member that sends its Δ × 1e6 (an honest weight: the owner's weight bound does not catch it)."""

    def start(self, key, round_, payload, weight: float = 1.0, donate: bool = False):
        return super().start(key, round_, payload * 1e6, weight, donate)


class _GroupWithOneHostileMember(LocalGroup):
    def member(self, who):
        me = who if isinstance(who, str) else self.ids[who]
        return _Scaled(self, me) if me == HOSTILE else super().member(who)


@pytest.fixture(scope="module")
def reference_loss():
    tokens = load_corpus(default_config().data).train
    config = _config()
    phi, _ = plain.diloco(lambda: GPT(config.model), tokens, plain.Setup(steps=STEPS))
    return evaluate(phi, LocalTrainer(config, 0, 1, torch.device("cpu")).eval_batches)


def test_with_honest_peers_the_default_median_clip_stays_near_the_plain_reference(reference_loss):
    run = run_in_process(_config(), peers=4)
    assert all(len(r["contributors"]) == 4 for r in run.rounds)
    assert abs(run.final_loss / reference_loss - 1) < 0.01
    assert len({replica.phi_hash() for replica in run.replicas}) == 1


def test_one_peer_sending_delta_times_1e6_wrecks_the_mean(reference_loss, monkeypatch):
    monkeypatch.setattr(in_process, "LocalGroup", _GroupWithOneHostileMember)
    plain_mean = run_in_process(_config(**{"diloco.aggregate": "mean"}), peers=4)
    assert not plain_mean.final_loss < 2 * reference_loss  # NaN or far off


@pytest.mark.parametrize("name", ["median-clip", "trimmed-mean", "centered-clip"])
def test_one_peer_sending_delta_times_1e6_barely_moves_the_robust_aggregates(reference_loss, monkeypatch, name):
    """Measured: 0.3% (median-clip), 0.5% (trimmed-mean, 1 value of 4 off each end), 1.0% (centered-clip)."""
    monkeypatch.setattr(in_process, "LocalGroup", _GroupWithOneHostileMember)
    run = run_in_process(_config(**{"diloco.aggregate": name}), peers=4)
    assert abs(run.final_loss / reference_loss - 1) < 0.02


def test_streaming_diloco_clips_each_fragments_parts_too(monkeypatch):
    """The same Δ×1e6 peer against Streaming DiLoCo (2 fragments): the default clip keeps the honest run's
    loss (measured: 0.1% off), the plain mean does not."""
    config = _config(**{"run.algo": "streaming-diloco", "streaming.codec": "fp32"})
    honest_loss = run_in_process(config, peers=4).final_loss
    monkeypatch.setattr(in_process, "LocalGroup", _GroupWithOneHostileMember)
    assert abs(run_in_process(config, peers=4).final_loss / honest_loss - 1) < 0.02
    plain_mean = run_in_process(config.override({"diloco.aggregate": "mean"}), peers=4)
    assert not plain_mean.final_loss < 2 * honest_loss
