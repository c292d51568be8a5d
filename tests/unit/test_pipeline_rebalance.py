import itertools
import random
from dataclasses import replace

import pytest

from lowcomm.pipeline.rebalance import (
    Placement,
    best_static_assignment,
    joiner_stage,
    pipeline_throughput,
    plan_move,
    rebalance_until_stable,
    should_move,
    stage_throughputs,
)


def place(*stages: dict[str, float]) -> list[Placement]:
    """place({"a": 1.0}, {"b": 2.0}): peer a serves stage 0 at 1 task/s, b stage 1 at 2."""
    return [Placement(peer, stage, throughput)
            for stage, peers in enumerate(stages) for peer, throughput in peers.items()]


def test_stage_and_pipeline_throughput():
    placements = place({"a": 1.0, "b": 2.0}, {}, {"c": 0.5})
    assert stage_throughputs(placements, 3) == [3.0, 0.0, 0.5]
    assert pipeline_throughput(placements, 3) == 0.0
    assert pipeline_throughput(place({"a": 1.0, "b": 2.0}, {"c": 0.5}), 2) == 0.5


def test_invalid_placements_are_rejected():
    with pytest.raises(ValueError, match="outside"):
        stage_throughputs([Placement("a", 2, 1.0)], 2)
    with pytest.raises(ValueError, match="twice"):
        stage_throughputs([Placement("a", 0, 1.0), Placement("a", 1, 1.0)], 2)


def test_joiner_takes_the_empty_stage_then_the_weakest():
    assert joiner_stage(place({}, {"a": 1.0}, {}), 3) == 0
    assert joiner_stage(place({"a": 1.0}, {"b": 1.0}, {}), 3) == 2
    assert joiner_stage(place({"a": 0.0}, {}), 2) == 1  # empty beats a stage of unknown speed
    assert joiner_stage(place({"a": 3.0}, {"b": 1.0, "c": 1.5}, {"d": 2.0}), 3) == 2
    assert joiner_stage(place({"a": 2.0}, {"b": 2.0}), 2) == 0


def test_move_fills_an_empty_stage():
    assert plan_move(place({"a": 1.0, "b": 2.0}, {}), 2) == ("a", 0, 1)  # min(2, 1) == min(1, 2): lowest id
    assert plan_move(place({"a": 0.0, "b": 2.0}, {}), 2) == ("a", 0, 1)  # even a peer of unknown speed
    assert plan_move(place({"a": 1.0, "b": 2.0, "c": 4.0}, {}), 2) == ("c", 0, 1)  # min(3, 4) beats min(5, 2)


def test_an_overloaded_slow_stage_receives_a_peer():
    # The runtime's rebalance scenario: stage 1's lone peer is three times slower than each of stage 0's.
    placements = place({"a": 1.0, "b": 1.0, "c": 1.0}, {"d": 0.33})
    assert plan_move(placements, 2) == ("a", 0, 1)  # a, b, c tie at min(2.0, 1.33); lowest peer id
    assert should_move(placements, 2, "a") == 1 and should_move(placements, 2, "d") is None
    assert stage_throughputs(rebalance_until_stable(placements, 2), 2) == pytest.approx([2.0, 1.33])


def test_move_picks_the_peer_that_best_balances_donor_and_target():
    # Not the donor's weakest peer c (min(4.0, 1.5) and min(4.5, 1.5)), but the one that balances best.
    assert plan_move(place({"a": 2.0, "b": 2.0, "c": 0.5}, {"d": 1.0}), 2) == ("a", 0, 1)  # min(2.5, 3.0)
    assert plan_move(place({"a": 3.0, "b": 1.5, "c": 0.5}, {"d": 1.0}), 2) == ("b", 0, 1)  # min(3.5, 2.5)


def test_move_comes_from_a_stage_that_has_two_peers():
    # Stage 0 is the strongest but has one peer; stage 2 donates, ties broken by peer id.
    placements = place({"a": 5.0}, {"b": 0.1}, {"d": 3.0, "c": 3.0})
    assert plan_move(placements, 3) == ("c", 2, 1)
    assert should_move(placements, 3, "c") == 1
    assert should_move(placements, 3, "d") is None and should_move(placements, 3, "b") is None


def test_any_multi_peer_stage_may_donate_not_only_the_strongest():
    # Stage 0 is the strongest stage; stage 2 may donate as well, and does when its move balances better.
    placements = place({"a": 5.0, "b": 1.0}, {"e": 0.5}, {"c": 1.0, "d": 3.0})
    assert plan_move(placements, 3) == ("b", 0, 1)  # min(5.0, 1.5) ties with c's min(3.0, 1.5): lower donor
    placements = place({"a": 5.0, "b": 0.6}, {"e": 0.5}, {"c": 1.0, "d": 3.0})
    assert plan_move(placements, 3) == ("c", 2, 1)  # b: min(5.0, 1.1) < c: min(3.0, 1.5)
    # Ties on the balance go to the lowest donor stage, then the lowest peer id.
    assert plan_move(place({"x": 1.0}, {"b": 2.0, "a": 2.0}, {"d": 2.0, "c": 2.0}), 3) == ("a", 1, 0)


