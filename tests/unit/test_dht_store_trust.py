"""How long a store trusts the nodes a search found nearest its key (transport.dht_stores, Decision 61):
NEAREST_MAX_AGE_S after a first search or one that found other nodes, twice as long after each search
that found the same nodes, up to NEAREST_TRUSTED_S; a search that found too few nodes is not remembered,
and a memory narrowed to the nodes that answered is trusted for NEAREST_MAX_AGE_S at most and counts as
other nodes at the next search."""

from __future__ import annotations

import pytest
from hivemind.dht.routing import DHTID

from lowcomm.transport import dht_stores

KEY_ID = DHTID.generate(source="run.peers")
A, B, C, D = (DHTID.generate() for _ in range(4))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(dht_stores.time, "monotonic", clock)
    monkeypatch.setattr(dht_stores, "_nearest", {})
    return clock


def trusted_for(clock: Clock) -> float:
    """How long from now the memory of KEY_ID lasts (the clock is put back)."""
    start, lo, hi = clock.now, 0.0, 10_000.0
    while hi - lo > 0.5:
        clock.now = start + (lo + hi) / 2
        if dht_stores.nearest(KEY_ID):
            lo = (lo + hi) / 2
        else:
            hi = (lo + hi) / 2
    clock.now = start
    return round(hi)


def test_the_same_nodes_found_again_are_trusted_twice_as_long_up_to_the_cap(clock):
    nodes = {A: "a", B: "b", C: "c"}
    trusts = []
    for _ in range(6):
        dht_stores.remember(KEY_ID, nodes, full=True)
        trusts.append(trusted_for(clock))
        clock.now += trusts[-1] + 1  # it aged out: the next store searches and finds the same nodes
        assert dht_stores.nearest(KEY_ID) == {}
    assert trusts == [60, 120, 240, 480, 480, 480]
    assert dht_stores.NEAREST_MAX_AGE_S == 60 and dht_stores.NEAREST_TRUSTED_S == 480


def test_other_nodes_a_narrowed_memory_or_too_few_nodes_start_again_at_a_minute(clock):
    dht_stores.remember(KEY_ID, {A: "a", B: "b", C: "c"}, full=True)
    dht_stores.remember(KEY_ID, {A: "a", B: "b", C: "c"}, full=True)
    assert trusted_for(clock) == 120
    dht_stores.remember(KEY_ID, {A: "a", B: "b", D: "d"}, full=True)  # a node nearer the key joined
    assert trusted_for(clock) == 60
    dht_stores.remember(KEY_ID, {A: "a", B: "b", D: "d"}, full=True)
    assert trusted_for(clock) == 120
    dht_stores.keep(KEY_ID, {A: "a", B: "b"})  # D did not answer a store: the memory narrows, for a minute
    assert trusted_for(clock) == 60 and set(dht_stores.nearest(KEY_ID)) == {A, B}
    dht_stores.remember(KEY_ID, {A: "a", B: "b", D: "d"}, full=True)  # D is back: not what was remembered
    assert trusted_for(clock) == 60
    dht_stores.remember(KEY_ID, {A: "a"}, full=False)  # a DHT still filling: nothing remembered
    assert dht_stores.nearest(KEY_ID) == {}
    dht_stores.remember(KEY_ID, {A: "a", B: "b", D: "d"}, full=True)
    assert trusted_for(clock) == 60
