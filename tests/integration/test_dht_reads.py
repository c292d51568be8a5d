"""Reads from one of the nodes that hold a key (transport.dht_reads), over real DHT nodes: the same
records as hivemind's search, and a search instead whenever that node's answer lacks a record seen
before, or it does not answer."""

from functools import partial

import pytest

from lowcomm.transport import dht_stores
from lowcomm.transport.control import DHT_TRAFFIC, ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity

RUN = "run-r"
KEY = f"{RUN}.peers"


async def forget_record(_dht, node, key: str, subkey: bytes) -> bool:
    """Runs in a DHT node's process: drops one record of ``key`` from its storage (a store it missed)."""
    from hivemind.dht.routing import DHTID
    held = node.protocol.storage.get(DHTID.generate(source=key))
    if held is None or subkey not in held.value:
        return False
    del held.value[subkey]
    return True


@pytest.fixture()
def swarm():
    first = ControlPlane.start(Identity.generate(), RUN)
    planes = [first] + [ControlPlane.start(Identity.generate(), RUN, initial_peers=first.visible_maddrs())
                        for _ in range(4)]
    for round_, plane in enumerate(planes):
        plane.publish_peer(PeerRecord(plane.identity.peer_id, "127.0.0.1:9", "training", round=round_), ttl=60)
    yield planes
    for plane in planes:
        plane.shutdown()


def holders_and_reader(planes: list[ControlPlane]) -> tuple[list[ControlPlane], ControlPlane]:
    """The nodes holding the peers key, and a node that is not one of them (its reads go to them)."""
    held = set(planes[0].dht.run_coroutine(partial(dht_stores.remembered, key=KEY)))
    assert len(held) == DHT_TRAFFIC["num_replicas"]
    return [p for p in planes if str(p.dht.peer_id) in held], next(p for p in planes if str(p.dht.peer_id) not in held)


def test_a_read_from_one_holder_gives_every_record_without_a_search(swarm):
    everyone = {p.identity.peer_id: round_ for round_, p in enumerate(swarm)}
    for plane in swarm:
        for _ in range(4):  # the holders in turn, or the node's own storage
            assert {peer: r.round for peer, r in plane.live_peers().items()} == everyone
        assert plane.searches["get peers"] == 0 and plane.calls["get peers"] == 4
    swarm[1].publish_peer(PeerRecord(swarm[1].identity.peer_id, "127.0.0.1:9", "training", round=7), ttl=60)
    swarm[2].expire_peer(ttl=60)
    for plane in swarm:
        live = plane.live_peers()
        assert live[swarm[1].identity.peer_id].round == 7 and swarm[2].identity.peer_id not in live


def test_a_holder_that_lacks_a_record_seen_before_is_not_believed(swarm):
    holders, reader = holders_and_reader(swarm)
    everyone = {p.identity.peer_id for p in swarm}
    assert set(reader.live_peers()) == everyone
    lost = holders[-1].identity
    for holder in holders[:-1]:  # two of the three holders lose the last holder's record; it keeps its own
        assert holder.dht.run_coroutine(partial(forget_record, key=KEY, subkey=lost.owner_marker))
    searched = reader.searches["get peers"]
    for _ in range(len(holders)):  # each holder answers once in turn
        assert set(reader.live_peers()) == everyone
    assert reader.searches["get peers"] - searched == len(holders) - 1  # the two that lost it were not taken


def test_a_holder_gone_costs_a_search_not_the_records(swarm):
    holders, reader = holders_and_reader(swarm)
    assert len(reader.live_peers()) == len(swarm)
    gone = holders[0]
    gone.shutdown()
    for _ in range(len(holders)):  # its turn comes: no answer, a search; its record is on the other two holders
        assert set(reader.live_peers()) == {p.identity.peer_id for p in swarm}
    assert reader.searches["get peers"] >= 1
    assert reader.dht.run_coroutine(partial(dht_stores.remembered, key=KEY)) == []  # the next store searches
