import random
from collections import Counter

import pytest

from lowcomm.pipeline.routing import BACKWARD, FORWARD, StageRouter


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_router(clock=None) -> StageRouter:
    return StageRouter(random.Random(0), clock=clock or FakeClock())


def picks(router: StageRouter, count: int, stage: int = 0, **kwargs) -> Counter:
    return Counter(router.pick(stage, **kwargs) for _ in range(count))


def test_traffic_shares_follow_measured_throughput():
    router = make_router()
    router.update_peers(0, {"a": 0.0, "b": 0.0, "c": 0.0})
    for peer, seconds in {"a": 1.0, "b": 0.5, "c": 0.25}.items():  # 1, 2 and 4 forwards per second
        router.report(peer, FORWARD, seconds)
    counts = picks(router, 7000)
    for peer, share in {"a": 1 / 7, "b": 2 / 7, "c": 4 / 7}.items():
        assert counts[peer] / 7000 == pytest.approx(share, abs=0.01)


def test_backward_weighs_two_and_a_half_forwards():
    router = make_router()
    router.update_peers(0, {"a": 1.0, "b": 1.0})
    first = router.pick(0, BACKWARD)  # its load is now 2.5
    other = ({"a", "b"} - {first}).pop()
    assert [router.pick(0) for _ in range(4)] == [other, other, other, first]


def test_new_peer_enters_at_the_heap_minimum():
    router = make_router()
    router.update_peers(0, {"a": 1.0, "b": 1.0})
    assert picks(router, 100) == {"a": 50, "b": 50}
    router.update_peers(0, {"a": 1.0, "b": 1.0, "c": 1.0})
    # Entering at load 0 it would take the next 50 picks; at the minimum it takes its fair third.
    assert picks(router, 30) == {"a": 10, "b": 10, "c": 10}


def test_exclude_retries_on_another_replica():
    router = make_router()
    router.update_peers(0, {"a": 1.0, "b": 1.0})
    assert set(picks(router, 10, exclude={"a"})) == {"b"}
    assert router.pick(0, exclude={"a", "b"}) is None
    # a stays in the heap; it resumes at the load b had before its last pick, not 10 picks behind.
    assert picks(router, 10) == {"a": 6, "b": 4}


def test_ban_lasts_until_the_given_time():
    clock = FakeClock()
    router = make_router(clock)
    router.update_peers(0, {"a": 1.0, "b": 1.0})
    router.ban("a", until=10.0)
    clock.now = 5.0
    assert router.banned("a") and not router.banned("b")
    assert picks(router, 20) == {"b": 20}
    router.ban("b", until=10.0)
    assert router.pick(0) is None
    clock.now = 10.0
    assert not router.banned("a") and not router.banned("b")
    # Skipped while banned, the peer comes back at the minimum load: no burst of catch-up traffic.
    assert picks(router, 10) == {"a": 5, "b": 5}


def test_pick_on_an_unknown_or_emptied_stage_is_none():
    router = make_router()
    assert router.pick(3) is None
    router.update_peers(0, {"a": 1.0})
    router.update_peers(0, {})
    assert router.pick(0) is None and router.peers(0) == []


def test_ema_is_bias_corrected():
    router = make_router()
    router.update_peers(0, {"a": 7.0})
    assert router.throughput("a") == 7.0  # advertised until measured
    router.report("a", FORWARD, 0.5)  # 2.0 tasks/s: EMA 0.1 * 2.0 = 0.2, corrected 0.2 / 0.1
    assert router.throughput("a") == pytest.approx(2.0)
    router.report("a", BACKWARD, 1.0)  # 2.5 tasks/s: EMA 0.18 + 0.25 = 0.43, corrected by 1 - 0.9^2
    assert router.throughput("a") == pytest.approx(0.43 / 0.19)
    router.report("a", FORWARD, 0.25)  # 4.0 tasks/s: EMA 0.387 + 0.4 = 0.787, corrected by 1 - 0.9^3
    assert router.throughput("a") == pytest.approx(0.787 / 0.271)


def test_unknown_throughput_falls_back_to_the_stage_median_then_one():
    router = make_router()
    router.update_peers(0, {"a": 2.0, "b": 4.0, "c": 0.0, "d": 0.0})
    assert router.throughput("c") == 3.0  # median of the known 2 and 4; unknown d does not count
    router.report("c", FORWARD, 0.1)
    assert router.throughput("d") == pytest.approx(4.0)  # median of 2, 4 and c's measured 10
    router.update_peers(1, {"e": 0.0})
    assert router.throughput("e") == 1.0


def test_update_peers_drops_unlisted_and_moved_peers():
    router = make_router()
    router.update_peers(0, {"a": 1.0, "b": 1.0, "c": 1.0})
    router.report("b", FORWARD, 0.25)
    router.update_peers(0, {"a": 1.0, "c": 1.0})
    assert router.peers(0) == ["a", "c"]
    assert "b" not in picks(router, 20)
    router.report("b", FORWARD, 0.5)  # a call that outlived b's membership is ignored
    router.update_peers(0, {"a": 1.0, "b": 3.0, "c": 1.0})
    assert router.throughput("b") == 3.0  # measured afresh after coming back
    router.update_peers(1, {"c": 1.0})
    assert router.peers(0) == ["a", "b"] and router.peers(1) == ["c"]
    assert "c" not in picks(router, 20)


def test_invalid_reports_and_tasks_are_rejected():
    router = make_router()
    router.update_peers(0, {"a": 1.0})
    with pytest.raises(ValueError, match="positive"):
        router.report("a", FORWARD, 0.0)
    with pytest.raises(ValueError, match="task"):
        router.pick(0, "inference")
    with pytest.raises(ValueError, match="alpha"):
        StageRouter(random.Random(0), alpha=0.0)
