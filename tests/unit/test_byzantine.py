"""Byzantine members (runtime.byzantine): each kind's transform, the wrapper around a collective,
the `KIND:N` spec, the algorithms each kind applies to, and the report's honest-only final loss."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import LocalGroup
from lowcomm.config import ConfigError
from lowcomm.runtime.byzantine import (LARGE, SCALE, WEIGHT_FACTOR, Attack, ByzantineCollective, Kind,
                                       check_supported, parse_byzantine)
from lowcomm.runtime.report import build_report

KEY = GroupKey("byzantine-test")


def delta(seed: int = 0, n: int = 1000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def tamper(kind: Kind, payload, weight: float = 64.0, round_: int = 3, member: str = "peer-a"):
    return Attack(kind, member).tamper(round_, payload, weight)


# ---- the transforms -----------------------------------------------------------------------------

def test_sign_flip_sends_minus_ten_delta_with_its_weight():
    d = delta()
    sent, weight, tampered = tamper(Kind.SIGN_FLIP, d)
    assert tampered and weight == 64.0
    assert torch.allclose(sent, -LARGE * d)


def test_scale_multiplies_by_a_million():
    d = delta()
    sent, weight, _ = tamper(Kind.SCALE, d)
    assert torch.allclose(sent, d * SCALE) and weight == 64.0


def test_noise_is_gaussian_of_ten_times_the_norm_and_carries_no_delta():
    d = delta()
    sent, _, _ = tamper(Kind.NOISE, d)
    assert math.isclose(float(sent.norm()), LARGE * float(d.norm()), rel_tol=1e-5)
    cosine = float(sent @ d) / float(sent.norm() * d.norm())
    assert abs(cosine) < 0.15  # independent of Δ
    assert abs(float(sent.mean())) < 0.1 * float(sent.std())  # centred
    again, _, _ = tamper(Kind.NOISE, d)  # the same member and round draw the same noise
    other_round, _, _ = tamper(Kind.NOISE, d, round_=4)
    other_member, _, _ = tamper(Kind.NOISE, d, member="peer-b")
    assert torch.equal(sent, again)
    assert not torch.equal(sent, other_round) and not torch.equal(sent, other_member)


def test_constant_points_every_member_the_same_way():
    a, _, _ = tamper(Kind.CONSTANT, delta(1), member="peer-a", round_=1)
    b, _, _ = tamper(Kind.CONSTANT, delta(2), member="peer-b", round_=7)
    assert math.isclose(float(a.norm()), LARGE * float(delta(1).norm()), rel_tol=1e-5)
    cosine = float(a @ b) / float(a.norm() * b.norm())
    assert cosine > 1 - 1e-6  # one direction for the colluders, whatever their Δ or round


def test_noise_and_constant_of_a_zero_delta_are_not_zero():
    for kind in (Kind.NOISE, Kind.CONSTANT):
        sent, _, _ = tamper(kind, torch.zeros(100))
        assert math.isclose(float(sent.norm()), LARGE, rel_tol=1e-5)


def test_nan_sends_only_nan():
    sent, weight, tampered = tamper(Kind.NAN, delta())
    assert tampered and weight == 64.0 and bool(torch.isnan(sent).all())


def test_inflate_weight_keeps_the_payload_and_claims_a_thousandfold_weight():
    d = delta()
    sent, weight, tampered = tamper(Kind.INFLATE_WEIGHT, d)
    assert tampered and sent is d and weight == 64.0 * WEIGHT_FACTOR
    blobs = [b"a", b"bc"]  # encoded parts pass untouched
    sent, weight, _ = tamper(Kind.INFLATE_WEIGHT, blobs)
    assert sent is blobs and weight == 64.0 * WEIGHT_FACTOR


def test_copy_sends_the_last_aggregate_received_and_zeros_before_any():
    attack = Attack(Kind.COPY)
    sent, weight, tampered = attack.tamper(0, delta(0), 64.0)
    assert tampered and weight == 64.0 and torch.equal(sent, torch.zeros(1000))
    aggregate = delta(5)
    attack.received(aggregate)
    sent, _, _ = attack.tamper(1, delta(1), 64.0)
    assert torch.equal(sent, aggregate)
    attack.received(delta(6, n=10))  # another length (a Streaming DiLoCo fragment) is kept apart
    sent, _, _ = attack.tamper(2, delta(2), 64.0)
    assert torch.equal(sent, aggregate)


def test_replay_resends_the_previous_rounds_honest_part():
    attack = Attack(Kind.REPLAY)
    first, second = delta(0), delta(1)
    sent, _, tampered = attack.tamper(0, first, 64.0)
    assert not tampered and sent is first  # nothing to replay yet
    sent, weight, tampered = attack.tamper(1, second, 32.0)
    assert tampered and sent is first and weight == 32.0
    sent, _, _ = attack.tamper(2, delta(2), 64.0)
    assert sent is second  # the honest part of round 1, not what was sent in it
    blobs0, blobs1 = [b"r0"], [b"r1"]
    attack.tamper(3, blobs0, 1.0)
    assert attack.tamper(4, blobs1, 1.0)[0] is blobs0  # encoded parts replay as well


def test_value_kinds_refuse_encoded_parts():
    with pytest.raises(ConfigError, match="dense payload"):
        tamper(Kind.SIGN_FLIP, [b"blob"])


# ---- the wrapper ---------------------------------------------------------------------------------

def test_the_wrapper_lies_on_the_wire_logs_each_round_and_watches_the_aggregate():
    group = LocalGroup(3, timeout_s=10.0)
    events = []
    liar = ByzantineCollective(group.member(2), Attack(Kind.SIGN_FLIP, "peer-2"),
                               on_event=lambda kind, **fields: events.append((kind, fields)))
    members = [group.member(0), group.member(1), liar]
    assert liar.me == "peer-2"
    stalls = []
    liar.before_send = stalls.append  # lands on the wrapped collective
    assert group.member(2).before_send is None and liar.inner.before_send == stalls.append
    payloads = [torch.ones(6), torch.ones(6), torch.ones(6)]
    handles = [m.start(KEY, 0, p, 1.0) for m, p in zip(members, payloads)]
    results = [h.result(10.0) for h in handles]
    for r in results:  # (1 + 1 − 10) / 3 on every member, the liar included
        assert torch.allclose(r.aggregate, torch.full((6,), -8 / 3))
    assert torch.equal(payloads[2], torch.ones(6))  # the caller's honest Δ is untouched
    assert stalls == [0]
    assert [kind for kind, _ in events] == ["byzantine"]
    fields = events[0][1]
    assert fields["round"] == 0 and fields["byzantine"] == "sign-flip" and fields["sent_weight"] == 1.0
    assert math.isclose(fields["sent_norm"], LARGE * fields["norm"], rel_tol=1e-6)


def test_a_copying_member_sends_the_aggregate_it_was_given():
    group = LocalGroup(2, timeout_s=10.0)
    copier = ByzantineCollective(group.member(1), Attack(Kind.COPY, "peer-1"))
    honest = group.member(0)
    for round_, value in enumerate((2.0, 4.0)):
        handles = [honest.start(KEY, round_, torch.full((4,), value), 1.0),
                   copier.start(KEY, round_, torch.full((4,), 100.0), 1.0)]
        results = [h.result(10.0) for h in handles]
    # round 0: (2 + 0) / 2 = 1; round 1: the copier sends round 0's aggregate, (4 + 1) / 2
    assert torch.allclose(results[0].aggregate, torch.full((4,), 2.5))


# ---- specs and combinations ----------------------------------------------------------------------

def test_parse_byzantine_takes_the_last_indices():
    assert parse_byzantine("scale:1,sign-flip:2", 8) == {7: Kind.SCALE, 6: Kind.SIGN_FLIP, 5: Kind.SIGN_FLIP}
    assert parse_byzantine(None, 4) == {} and parse_byzantine("none", 4) == {}
    for bad, message in (("scale", "KIND:N"), ("scale:0", "KIND:N"), ("bogus:1", "unknown Byzantine kind"),
                         ("scale:4", "no honest one")):
        with pytest.raises(ConfigError, match=message):
            parse_byzantine(bad, 4)


def test_value_kinds_need_a_dense_algorithm():
    for algo in ("ddp", "diloco", "streaming-diloco"):
        for kind in Kind:
            check_supported(kind, algo)
    for algo in ("sparseloco", "demo", "noloco"):
        check_supported(Kind.REPLAY, algo)
        check_supported(Kind.INFLATE_WEIGHT, algo)
        with pytest.raises(ConfigError, match="inflate-weight or replay"):
            check_supported(Kind.SCALE, algo)
    with pytest.raises(ConfigError, match="pipelined"):
        check_supported(Kind.REPLAY, "diloco", pipelined=True)


# ---- the report ----------------------------------------------------------------------------------

def _records() -> list[dict]:
    records = []
    for i, (peer, byzantine, loss) in enumerate((("a", None, 2.0), ("b", None, 2.2), ("c", "scale", 9.0))):
        records.append({"type": "event", "kind": "start", "peer": peer, "t": 0.0, "data_shard": i,
                        "byzantine": byzantine})
        records.append({"type": "compute", "peer": peer, "t": 1.0, "steps": 10, "tokens": 100, "compute_s": 1.0,
                        "first_step_t": 1.0, "last_step_t": 5.0})
        records.append({"type": "eval", "peer": peer, "t": 5.0, "round": 3, "step": 10, "tokens": 300,
                        "loss": loss, "final": True})
    return records


def test_the_report_names_the_byzantine_members_and_keeps_their_loss_apart():
    report = build_report(_records(), algo="diloco", peers=3, seed=0, model_params=1, started_at=0.0)
    assert report["byzantine"] == [{"peer": "c", "kind": "scale", "index": 2}]
    assert math.isclose(report["final_loss"], 2.1) and report["final_loss_honest"] == report["final_loss"]
    assert math.isclose(report["final_loss_spread"], 0.2)
    assert report["final_loss_byzantine"] == 9.0


def test_without_byzantine_members_the_final_loss_is_everyones():
    records = [r for r in _records() if r["peer"] != "c"]
    report = build_report(records, algo="diloco", peers=2, seed=0, model_params=1, started_at=0.0)
    assert report["byzantine"] == [] and report["final_loss_byzantine"] is None
    assert math.isclose(report["final_loss"], 2.1)
