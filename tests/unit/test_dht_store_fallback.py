"""A store straight to the nodes remembered for a key (transport.dht_stores) whose record some of them
took while one did not answer returns once the others answered (the silent one after DIRECT_CALL_S);
the next store goes to the nodes that answered, and hivemind's store, which searches for a node in
the silent one's place, runs meanwhile (one per key, the newest). Only a record that no node took
waits for it (Decision 44: a heartbeat held up by that store let the peer's record expire). Over a node whose
calls are in-memory; assertions are on results and calls, never on durations."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from lowcomm.transport import dht_stores

KEY = "run.peers"
WAIT_S = 30.0  # a bound only a store that waits wrongly reaches; never asserted as a duration


class Node:
    """What dht_stores uses of a DHTNode: peers "live" take every record, "silent" never answers, and
    hivemind's store (``store``) waits until the test releases it."""

    num_replicas = 2

    def __init__(self):
        self.node_id = DHTID.generate()
        self.taken: list[str] = []
        self.full_stores = 0
        self.release = asyncio.Event()
        self.protocol = SimpleNamespace(serializer=MSGPackSerializer, record_validator=None,
                                        call_store=self.call_store, storage=None)

    async def call_store(self, peer_id, **_):
        if peer_id == "silent":
            await asyncio.Event().wait()  # never answers
        self.taken.append(peer_id)
        return [True]

    async def find_nearest_nodes(self, key_ids, k_nearest):
        raise AssertionError("the nodes are remembered: no search")

    async def store(self, key, value, expiration, subkey=None):
        self.full_stores += 1
        await self.release.wait()
        return True


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    monkeypatch.setattr(dht_stores, "DIRECT_CALL_S", 0.05)
    monkeypatch.setattr(dht_stores, "_nearest", {})
    monkeypatch.setattr(dht_stores, "_background", {})


def remember(*peers: str) -> None:
    dht_stores.remember(DHTID.generate(source=KEY), {DHTID.generate(): p for p in peers}, full=True)


def store(node: Node):
    return dht_stores.store(None, node, KEY, b"me", {"round": 1}, expiration=1e12)


def test_a_record_some_nodes_took_returns_while_hivemind_s_store_runs():
    async def run():
        node = Node()
        key_id = DHTID.generate(source=KEY)
        remember("live", "silent")
        assert await store(node) == (True, True)  # taken by "live"; hivemind's store (a search) not ended
        assert node.taken == ["live"] and list(dht_stores.nearest(key_id).values()) == ["live"]
        await asyncio.sleep(0)  # the background store starts at the loop's next turn
        first = dht_stores._background[key_id]
        assert node.full_stores == 1 and not first.done()
        assert await store(node) == (True, False)  # the next store goes to the node that answered
        assert node.taken == ["live", "live"] and node.full_stores == 1
        remember("live", "silent")  # (as a later search would) a node silent again, the first store still running
        assert await store(node) == (True, True)
        await asyncio.sleep(0)
        assert first.cancelled() and node.full_stores == 2  # the newer record's store replaces it
        node.release.set()
        await asyncio.gather(*dht_stores._background.values())

    asyncio.run(asyncio.wait_for(run(), WAIT_S))


def test_a_record_no_node_took_waits_for_hivemind_s_store():
    async def run():
        node = Node()
        remember("silent", "silent")
        pending = asyncio.ensure_future(store(node))
        while node.full_stores == 0:
            await asyncio.sleep(0.01)  # the direct calls time out first (DIRECT_CALL_S)
        assert not pending.done()  # it waits for hivemind's store
        node.release.set()
        assert await pending == (True, True) and node.taken == []

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
