"""Stores of lowcomm's records straight to the nodes that hold their key (docs/scale.md, plan 5).

hivemind's store (``DHTNode.store_many``) first searches the key's nearest nodes with the call a read
makes, and every node it asks answers with all of the key's records: of a store of one peer record
into the run's peers key, most of the bytes are that download. A record is stored again under the
same key every few seconds (a heartbeat) while the nodes nearest the key rarely change, so
the DHT's process remembers, per key, the nodes a search found, and stores the signed record straight
to them (``DHTProtocol.call_store``), exactly as hivemind's store does once its search ends.

It searches again when it remembers no nodes for the key, when they were found longer ago than it
trusts them (nodes that joined since may be nearer), when a search found fewer than
``num_replicas`` (a DHT still filling: nothing is remembered then), and when one of them did not
answer within DIRECT_CALL_S and no node but this one took the record: hivemind's store then runs, and
the caller waits for it. When another node took it, the store returns: the nodes remembered for the
key narrow to those that answered (while they are trusted), and hivemind's store, whose search finds
a node in the silent one's place for this record, runs in the DHT's process meanwhile (Decision 44:
a heartbeat held up by it can let the peer's record expire).

The trust is earned (Decision 61): NEAREST_MAX_AGE_S after a search that found other nodes than the
last one (or after none), twice the last trust after a search that found the same nodes, up to
NEAREST_TRUSTED_S. A key whose nearest nodes stay put is searched every few minutes instead of every
minute; one whose nodes move, or whose node went silent (its memory narrowed or forgotten), is back at
a minute at once.

Reads are hivemind's (merged from every node that holds the key): a node that missed stores while it
was cut off would answer with records that have expired since (Decision 40). These functions run in
the DHT's process (``hivemind.DHT.run_coroutine``); what they remember lives there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

NEAREST_MAX_AGE_S = 60.0  # how long the nodes a search found nearest a key are trusted, at first
NEAREST_TRUSTED_S = 480.0  # ... and at most, once search after search found the same nodes
DIRECT_CALL_S = 2.0  # a remembered node that has not answered a store by then counts as gone
MAX_KEYS = 256  # keys whose nearest nodes are remembered (the oldest are forgotten first)

# key id -> (found at, {node id: peer id}, trusted for s), in the DHT's process
_nearest: dict[DHTID, tuple[float, dict, float]] = {}
_background: dict[DHTID, asyncio.Task] = {}  # key id -> hivemind's store of it, run without waiting (_in_background)


async def store(_dht, node: DHTNode, key: str, subkey: bytes, value, expiration: float) -> tuple[bool, bool]:
    """Stores ``value`` under ``key``/``subkey`` until ``expiration`` on the key's nearest nodes:
    (whether a node took it, whether this store searched for them)."""
    key_id = DHTID.generate(source=key)
    found = nearest(key_id)
    searched = not found
    if searched:
        found = (await node.find_nearest_nodes([key_id], k_nearest=node.num_replicas)).get(key_id, {})
        remember(key_id, found, full=len(found) >= node.num_replicas)
    results = await _store_to(node, key_id, found, subkey, value, expiration)
    if found and None not in results:
        return any(results), searched
    if any(result is True and n != node.node_id for n, result in zip(found, results)):
        # another node took it: the next stores go to the nodes that answered, while hivemind's store
        # puts this record on a node in the silent one's place
        keep(key_id, {n: p for (n, p), result in zip(found.items(), results) if result is not None})
        _in_background(key_id, node.store(key, value, expiration, subkey=subkey))
        return True, True
    forget(key_id)  # no other node took it: a search, now and at the next store
    ok = await node.store(key, value, expiration, subkey=subkey)
    return bool(ok), True


def _in_background(key_id: DHTID, store_call) -> None:
    """Runs ``store_call`` (hivemind's store of a record another node took) without waiting for it: one
    per key and MAX_KEYS in all (another is dropped: the nodes that answered took its record)."""
    for done in [k for k, task in _background.items() if task.done()]:
        del _background[done]
    if key_id in _background or len(_background) >= MAX_KEYS:
        store_call.close()
        return
    task = asyncio.get_running_loop().create_task(store_call)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure: the nodes kept hold it
    _background[key_id] = task


def nearest(key_id: DHTID) -> dict:
    """The nodes remembered nearest the key ({node id: peer id}), if found within the time they are trusted."""
    found = _nearest.get(key_id)
    return {} if found is None or time.monotonic() - found[0] > found[2] else found[1]


def forget(key_id: DHTID) -> None:
    _nearest.pop(key_id, None)


def keep(key_id: DHTID, answered: dict) -> None:
    """Narrows the nodes remembered for the key to those that ``answered``, found when they were, trusted
    for NEAREST_MAX_AGE_S at most from then (a node went silent: the key's nodes are moving)."""
    found = _nearest.get(key_id)
    if found is not None:
        _nearest[key_id] = (found[0], dict(answered), min(found[2], NEAREST_MAX_AGE_S))


def remember(key_id: DHTID, nearest: dict, full: bool) -> None:
    """The nodes a search found nearest the key (``full``: as many as the key's replicas), trusted twice as
    long as the last search's if that found the same nodes, else NEAREST_MAX_AGE_S."""
    last = _nearest.pop(key_id, None)
    if not full:
        return
    while len(_nearest) >= MAX_KEYS:
        _nearest.pop(next(iter(_nearest)))
    same = last is not None and set(last[1]) == set(nearest)
    trust = min(2 * last[2], NEAREST_TRUSTED_S) if same else NEAREST_MAX_AGE_S
    _nearest[key_id] = (time.monotonic(), dict(nearest), trust)


async def _store_to(node: DHTNode, key_id: DHTID, nearest: dict, subkey: bytes, value,
                    expiration: float) -> list[bool | None]:
    """The signed record stored on each of ``nearest`` (this node's own storage where it is one of them):
    per node, True (taken), False (refused: it holds a newer record), None (no answer)."""
    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration)
    if protocol.record_validator is not None:
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))

    async def one(node_id: DHTID, peer_id) -> bool | None:
        if node_id == node.node_id:
            if protocol.record_validator is not None and not protocol.record_validator.validate(record):
                return False
            return protocol.storage.store(key_id, record.value, expiration, subkey=subkey)
        answer = await bounded(protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                                   expiration_time=[expiration], subkeys=[subkey]))
        return None if answer is None else bool(answer and answer[0])

    return list(await asyncio.gather(*(one(n, p) for n, p in nearest.items())))


async def bounded(call):
    """``call``'s answer, or None once DIRECT_CALL_S passed (hivemind's own RPC deadline is longer, and
    the search that follows a node's silence has its own): a gone node costs one short wait."""
    try:
        return await asyncio.wait_for(call, DIRECT_CALL_S)
    except asyncio.TimeoutError:
        return None


async def remembered(_dht, _node: DHTNode, key: str) -> list[str]:
    """The peer ids of the nodes remembered nearest ``key`` (none if it would search)."""
    return [str(peer_id) for peer_id in nearest(DHTID.generate(source=key)).values()]
