"""Stores straight to the nodes a search of the key found (transport.dht_stores), over real DHT nodes:
readable by every node like hivemind's own store; left to the holders that answered, while a search
runs, when one is gone; searched at every store when too few nodes exist."""

from functools import partial

import pytest

from lowcomm.transport import dht_stores
from lowcomm.transport.control import DHT_TRAFFIC, ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity

RUN = "run-s"


def start(count: int) -> list[ControlPlane]:
    first = ControlPlane.start(Identity.generate(), RUN)
    return [first] + [ControlPlane.start(Identity.generate(), RUN, initial_peers=first.visible_maddrs())
                      for _ in range(count - 1)]


def remembered(plane: ControlPlane, key: str) -> list[str]:
    return plane.dht.run_coroutine(partial(dht_stores.remembered, key=key))


def record(plane: ControlPlane, round_: int) -> PeerRecord:
    return PeerRecord(plane.identity.peer_id, "127.0.0.1:9", "training", round=round_)


@pytest.fixture()
def swarm():
    planes = start(5)
    yield planes
    for plane in planes:
        plane.shutdown()


def test_a_store_searches_once_then_goes_straight_to_the_nodes_it_found(swarm):
    writer, *readers = swarm
    key = f"{RUN}.peers"
    writer.publish_peer(record(writer, 1), ttl=60)
    assert writer.searches["store peers"] == 1
    holders = remembered(writer, key)
    assert len(holders) == DHT_TRAFFIC["num_replicas"]
    for round_ in (2, 3):
        writer.publish_peer(record(writer, round_), ttl=60)
        for reader in readers:  # every node's read finds the new record, as after hivemind's store
            assert reader.live_peers()[writer.identity.peer_id].round == round_
    assert writer.searches["store peers"] == 1 and writer.calls["store peers"] == 3
    assert remembered(writer, key) == holders
    writer.expire_peer(ttl=60)  # a tombstone takes the same path and wins over the record everywhere
    assert all(writer.identity.peer_id not in reader.live_peers() for reader in readers)
    assert writer.searches["store peers"] == 1


def test_a_holder_gone_leaves_the_store_to_the_others_while_a_search_runs(swarm):
    writer, *others = swarm
    key = f"{RUN}.peers"
    writer.publish_peer(record(writer, 1), ttl=60)
    holders = remembered(writer, key)
    gone = next(p for p in others if str(p.dht.peer_id) in holders)
    gone.shutdown()
    # one holder does not answer: the others took it, and hivemind's store (a search) runs meanwhile
    writer.publish_peer(record(writer, 2), ttl=60)
    assert writer.searches["store peers"] == 2
    kept = remembered(writer, key)  # the holders that answered, until the next search
    assert sorted(kept) == sorted(h for h in holders if h != str(gone.dht.peer_id))
    for reader in (p for p in others if p is not gone):
        assert reader.live_peers()[writer.identity.peer_id].round == 2
    writer.publish_peer(record(writer, 3), ttl=60)
    assert writer.searches["store peers"] == 2 and remembered(writer, key) == kept
    for reader in (p for p in others if p is not gone):
        assert reader.live_peers()[writer.identity.peer_id].round == 3


def test_a_dht_with_fewer_nodes_than_replicas_is_searched_at_every_store():
    planes = start(2)
    try:
        writer, reader = planes
        for round_ in (1, 2):
            writer.publish_peer(record(writer, round_), ttl=60)
            assert reader.live_peers()[writer.identity.peer_id].round == round_
        assert writer.searches["store peers"] == 2 and remembered(writer, f"{RUN}.peers") == []
    finally:
        for plane in planes:
            plane.shutdown()
