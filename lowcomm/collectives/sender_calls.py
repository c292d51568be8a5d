"""How many calls each claimed sender has in flight on a server, bounded.

A sender that opens stream after stream holds one server thread per stream; `SenderCalls.admit(sender)`
lets at most `limit` of them be served at once. The sharded reduce admits a call only once its
signature proves the sender id (transport.signing), so nobody uses up another peer's places; anyone
can make fresh keys, so a server-wide cap (transport.service) bounds the total whatever the ids.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SenderCalls:
    def __init__(self, limit: int):
        self.limit = limit
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, sender: str) -> Callable[[], None] | None:
        """A one-shot release of ``sender``'s place among the calls served, or None when it has none left."""
        with self._lock:
            if self._calls.get(sender, 0) >= self.limit:
                return None
            self._calls[sender] = self._calls.get(sender, 0) + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._calls[sender] -= 1
                    if not self._calls[sender]:
                        del self._calls[sender]

        return release


class StrangerCalls:
    """How many calls senders outside a group's recent manifests have in flight, bounded in total.

    Anyone can make fresh keys, so per-sender places do not stop an outsider from holding every one
    of a server's waiting places with calls that wait for a round's slot, and a member's part then
    finds none. A sender that none of the group's last ``keep`` manifests names (an outsider, or a
    newcomer before its first round) shares ``limit`` places with every other such sender; members of
    those manifests are not counted. Before the first manifest every sender counts as a member: in a
    run's first round everybody is as much a member as anybody else.
    """

    def __init__(self, limit: int, keep: int = 8):
        self.limit = limit
        self.keep = keep
        self._members: dict[str, list[frozenset[str]]] = {}
        self._calls = SenderCalls(limit)
        self._lock = threading.Lock()

    def learn(self, group: str, members) -> None:
        """Remembers the members of a manifest of ``group`` this peer follows."""
        with self._lock:
            self._members[group] = (self._members.get(group, []) + [frozenset(members)])[-self.keep:]

    def admit(self, group: str, sender: str) -> Callable[[], None] | None:
        """A one-shot release of the call's place (a no-op for a known member), or None when the
        strangers' places are all taken."""
        with self._lock:
            seen = self._members.get(group)
            if not seen or any(sender in members for members in seen):
                return lambda: None
        return self._calls.admit(group)
