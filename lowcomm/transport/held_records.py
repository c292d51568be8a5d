"""The peer records a DHT read returned, held until their own expiration (Decision 42, docs/round-protocol.md).

A read of a key merges the records of the nodes that answer it. When a node that holds the key does
not answer in time (a peer back from a cut whose connections still hang), the read can come back
with records missing although they are stored and unexpired, and a peer would treat live peers as
gone: it posts its round announcement to nobody and takes a round alone. A record lives in the DHT
until its expiration unless a later record of its writer replaces it, so a record that one read
returned is kept for the next reads until its expiration or until a read returns its writer's later
record or tombstone. The record that expires last wins, as on a DHT node. A dead peer's record then
ends when it would have in a complete read.
"""

from __future__ import annotations

import threading

MAX_HELD = 65536  # writers held at once (a read returns at most what the DHT's nodes hold; the latest kept)


class HeldRecords:
    """writer -> (value, expiration) from the reads so far; tombstones (``gone``) held as well."""

    def __init__(self, max_held: int = MAX_HELD):
        self._held: dict[str, tuple[dict, float]] = {}
        self._max = max_held
        self._lock = threading.Lock()

    def merge(self, read: dict[str, tuple[dict, float]], now: float) -> dict[str, dict]:
        """Folds in one read's ``writer -> (value, expiration)`` (tombstones included) and answers the
        live values: every writer's record that expires last, unexpired and not a tombstone."""
        with self._lock:
            held = {p: e for p, e in self._held.items() if e[1] > now}
            for writer, (value, expiration) in read.items():
                if expiration > now and (writer not in held or expiration >= held[writer][1]):
                    held[writer] = (value, expiration)
            if len(held) > self._max:  # the ones expiring last stay
                held = dict(sorted(held.items(), key=lambda item: item[1][1])[-self._max:])
            self._held = held
            return {p: value for p, (value, _) in held.items() if not value.get("gone")}
