"""A peer's record in the DHT (`RUN.peers`): what it says about itself, as stored and as read back."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hivemind.utils import get_dht_time

from lowcomm.transport.join_token import MAX_TOKEN_CHARS
from lowcomm.transport.record_fields import short_label

ALWAYS_STORED = ("peer_id", "endpoint", "heartbeat")  # a peer record's fields stored even at their defaults
MAX_COUNT = 1 << 62  # a round or step past this is no run's: refused (a state request could not even carry it)


@dataclass
class PeerRecord:
    """What a peer says about itself; it expires unless refreshed by heartbeats. Stored as ``value()``:
    the fields that differ from their defaults, so a data-parallel peer's record carries no pipeline
    fields (``from_value`` gives a missing field its default)."""

    peer_id: str
    endpoint: str
    state: str = "joining"  # parked (simulate: started, not yet in the run) | joining | training | leaving
    device: str = "cpu"
    throughput: float = 0.0  # tokens per second of compute, measured
    round: int = 0  # rounds of global state this peer holds
    step: int = 0
    loss: float = -1.0  # the peer's latest held-out loss, else its latest training loss (-1: none yet)
    loss_kind: str = ""  # "held-out" | "train" | ""
    client_mode: bool = False
    heartbeat: float = field(default_factory=get_dht_time)
    # pipelines (runtime.stage_peer): the stage served (-1: none), whether it serves it yet
    # (joining | online), its last gradient norm (CheckFree's weights) and when its driver finished
    stage: int = -1
    stage_state: str = ""
    grad_norm: float = 0.0
    done_at: float = 0.0
    rollback_to: int = -1  # the restart baseline: every stage loads its checkpoint of this round ...
    rollback_at: int = -1  # ... before this round
    token: str = ""  # token runs: the coordinator's join token for this peer (transport.join_token)
    link: str = ""  # its emulated or declared access link, e.g. "20mbit:80ms" ("": none)

    def value(self) -> dict[str, Any]:
        """What is stored: ``peer_id``, ``endpoint``, ``heartbeat`` and every other field not at its default."""
        return {name: v for name, v in asdict(self).items()
                if name in ALWAYS_STORED or v != self.__dataclass_fields__[name].default}

    @classmethod
    def from_value(cls, value: Any) -> "PeerRecord":
        if not isinstance(value, dict):
            raise ValueError("peer record is not a dict")
        known = {k: value[k] for k in cls.__dataclass_fields__ if k in value}
        record = cls(**known)
        if not isinstance(record.peer_id, str) or not isinstance(record.endpoint, str):
            raise ValueError("peer record has no peer_id or endpoint")
        try:  # int(inf) raises OverflowError
            record.round, record.step, record.stage = int(record.round), int(record.step), int(record.stage)
            record.rollback_to, record.rollback_at = int(record.rollback_to), int(record.rollback_at)
        except OverflowError:
            raise ValueError("peer record holds a non-finite count") from None
        if not all(0 <= n < MAX_COUNT for n in (record.round, record.step)):
            raise ValueError("peer record holds a round or step out of range")
        record.throughput, record.grad_norm, record.done_at = (float(record.throughput), float(record.grad_norm),
                                                               float(record.done_at))
        record.loss, record.loss_kind = float(record.loss), str(record.loss_kind)[:16]
        record.heartbeat = float(record.heartbeat)
        record.state, record.stage_state = short_label(record.state), short_label(record.stage_state)
        record.device, record.link = short_label(record.device), short_label(record.link)
        if not isinstance(record.token, str) or len(record.token) > MAX_TOKEN_CHARS:
            raise ValueError("peer record's token is not a string of a join token's size")
        if not all(map(math.isfinite, (record.throughput, record.grad_norm, record.done_at, record.loss,
                                       record.heartbeat))):
            raise ValueError("peer record holds a non-finite number")
        return record
