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
