"""What one peer has done so far, summed from the records it writes: a RunLog sink (runtime.runlog).

    stats = PeerStats(me, traffic)          # traffic: the process's byte counters (None: from the records)
    log = RunLog(path, me, sinks=[stats.observe])
    stats.summary()                         # small, plain numbers: the stats it publishes (RUN.stats), /metrics

Every peer kind writes the same record types (runtime.peer, runtime.stage_peer): `compute` records
carry the cumulative steps, tokens and bytes sent, `round` records each applied round, `eval` the
held-out loss, `train` a training loss, and `event` records the rejects, resyncs and the start. The
records are this process's own, but a field of an unexpected type is skipped, never raised on.
"""

from __future__ import annotations

import math
import threading
from typing import Any

PHI_CHARS = 16  # a φ hash is shown, not checked: its first 16 hex digits tell replicas apart


def finite(value: Any) -> float | None:
    """`value` as a finite float, None if it is not a number (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> int | None:
    number = finite(value)
    return int(number) if number is not None and number >= 0 else None


class PeerStats:
    """A thread-safe accumulator of one peer's records; `observe` is the RunLog sink."""

    def __init__(self, peer_id: str, traffic=None):
        self.peer_id = peer_id
        self.traffic = traffic  # transport.wire.Traffic; None: bytes from the compute records
        self._lock = threading.Lock()
        self.steps = 0
        self.tokens = 0
        self.train_loss: float | None = None
        self.held_out_loss: float | None = None
        self.round = 0  # rounds of global state held: the latest applied round + 1, or a downloaded state's
        self.contributed = 0  # applied rounds whose contributors include this peer
        self.participated = 0  # applied rounds whose members include this peer (contributed or left out)
        self.rejects = 0
        self.resyncs = 0
        self.sync_s = 0.0
        self._sent = 0  # from the compute records, when there is no Traffic
        self._checkpoint_sent = 0
        self.last_round: dict = {}
        self.info = {"algo": "", "device": ""}  # from the start event

    # ---- records in ------------------------------------------------------------------------

    def observe(self, record: dict) -> None:
        """One record as RunLog writes it (a dict with "type")."""
        kind = record.get("type")
        with self._lock:
            if kind == "compute":
                self._compute(record)
            elif kind == "round":
                self._round(record)
            elif kind == "eval":
                loss = finite(record.get("loss"))
                self.held_out_loss = loss if loss is not None else self.held_out_loss
            elif kind == "train":
                self._train(record)
            elif kind == "event":
                self._event(record)

    def _compute(self, r: dict) -> None:
        self.steps = max(self.steps, _count(r.get("steps")) or 0)
        self.tokens = max(self.tokens, _count(r.get("tokens")) or 0)
        self._sent = max(self._sent, _count(r.get("bytes_sent")) or 0)
        self._checkpoint_sent = max(self._checkpoint_sent, _count(r.get("checkpoint_bytes")) or 0)
        self._train_loss(r)  # where a compute record carries the latest training loss

    def _train(self, r: dict) -> None:
        self._train_loss(r)
        self.steps = max(self.steps, _count(r.get("step")) or 0)

    def _train_loss(self, r: dict) -> None:
        loss = finite(r.get("loss"))
        if loss is not None:
            self.train_loss = loss

    def _round(self, r: dict) -> None:
        round_ = _count(r.get("round"))
        if round_ is None:
            return
        participants = r.get("participants") if isinstance(r.get("participants"), list) else []
        contributors = r.get("contributors") if isinstance(r.get("contributors"), list) else []
        sync_s = max(finite(r.get("sync_s")) or 0.0, 0.0)
        self.round = round_ + 1
        self.contributed += self.peer_id in contributors
        self.participated += self.peer_id in participants or self.peer_id in contributors
        self.sync_s += sync_s
        self.last_round = {"round": round_, "participants": len(participants), "contributors": len(contributors),
                           "bytes": _count(r.get("bytes")) or 0, "sync_s": round(sync_s, 3),
                           "phi": str(r.get("phi_hash") or "")[:PHI_CHARS]}
        norm = finite(r.get("norm"))
        if norm is not None and norm >= 0:
            self.last_round["norm"] = round(norm, 6)

    def _event(self, r: dict) -> None:
        kind = r.get("kind")
        if kind == "reject":
            self.rejects += 1
        elif kind == "resync":
            self.resyncs += 1
        elif kind == "state_received" and _count(r.get("round")) is not None:
            self.round = _count(r["round"])  # a downloaded state: the rounds it holds
        elif kind == "start":
            self.info = {name: str(r.get(name) or "")[:64] for name in ("algo", "device")}

    # ---- numbers out -----------------------------------------------------------------------

    def bytes(self) -> dict[str, int]:
        """Data-plane bytes sent and received, and checkpoint bytes sent: live from Traffic when there is one."""
        t = self.traffic
        if t is not None:
            return {"sent": int(t.sent), "received": int(t.received), "checkpoint_sent": int(t.checkpoint_sent)}
        with self._lock:
            return {"sent": self._sent, "received": 0, "checkpoint_sent": self._checkpoint_sent}

    def summary(self) -> dict:
        """Plain JSON numbers (and the last round's short φ hash) small enough for a DHT record."""
        traffic = self.bytes()
        with self._lock:
            return self._summary(traffic)

    def _summary(self, traffic: dict[str, int]) -> dict:
        return {"tokens": self.tokens, "steps": self.steps, "sent": traffic["sent"], "received": traffic["received"],
                "rejects": self.rejects, "resyncs": self.resyncs, "contributed": self.contributed,
                "participated": self.participated,
                "sync_s": round(self.sync_s, 3), "last_round": dict(self.last_round)}

    def snapshot(self) -> dict:
        """What /metrics shows (runtime.metrics): the summary, checkpoint bytes, the losses, the round held and
        the start's labels, read at one moment."""
        traffic = self.bytes()
        with self._lock:
            return {**self._summary(traffic), "checkpoint_sent": traffic["checkpoint_sent"],
                    "train_loss": self.train_loss, "held_out_loss": self.held_out_loss, "round": self.round,
                    "info": dict(self.info)}
