"""An owner holds a Reduce call open from every other contributor of a streamed round at once, so the
service's cap on waiting calls grows to fit the round (transport.service, `fit_round`): over real gRPC
servers, a round larger than the cap it started with loses no part."""

from __future__ import annotations

import pytest

from lowcomm.transport import service as service_module
from unit.test_sharded_reduce import KEY, SIGNERS, WAIT_S, Board, Node, weighted_mean
from unit.test_streamed_reduce import values


@pytest.fixture
def five():
    nodes = [Node(SIGNERS[i]) for i in range(5)]
    yield nodes
    for node in nodes:
        node.close()


def test_a_round_larger_than_the_waiting_calls_cap_grows_it_and_loses_no_part(five, monkeypatch):
    monkeypatch.setattr(service_module, "OTHER_CALLS", 1)
    for node in five:  # below the 4 Reduce calls each owner of a 5-member round holds open at once
        node.service.max_waiting_calls = 2
    board = Board(KEY.run, {n.id for n in five})
    reduces = [n.reduce(board) for n in five]
    payloads, weights = [values(i) for i in range(5)], [1.0, 2.0, 3.0, 4.0, 5.0]
    results = [h.result(WAIT_S) for h in [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, payloads, weights)]]
    for result in results:
        assert result.contributors == sorted(n.id for n in five) and result.info["lost_shards"] == []
        assert result.aggregate.equal(results[0].aggregate)
    assert results[0].aggregate.allclose(weighted_mean(payloads, weights), rtol=1e-6, atol=1e-6)
    assert [n.service.max_waiting_calls for n in five] == [5] * 5  # 4 Reduce calls and OTHER_CALLS
    assert [n.service.errors for n in five] == [0] * 5
    assert not [e for n in five for e in n.events if e["kind"] in ("reject", "timeout")]


def test_the_cap_only_grows_and_stops_at_its_ceiling(five):
    service = five[0].service
    start = service.max_waiting_calls
    service.fit_round(3)
    assert service.max_waiting_calls == start  # a small round leaves the floor as it was
    service.fit_round(101)
    assert service.max_waiting_calls == 100 + service_module.OTHER_CALLS
    service.fit_round(40)
    assert service.max_waiting_calls == 100 + service_module.OTHER_CALLS  # never lowered
    service.fit_round(10 * service_module.ROUND_CALLS_MAX)
    assert service.max_waiting_calls == service_module.ROUND_CALLS_MAX + service_module.OTHER_CALLS
    assert service_module.SERVER_THREADS > service.max_waiting_calls + 8  # Ping and stage calls still find one
