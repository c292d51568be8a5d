"""A store straight to the nodes remembered for a key (transport.dht_stores) whose record some of them
took while one did not answer returns once the others answered (the silent one after DIRECT_CALL_S);
the next store goes to the nodes that answered, and hivemind's store, which searches for a node in
the silent one's place, runs meanwhile (one per key). A record that no node but this one took waits
for it (Decision 44: a heartbeat held up by that store let the peer's record expire). Over a node whose
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
    """What dht_stores uses of a DHTNode: peers "live" take every record, "silent" never answers, this
    node's own storage takes what is stored into it, and hivemind's store (``store``) waits until the
    test releases it."""

    num_replicas = 2

    def __init__(self):
        self.node_id = DHTID.generate()
        self.taken: list[str] = []
        self.full_stores = 0
        self.started, self.release = asyncio.Event(), asyncio.Event()
        storage = SimpleNamespace(store=lambda *a, **k: self.taken.append("self") or True)
        self.protocol = SimpleNamespace(serializer=MSGPackSerializer, record_validator=None,
                                        call_store=self.call_store, storage=storage)

    async def call_store(self, peer_id, **_):
        if peer_id == "silent":
            await asyncio.Event().wait()  # never answers
        self.taken.append(peer_id)
        return [True]

    async def find_nearest_nodes(self, key_ids, k_nearest):
        raise AssertionError("the nodes are remembered: no search")

    async def store(self, key, value, expiration, subkey=None):
        self.full_stores += 1
        self.started.set()
        await self.release.wait()
        return True


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    monkeypatch.setattr(dht_stores, "DIRECT_CALL_S", 0.05)
    monkeypatch.setattr(dht_stores, "_nearest", {})
    monkeypatch.setattr(dht_stores, "_background", {})


def remember(*peers: str, own: DHTID | None = None) -> None:
    nodes = {DHTID.generate(): p for p in peers}
    dht_stores.remember(DHTID.generate(source=KEY), {**nodes, **({own: "self"} if own else {})}, full=True)


def store(node: Node):
    return dht_stores.store(None, node, KEY, b"me", {"round": 1}, expiration=1e12)


def test_a_record_another_node_took_returns_while_hivemind_s_store_runs():
    async def run():
        node = Node()
        key_id = DHTID.generate(source=KEY)
        remember("live", "silent")
        assert await store(node) == (True, True)  # taken by "live"; hivemind's store (a search) not ended
        assert node.taken == ["live"] and list(dht_stores.nearest(key_id).values()) == ["live"]
        await node.started.wait()
        running = dht_stores._background[key_id]
        assert node.full_stores == 1 and not running.done()
        assert await store(node) == (True, False)  # the next store goes to the node that answered
        assert node.taken == ["live", "live"] and node.full_stores == 1
        remember("live", "silent")  # (as a later search would) a node silent again, the first store still running
        assert await store(node) == (True, True)
        assert dht_stores._background[key_id] is running and node.full_stores == 1  # one per key
        node.release.set()
        await running

    asyncio.run(asyncio.wait_for(run(), WAIT_S))


def test_a_record_no_other_node_took_waits_for_hivemind_s_store():
    async def run():
        for own in (False, True):  # nobody answered; only this node's own storage took it
            node = Node()
            remember("silent", "silent", own=node.node_id if own else None)
            pending = asyncio.ensure_future(store(node))
            await node.started.wait()  # after the direct calls' DIRECT_CALL_S
            assert not pending.done()  # it waits for hivemind's store
            node.release.set()
            assert await pending == (True, True) and node.taken == (["self"] if own else [])
            assert dht_stores.nearest(DHTID.generate(source=KEY)) == {}  # the next store searches

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
