"""Link emulation inside the data plane: a peer's upload and download rate and its one-way latency.

`--link 100mbit:40ms` gives every peer a LinkShaper (BENCHMARKS.md, "How to emulate the internet
on one machine"); the transport (wire.Traffic) passes every gRPC message the peer sends or
receives through it. The model, stated so reports can be checked against it:

- **Rate.** Each direction is a token bucket kept as a virtual clock: a message reserves the next
  `size / rate` seconds of its direction after whatever was committed before it, and is handed on
  when that slot ends (when its last byte would have crossed the link). An idle bucket holds at
  most BURST_S (10 ms) of credit, so a message larger than that still passes only at the rate.
  Reservations are made under a lock and waited out without it, so concurrent senders share the
  rate fairly in arrival order.
- **Latency** is the sending peer's egress delay (as `netem` on each host's egress would do): a
  message from A to B arrives A's latency after its slot ends, and the round trip between A and B
  is the sum of their latencies. It is pipelined: nothing is held while latency is waited out, so
  concurrent messages overlap their latency, and a flow (one stream, or one unary message) pays it
  once, at its first message. Later messages of the flow are reserved in the flow's own timeline,
  which runs one latency behind real time, so they arrive back to back at the rate, as chunks do
  on a wire. (A stream that pauses mid-way for an outside event would lose that message's latency;
  lowcomm's streams produce their chunks on demand and never do.)
- **Download.** The receiver cannot see when a message's first byte reached it. It assumes the
  message was arriving for at most its own transfer time, and not before its flow started waiting
  for it, so a shaped uplink feeding a shaped downlink overlaps (cut-through) instead of adding a
  store-and-forward delay per message. After an idle spell, one message from a sender faster than
  this downlink can therefore arrive early; everything after it is paced.

- **Latency only.** The rate `unlimited` (e.g. `unlimited:40ms`) paces nothing and only delays:
  `simulate --netns` gives peers this form, because there the kernel's htb caps are the rate (the
  `netem` qdisc that could add latency in the kernel is not available).

Every wait ends at the caller's deadline (monotonic seconds) when one is given, and at `close()`.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)

BURST_S = 0.010  # the bucket holds at most this much traffic
ACCEPTED_FORMS = ("RATE[:LATENCY], e.g. '100mbit:40ms', '20mbit', '1gbit:5ms', '500kbit', '10MB:0.1s'; "
                  "RATE is a number with a unit: bit, kbit, mbit, gbit (bits/s, powers of 1000) or "
                  "B, KB, MB, GB (bytes/s, powers of 1000), KiB, MiB, GiB (bytes/s, powers of 1024), "
                  "optionally followed by '/s', or 'unlimited' (latency only, e.g. 'unlimited:40ms'); "
                  "LATENCY is a number with a unit: us, ms or s")

_BIT_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_BYTE_UNITS = {"B": 8, "KB": 8e3, "kB": 8e3, "MB": 8e6, "GB": 8e9, "KiB": 8 * 1024, "MiB": 8 * 1024 ** 2,
               "GiB": 8 * 1024 ** 3}
_LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
UNLIMITED = "unlimited"  # a rate that paces nothing: the link only adds latency


@dataclass
class LinkConfig:
    """The [link] section: emulated access links for `simulate`, as RATE[:LATENCY] specs ("" = unshaped).

        [link]
        default = "100mbit:40ms"   # every peer's link (`simulate --link` overrides this)
        [link.peers]               # exceptions, by simulate peer index (0 .. peers-1)
        0 = "20mbit:80ms"

    A peer joining by hand sets its own link with `peer join --link`; the run's [link] does not
    shape volunteers. `netns = true` (`simulate --netns`) runs every process in its own network
    namespace: each RATE becomes the kernel's htb cap on that peer's link, LATENCY stays in the
    peer's application shaper (which then paces nothing), and a peer with no RATE is uncapped.
    """

    default: str = ""
    peers: dict[str, str] = field(default_factory=dict)
    netns: bool = False

    def spec_for(self, index: int) -> str:
        """The link spec of simulate's peer `index` ("" for an unshaped link)."""
        spec = self.peers.get(str(index), self.default).strip()
        return "" if spec.lower() in ("none", "off") else spec


@dataclass(frozen=True)
class LinkSpec:
    """One peer's access link: the same rate each way, plus a one-way (egress) latency."""

    rate_bits: float  # bits per second, each direction
    latency_s: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bits / 8

    def __str__(self) -> str:
        if math.isinf(self.rate_bits):
            return UNLIMITED if self.latency_s == 0 else f"{UNLIMITED}:{self.latency_s * 1e3:.10g}ms"
        rate = next((f"{self.rate_bits / scale:.10g}{unit}" for unit, scale in (("gbit", 1e9), ("mbit", 1e6),
                                                                               ("kbit", 1e3))
                     if self.rate_bits >= scale), f"{self.rate_bits:.10g}bit")
        return rate if self.latency_s == 0 else f"{rate}:{self.latency_s * 1e3:.10g}ms"


def parse_link(text: str) -> LinkSpec:
    """`RATE[:LATENCY]` as a LinkSpec; ValueError naming the accepted forms otherwise."""
    rate_text, _, latency_text = str(text).strip().partition(":")
    rate = _parse_rate(rate_text.strip(), text)
    latency = _parse_latency(latency_text.strip(), text) if latency_text.strip() else 0.0
    return LinkSpec(rate, latency)


