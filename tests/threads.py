"""Replicas of one process, each in its own thread: the unit tests' stand-in for peer processes."""

from __future__ import annotations

import threading

WAIT_S = 60.0  # a bound on joins that only a broken test reaches; never asserted


def in_threads(work, count: int) -> list:
    """``work(r)`` for every replica r in its own thread; returns their results, re-raises the first failure."""
    results, errors = [None] * count, []

    def run(r):
        try:
            results[r] = work(r)
        except BaseException as e:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,), name=f"replica-{r}") for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a replica never finished its loop"
    if errors:
        raise errors[0]
    return results
