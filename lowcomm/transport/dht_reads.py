"""Reads of a key from one of the nodes that hold it (docs/scale.md, plan 5; Decision 40).

hivemind's read with ``latest=True`` asks every node its search reaches, and each node that holds
the key answers with all of its records: three answers of every peer's record for the run's peers
key, read by every peer once or twice a round. Where this node's last store of the key found its
nodes (transport.dht_stores remembers them), every store of the key goes to all of them, so one of
them is enough: this node's own storage if it is one, else one of them
(``DHTProtocol.call_find``, whose answer hivemind validates record by record: a forged or tampered
record makes it drop the whole answer).

The answer is taken only if it is at least as complete as what this node read of the key last: a
record seen before and not yet expired that is missing, or older than it was, means the node
missed a store (it restarted, or a store to it failed) or hid one, and the read goes through
hivemind's own search instead, as does a read of a key whose nodes are not remembered, or whose
node does not answer. The remote holders take turns, so a holder that hides a record it was sent
hides it from one read in (holders) at most: the next holder's answer shows it, and every later
answer without it is refused. These functions run in the DHT's process
(``hivemind.DHT.run_coroutine``).
"""

from __future__ import annotations

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import ValueWithExpiration, get_dht_time

from lowcomm.transport import dht_stores

MAX_KEYS = 256  # keys whose last read's records (subkey -> expiration) are remembered
_seen: dict[DHTID, dict] = {}  # key id -> {subkey: expiration} of the last read, in the DHT's process
_turn = [0]  # which remote holder answers the next read


async def read(_dht, node: DHTNode, key: str) -> tuple[ValueWithExpiration | None, bool]:
    """The key's records, as ``DHT.get(key, latest=True)`` gives them, and whether the read searched."""
    key_id = DHTID.generate(source=key)
    holders = dht_stores.nearest(key_id)
    found = await _from_one(node, key_id, holders) if holders else None
    searched = found is None or not covers(found.value, _seen.get(key_id, {}), get_dht_time())
    if searched:
        found = await node.get(key, latest=True)
        if found is not None and not isinstance(found.value, dict):
            return found, True
    remember(key_id, {} if found is None else {subkey: item.expiration_time for subkey, item in found.value.items()})
    return (found if found is not None and found.value else None), searched


def covers(records: dict, seen: dict, now: float) -> bool:
    """Whether ``records`` (subkey -> value with its expiration) holds every record of ``seen`` (subkey ->
    expiration) that has not expired yet, each at least as new."""
    return all(subkey in records and records[subkey].expiration_time >= expiration
               for subkey, expiration in seen.items() if expiration > now)


def remember(key_id: DHTID, records: dict) -> None:
    _seen.pop(key_id, None)
    while len(_seen) >= MAX_KEYS:
        _seen.pop(next(iter(_seen)))
    _seen[key_id] = records


async def _from_one(node: DHTNode, key_id: DHTID, holders: dict) -> ValueWithExpiration | None:
    """The key's records from this node's storage (if it holds the key) or from one of its holders (in
    turn), unpacked as hivemind's read does; None if that node does not answer or holds something else."""
    if node.node_id in holders:
        stored = node.protocol.storage.get(key_id)
    else:
        remote = sorted(holders, key=key_id.xor_distance)
        _turn[0] += 1
        answer = await node.protocol.call_find(holders[remote[_turn[0] % len(remote)]], [key_id])
        if answer is None:  # no answer: the key's nodes are searched again at the next store
            dht_stores.forget(key_id)
            return None
        if key_id not in answer or answer[key_id][0] is None:
            return None  # nothing held, or an answer hivemind refused: a search says which
        stored = answer[key_id][0]
    if stored is None:
        return ValueWithExpiration({}, float("-inf"))
    if not isinstance(stored.value, DictionaryDHTValue):
        return None
    protocol, out = node.protocol, {}
    for subkey, (value_bytes, expiration) in stored.value.items():
        if protocol.record_validator is not None:
            record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration)
            value_bytes = protocol.record_validator.strip_value(record)
        out[subkey] = ValueWithExpiration(protocol.serializer.loads(value_bytes), expiration)
    return ValueWithExpiration(out, stored.expiration_time)
