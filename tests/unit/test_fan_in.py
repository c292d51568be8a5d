"""A bound G on a round's fan-in (sync.max_contributors): the manifest names at most G contributors,
the same on every member, rotating over rounds; the other members receive the aggregate."""

from __future__ import annotations

import pytest

from lowcomm.collectives.manifest import Manifest, bounded_fan_in

MEMBERS = [f"peer{i:02d}" for i in range(7)]


def test_the_bound_is_deterministic_and_independent_of_member_order():
    chosen = bounded_fan_in("run", "0-0", 5, MEMBERS, 3)
    assert len(chosen) == 3 and set(chosen) <= set(MEMBERS) and chosen == sorted(chosen)
    assert bounded_fan_in("run", "0-0", 5, list(reversed(MEMBERS)), 3) == chosen
    assert bounded_fan_in("run", "0-0", 5, MEMBERS, 0) == []  # no bound: everyone
    assert bounded_fan_in("run", "0-0", 5, MEMBERS, 7) == []


def test_every_member_gets_its_turn_over_rounds():
    turns = {m: 0 for m in MEMBERS}
    for round_ in range(40):
        for m in bounded_fan_in("run", "0-0", round_, MEMBERS, 2):
            turns[m] += 1
    assert all(t > 0 for t in turns.values())
    assert sum(turns.values()) == 80


def test_a_manifest_with_a_contributor_outside_its_members_is_rejected():
    raw = Manifest("run", "0-0", 1, 1, "a", ["a", "b"], {"a": "x:1", "b": "x:2"}, ["a", "b"], "fp32", ["c"]).to_dict()
    with pytest.raises(ValueError):
        Manifest.from_dict(raw)
    del raw["contributors"]  # a manifest without the field: every member contributes
    assert Manifest.from_dict(raw).senders == ["a", "b"]