def parse_link_option(text: str | None) -> LinkSpec | None:
    """Like parse_link, but '', 'none' and 'off' (and None) mean an unshaped link."""
    if text is None or str(text).strip().lower() in ("", "none", "off"):
        return None
    return parse_link(text)


def _parse_rate(text: str, whole: str) -> float:
    if text.lower() == UNLIMITED:
        return math.inf
    match = re.fullmatch(_NUMBER + r"\s*([A-Za-z]+)(/s)?", text)
    if not match:
        raise ValueError(f"link {whole!r}: cannot read the rate {text!r}; use {ACCEPTED_FORMS}")
    number, unit = float(match.group(1)), match.group(2)
    if unit.lower() in _BIT_UNITS:
        bits = number * _BIT_UNITS[unit.lower()]
    elif unit in _BYTE_UNITS:
        bits = number * _BYTE_UNITS[unit]
    elif unit.lower() in ("bps", "kbps", "mbps", "gbps", "b", "kb", "mb", "gb"):
        prefix = re.sub(r"b(ps)?$", "", unit.lower())
        raise ValueError(f"link {whole!r}: {unit!r} is ambiguous (bits or bytes per second?); write "
                         f"{match.group(1)}{prefix}bit for bits or {match.group(1)}{prefix.upper()}B for bytes; "
                         f"accepted: {ACCEPTED_FORMS}")
    else:
        raise ValueError(f"link {whole!r}: unknown rate unit {unit!r}; use {ACCEPTED_FORMS}")
    if not bits > 0 or math.isinf(bits):
        raise ValueError(f"link {whole!r}: the rate must be positive and finite; use {ACCEPTED_FORMS}")
    return bits


def _parse_latency(text: str, whole: str) -> float:
    match = re.fullmatch(_NUMBER + r"\s*(us|ms|s)", text)
    if not match:
        raise ValueError(f"link {whole!r}: cannot read the latency {text!r} (a number and a unit); "
                         f"use {ACCEPTED_FORMS}")
    return float(match.group(1)) * _LATENCY_UNITS[match.group(2)]


class _Bucket:
    """One direction's virtual clock: the time up to which its bandwidth is committed."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self._committed = -math.inf
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, earliest: float) -> float:
        """Commits `nbytes` in the first free slot at or after `earliest`; returns the slot's end."""
        if math.isinf(self.bytes_per_s):
            return earliest  # an unlimited direction never delays (and commits nothing)
        with self._lock:
            start = max(self._committed, earliest)
            self._committed = start + nbytes / self.bytes_per_s
            return self._committed


class LinkShaper:
    """The emulated link of one peer; thread-safe. One flow per stream direction (or unary message)."""

    def __init__(self, spec: LinkSpec, burst_s: float = BURST_S, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.burst_s = burst_s
        self.clock = clock
        self.upload = _Bucket(spec.bytes_per_s)
        self.download = _Bucket(spec.bytes_per_s)
        self._closed = threading.Event()
        logger.info("emulating a %s link (each way), bucket of %.0f ms", spec, burst_s * 1e3)

    def sender(self) -> "SendFlow":
        return SendFlow(self)

    def receiver(self) -> "ReceiveFlow":
        return ReceiveFlow(self, self.clock())

    def close(self) -> None:
        """Releases every waiter at once (the peer is leaving); later waits return immediately."""
        self._closed.set()

    def wait_until(self, t: float, deadline: float | None) -> bool:
        """Sleeps until `t` (monotonic), the deadline or close(); True when `t` was reached."""
        end = t if deadline is None else min(t, deadline)
        while not self._closed.is_set():
            remaining = end - self.clock()
            if remaining <= 0:
                break
            self._closed.wait(remaining)
        return self.clock() >= t


class SendFlow:
    """The messages of one outgoing stream, in order; used by one thread at a time."""

    def __init__(self, shaper: LinkShaper):
        self._shaper = shaper
        self._lag = 0.0  # how far this flow's timeline runs behind real time: its latency, once started

    def schedule(self, nbytes: int, now: float) -> float:
        """When a message of `nbytes` that is ready at `now` may be handed on."""
        s = self._shaper
        ready = now - self._lag  # in the flow's own timeline
        slot_end = s.upload.reserve(nbytes, ready - s.burst_s)
        self._lag = s.spec.latency_s
        return max(slot_end, ready) + s.spec.latency_s  # burst credit never shortens the latency

    def send(self, nbytes: int, deadline: float | None = None) -> bool:
        """Blocks until the message has crossed the link (or the deadline); True if it made it in time."""
        return self._shaper.wait_until(self.schedule(nbytes, self._shaper.clock()), deadline)


class ReceiveFlow:
    """The messages of one incoming stream, in order; used by one thread at a time."""

    def __init__(self, shaper: LinkShaper, waiting_since: float):
        self._shaper = shaper
        self._waiting_since = waiting_since

    def schedule(self, nbytes: int, now: float) -> float:
        """When a message of `nbytes` that arrived at `now` may be handed to the application."""
        s = self._shaper
        transfer_s = nbytes / s.download.bytes_per_s
        earliest = max(self._waiting_since - s.burst_s, now - transfer_s)
        release = s.download.reserve(nbytes, earliest)
        self._waiting_since = max(release, now)
        return release

    def receive(self, nbytes: int, deadline: float | None = None) -> bool:
        """Blocks until the message has come down the link (or the deadline); True if it made it in time."""
        return self._shaper.wait_until(self.schedule(nbytes, self._shaper.clock()), deadline)
