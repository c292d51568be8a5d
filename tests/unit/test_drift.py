"""The φ drift check's rule: the agreed hash is the majority's, and a tie goes to the smallest peer id
(end to end: tests/integration/test_drift_e2e.py); a resync's download that got no state is retried
after a doubling, jittered pause."""

from __future__ import annotations

from lowcomm.runtime.state_sync import RETRY_MAX_S, RETRY_S, drift_sources, retry_pause_s


def test_the_agreed_hash_is_the_majority_and_a_tie_goes_to_the_smallest_peer_id():
    assert drift_sources({"a": "x", "b": "x", "c": "x", "d": "y"}, "d") == ["a", "b", "c"]
    assert drift_sources({"a": "x", "b": "x", "c": "x", "d": "y"}, "a") is None
    assert drift_sources({"a": "y", "b": "x", "c": "x", "d": "y"}, "b") == ["a", "d"]  # 2-2: a holds y
    assert drift_sources({"a": "y", "b": "x", "c": "x", "d": "y"}, "d") is None
    assert drift_sources({"a": "z", "b": "x", "c": "x", "d": "y"}, "a") == ["b", "c"]  # 2-1-1: no tie
    assert drift_sources({"c": "z", "b": "x", "a": "y"}, "b") == ["a"]  # 1-1-1
    pair = {"a", "b"}
    assert drift_sources({"a": "x", "b": "y"}, "b", pair, pair) == ["a"]  # 1-1 of the round's only members
    assert drift_sources({"a": "x", "b": "y"}, "a", pair, pair) is None
    assert drift_sources({"a": "x", "b": "y"}, "b") is None  # who applied the round unknown: no verdict
    assert drift_sources({"a": "x"}, "a", {"a"}, {"a"}) is None  # one voter: nothing to compare
    # two contributors of four members (a bounded fan-in): c and d hold the round's φ too, so no verdict
    four = {"a": "x", "b": "y", "c": "y", "d": "y"}
    for me in "bcd":
        assert drift_sources(four, me, pair, {"a", "b", "c", "d"}) is None
    assert drift_sources({"a": "x", "b": "y", "c": "y"}, "d") is None  # mine not published


def test_a_download_that_got_no_state_is_retried_after_a_doubling_jittered_pause():
    for failures in range(12):  # many resyncing peers must not retry a busy source in step, nor ever stop
        base = min(RETRY_MAX_S, RETRY_S * 2 ** failures)
        pauses = [retry_pause_s(failures) for _ in range(50)]
        assert all(base <= p <= 1.5 * base for p in pauses) and len(set(pauses)) > 1
    assert retry_pause_s(0) < 1.0 and retry_pause_s(20) <= 1.5 * RETRY_MAX_S