def test_move_never_empties_a_stage():
    assert plan_move(place({"a": 5.0}, {"b": 1.0}), 2) is None
    assert plan_move(place({"a": 5.0}, {"b": 0.0}, {"c": 0.0}), 3) is None
    assert plan_move(place({"a": 5.0}, {}, {"c": 0.0}), 3) is None  # not even to fill an empty stage
    rng = random.Random(1)
    for _ in range(200):
        stages = rng.randint(2, 4)
        placements = [Placement(f"p{i}", rng.randrange(stages), rng.uniform(0.0, 4.0))
                      for i in range(rng.randint(1, 8))]
        move = plan_move(placements, stages)
        if move is not None:
            mover, donor, target = move
            assert sum(p.stage == donor for p in placements) >= 2
            assert donor != target and next(p.stage for p in placements if p.peer_id == mover) == donor


def test_negative_hysteresis_is_rejected():
    with pytest.raises(ValueError, match="hysteresis"):
        plan_move(place({"a": 1.0, "b": 1.0}, {"c": 1.0}), 2, hysteresis=-0.1)


def test_hysteresis_after_a_move_no_move_back():
    before = place({"a": 1.0, "b": 0.5, "c": 0.5}, {"d": 1.0})
    assert plan_move(before, 2) == ("b", 0, 1)  # min(1.5, 1.5): pipeline 1.0 -> 1.5
    after = place({"a": 1.0, "c": 0.5}, {"d": 1.0, "b": 0.5})
    assert plan_move(after, 2) is None
    # Even if a and c now measure slower, sending b back would not pay.
    assert plan_move(place({"a": 0.7, "c": 0.35}, {"d": 1.0, "b": 0.5}), 2) is None


@pytest.mark.parametrize("hysteresis", [0.0, 0.1, 0.2])
def test_a_move_is_never_followed_by_the_move_back(hysteresis):
    rng = random.Random(7)
    for _ in range(300):
        stages = rng.randint(2, 4)
        current = [Placement(f"p{i}", i % stages if i < stages else rng.randrange(stages), rng.uniform(0.5, 4.0))
                   for i in range(rng.randint(stages, 8))]
        for _ in range(20):
            move = plan_move(current, stages, hysteresis)
            if move is None:
                break
            mover, donor, target = move
            current = [replace(p, stage=target) if p.peer_id == mover else p for p in current]
            assert plan_move(current, stages, hysteresis) != (mover, target, donor)
        else:
            pytest.fail("rebalancing did not settle within 20 moves")


def test_hysteresis_ignores_small_gains_that_noise_would_reverse():
    near_equal = place({"a": 1.0, "b": 1.0, "c": 0.2}, {"d": 1.0, "e": 0.95})
    assert plan_move(near_equal, 2) is None  # min(2.0, 2.15) is not above 1.1 * 1.95
    assert plan_move(near_equal, 2, hysteresis=0.0) == ("c", 0, 1)
    # Without hysteresis, a 5% measurement drift sends c straight back: a flip-flop.
    drifted = place({"a": 0.95, "b": 0.95}, {"d": 1.0, "e": 0.95, "c": 0.2})
    assert plan_move(drifted, 2, hysteresis=0.0) == ("c", 1, 0)
    assert plan_move(drifted, 2) is None
    # The threshold is strict: the target must end above 1.1 times its total.
    assert plan_move(place({"a": 2.0, "c": 0.1}, {"d": 1.0}), 2) is None  # 1.1 is not above 1.1
    assert plan_move(place({"a": 2.0, "c": 0.11}, {"d": 1.0}), 2) == ("c", 0, 1)  # 1.0 -> 1.11
    assert plan_move(place({"a": 2.0, "c": 0.11}, {"d": 1.0}), 2, hysteresis=0.2) is None


def test_plan_is_the_same_whatever_order_peers_are_listed_in():
    placements = place({"a": 0.1, "b": 0.2, "c": 0.3, "x": 0.35}, {"d": 0.6}, {"e": 0.2})
    expected = plan_move(placements, 3)
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(placements)
        assert plan_move(placements, 3) == expected


def test_best_static_assignment_by_hand():
    assignment, value = best_static_assignment({"a": 1.0, "b": 1.0, "c": 2.0, "d": 4.0}, 2)
    assert value == 4.0
    assert assignment["a"] == assignment["b"] == assignment["c"] != assignment["d"]
    assert list(assignment) == ["a", "b", "c", "d"]
    assert best_static_assignment({"a": 3.0, "b": 1.0}, 2) == ({"a": 0, "b": 1}, 1.0)
    with pytest.raises(ValueError, match="every stage needs a peer"):
        best_static_assignment({"a": 1.0}, 2)


