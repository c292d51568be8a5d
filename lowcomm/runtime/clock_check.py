"""Whether this machine's clock agrees with the coordinator's (docs/ASSUMPTIONS.md, "Clocks").

DHT records expire by the clocks of the nodes that hold and read them. A peer whose clock runs behind
by more than its records' lifetime (`sync.record_ttl_s`) has them expire on arrival; one whose clock
runs ahead by more than `transport.control.CLOCK_AHEAD_S` has them refused as claiming too long a life.
Either way the other peers do not see it, and nothing tells it so. The coordinator's record carries
the time it was stored at by the coordinator's clock (`heartbeat`), at most a record lifetime before
it is read, which bounds this clock's offset from both sides: a joiner checks it once and warns.
"""

from __future__ import annotations

from lowcomm.transport.control import CLOCK_AHEAD_S, PeerRecord

FIX = "synchronise this machine's clock (NTP, e.g. `timedatectl set-ntp true`) and join again"


def clock_warning(coordinator: PeerRecord | None, now: float, ttl: float) -> str | None:
    """One line saying what to do when this clock (``now``) is certainly more than half a record lifetime
    behind the coordinator's, or more than half the allowance ahead; None when it may be right."""
    if coordinator is None:
        return None
    lag = now - coordinator.heartbeat  # this clock's offset plus the record's age, which is 0 to ttl
    if lag < -ttl / 2:
        return (f"this machine's clock runs at least {-lag:.0f} s behind the coordinator's, so its DHT records "
                f"expire early and the other peers may not see it; {FIX}")
    if lag - ttl > CLOCK_AHEAD_S / 2:
        return (f"this machine's clock runs at least {lag - ttl:.0f} s ahead of the coordinator's; past "
                f"{CLOCK_AHEAD_S:.0f} s the other peers refuse its DHT records; {FIX}")
    return None