@pytest.mark.parametrize("seed", range(6))
def test_best_static_assignment_matches_brute_force(seed):
    rng = random.Random(seed)
    stages, count = rng.randint(2, 3), rng.randint(3, 7)
    throughputs = {f"p{i}": round(rng.uniform(0.5, 4.0), 2) for i in range(count)}
    brute = max(pipeline_throughput([Placement(peer, stage, throughputs[peer])
                                     for peer, stage in zip(throughputs, choice)], stages)
                for choice in itertools.product(range(stages), repeat=count))
    assignment, value = best_static_assignment(throughputs, stages)
    assert value == pytest.approx(brute)
    placements = [Placement(peer, stage, throughputs[peer]) for peer, stage in assignment.items()]
    assert pipeline_throughput(placements, stages) == pytest.approx(value)


def bad_start(throughputs: dict[str, float], stages: int) -> list[Placement]:
    """The strongest peers crowd stage 0; every other stage gets one of the weakest."""
    order = sorted(throughputs, key=lambda peer: (throughputs[peer], peer))
    return ([Placement(peer, 1 + i, throughputs[peer]) for i, peer in enumerate(order[:stages - 1])]
            + [Placement(peer, 0, throughputs[peer]) for peer in order[stages - 1:]])


def test_rebalance_keeps_throughputs_and_ends_stable():
    start = place({"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}, {"e": 0.5})
    end = rebalance_until_stable(start, 2)
    assert [(p.peer_id, p.throughput) for p in end] == [(p.peer_id, p.throughput) for p in start]
    assert plan_move(end, 2) is None
    assert stage_throughputs(end, 2) == [5.0, 5.5]  # a then d moved: 0.5 -> 4.5 -> 5.0, the optimum
    assert best_static_assignment({p.peer_id: p.throughput for p in start}, 2)[1] == 5.0
    assert rebalance_until_stable(start, 2, max_moves=1) == [
        Placement("a", 1, 4.0), Placement("b", 0, 3.0), Placement("c", 0, 2.0), Placement("d", 0, 1.0),
        Placement("e", 1, 0.5)]


# Seeds 0-7 are the first eight cases, not a selection. Measured ratios of the stable pipeline to the
# exhaustive optimum: 0.924, 0.886, 1.0, 0.941, 0.993, 0.982, 1.0, 1.0. Seed 1 stalls where only a swap
# of two peers, or a move that does not lift the weakest stage, would help.
STALLS_BELOW_90_PERCENT = {1: 0.886}


@pytest.mark.parametrize("seed", [
    pytest.param(seed, marks=pytest.mark.xfail(
        strict=True, reason=f"single moves stall at {STALLS_BELOW_90_PERCENT[seed]} of the best static assignment"))
    if seed in STALLS_BELOW_90_PERCENT else seed
    for seed in range(8)
])
def test_rebalance_from_a_bad_start_nears_the_best_static_assignment(seed):
    rng = random.Random(seed)
    stages = rng.randint(2, 4)
    count = rng.randint(stages + 1, 9)
    throughputs = {f"p{i}": round(rng.uniform(0.5, 4.0), 2) for i in range(count)}
    start = bad_start(throughputs, stages)
    end = rebalance_until_stable(start, stages)
    _, best = best_static_assignment(throughputs, stages)
    assert pipeline_throughput(end, stages) > pipeline_throughput(start, stages)
    assert pipeline_throughput(end, stages) >= 0.9 * best


def round_robin_start(throughputs: dict[str, float], stages: int) -> list[Placement]:
    """Peers in listing order take stages 0, 1, ..., stages - 1, 0, 1, ..."""
    return [Placement(peer, i % stages, throughput) for i, (peer, throughput) in enumerate(throughputs.items())]


# Measured over seeds 0-199 (mean / min / fraction below 0.9 of the optimum):
# crowded start 0.976 / 0.815 / 0.06, round-robin start 0.965 / 0.709 / 0.12; at most 5 moves.
@pytest.mark.parametrize("start_of", [bad_start, round_robin_start])
def test_rebalance_sweep_averages_above_90_percent_of_the_best_static_assignment(start_of):
    ratios = []
    for seed in range(200):
        rng = random.Random(seed)
        stages = rng.randint(2, 4)
        count = rng.randint(max(3, stages), 8)
        throughputs = {f"p{i}": rng.uniform(0.5, 4.0) for i in range(count)}
        start = start_of(throughputs, stages)
        end = rebalance_until_stable(start, stages, max_moves=20)
        assert plan_move(end, stages) is None  # settled well within 20 moves
        assert pipeline_throughput(end, stages) >= pipeline_throughput(start, stages)
        _, best = best_static_assignment(throughputs, stages)
        ratios.append(pipeline_throughput(end, stages) / best)
    assert sum(ratios) / len(ratios) >= 0.9
