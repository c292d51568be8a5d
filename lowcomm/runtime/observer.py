"""What a status page shows of a run, kept in one `RunView` and fed by sources.

- `DhtSource` reads the peers' DHT records (transport.control.PeerRecord, refreshed every heartbeat)
  and each live peer's stats, pulled from its data plane (transport.stats_pulls.LiveStats; from the
  DHT for a peer in client mode): the coordinator's page and `lowcomm observe`. A round is seen
  through its members' `stats.last_round`, a held-out loss when a peer's changes, an event when a
  record appears (join), leaves (leave) or expires (gone), or a counter grows (reject, resync); so
  the page shows what the DHT and the peers say at each poll, and a round shorter than a poll may be
  missed.
- `RecordsSource` tails the peers' JSONL records in a run folder (runtime.runlog): `simulate`, whose
  launcher holds every peer's records and churn's, sees every round, evaluation and event.

Everything shown is a stranger's claim to a person: the DHT records are checked by `clean_stats`,
a JSONL line that does not parse or runs past `MAX_LINE` is skipped, and every table is bounded
(`MAX_PEERS`, `MAX_ROUNDS`, `MAX_EVALS`, `MAX_EVENTS`). Nothing here feeds back into training.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lowcomm.runtime.peer_stats import finite

logger = logging.getLogger(__name__)
MAX_PEERS = 1000  # peer views kept; the longest-gone are dropped first
MAX_ROUNDS = 500
MAX_EVALS = 2000
MAX_EVENTS = 500
MAX_LINE = 1 << 20  # a JSONL line longer than this is skipped
MAX_READ = 8 << 20  # bytes read from one file per poll
QUIET_EVENTS = {"state", "ready", "metrics", "slowdown"}  # kept out of the page's event list
COORDINATOR_STATES = {"coordinator", "holder"}  # the coordinator's record: listed, not counted as a peer


@dataclass
class PeerView:
    id: str
    device: str = ""
    link: str = ""
    state: str = ""
    endpoint: str = ""
    round: int = 0
    step: int = 0
    stage: int = -1
    throughput: float = 0.0  # tokens per second of compute
    loss: float | None = None
    loss_kind: str = ""
    tokens: int = 0
    sent: int = 0
    received: int = 0
    contributed: int = 0  # rounds whose aggregate holds this peer's contribution
    participated: int = 0  # rounds it was a member of: those it contributed to and those it was left out of
    rejects: int = 0
    resyncs: int = 0
    sync_s: float = 0.0  # its latest round's
    last_seen: float = 0.0
    gone: bool = False
    gone_why: str = ""


@dataclass
class RoundView:
    round: int
    t: float
    participants: int = 0
    contributors: int = 0
    bytes: int = 0  # summed over the peers that reported the round
    sync_s: float = 0.0  # the slowest reporter's
    norm: float | None = None
    phis: set[str] = field(default_factory=set)
    reporters: set[str] = field(default_factory=set)

    def as_json(self) -> dict:
        phi = next(iter(self.phis)) if len(self.phis) == 1 else (f"split ({len(self.phis)})" if self.phis else "")
        return {"round": self.round, "t": self.t, "participants": self.participants,
                "contributors": self.contributors, "bytes": self.bytes, "sync_s": round(self.sync_s, 3),
                "norm": self.norm, "phi": phi, "reporters": len(self.reporters)}


class RunView:
    """The run as a page shows it; every method takes the lock, so sources and readers may race."""

    def __init__(self, run: str, source: str):
        self.run, self.source = run, source
        self.lock = threading.Lock()
        self.peers: dict[str, PeerView] = {}
        self.rounds: dict[int, RoundView] = {}
        self.evals: deque[dict] = deque(maxlen=MAX_EVALS)
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self.updated = 0.0

    def peer(self, peer_id: str) -> PeerView:
        view = self.peers.get(peer_id)
        if view is None:
            if len(self.peers) >= MAX_PEERS:
                oldest = min(self.peers.values(), key=lambda p: (not p.gone, p.last_seen))
                del self.peers[oldest.id]
            view = self.peers[peer_id] = PeerView(peer_id[:64])
        return view

    def event(self, t: float, kind: str, peer: str, **detail) -> None:
        if kind not in QUIET_EVENTS:
            self.events.append({"t": t, "kind": str(kind)[:32], "peer": str(peer)[:64],
                                "detail": {str(k)[:32]: v[:200] if isinstance(v, str) else v
                                           for k, v in list(detail.items())[:12]
                                           if isinstance(v, str) or finite(v) is not None}})

    def gone(self, peer: PeerView, t: float, why: str) -> None:
        if not peer.gone:
            peer.gone, peer.gone_why = True, why
            self.event(t, "gone", peer.id, why=why)

    def round_seen(self, round_: int, peer: str, t: float, participants: int, contributors: int, bytes_: int,
                   sync_s: float, norm: float | None, phi: str) -> None:
        view = self.rounds.get(round_)
        if view is None:
            if len(self.rounds) >= MAX_ROUNDS:
                del self.rounds[min(self.rounds)]
            view = self.rounds[round_] = RoundView(round_, t)
        if peer in view.reporters:
            return
        view.reporters.add(peer)
        view.participants, view.contributors = max(view.participants, participants), max(view.contributors,
                                                                                          contributors)
        view.bytes += bytes_
        view.sync_s = max(view.sync_s, finite(sync_s) or 0.0)
        view.norm = finite(norm) if finite(norm) is not None else view.norm
        if phi:
            view.phis.add(phi[:16])

    def eval_seen(self, t: float, tokens: int, loss: float) -> None:
        if finite(loss) is None:
            return
        self.evals.append({"t": t, "tokens": tokens, "bytes": sum(p.sent for p in self.peers.values()),
                           "loss": loss})

    def snapshot(self) -> dict:
        """The JSON API's answer (`/api/status`)."""
        with self.lock:
            now = time.time()
            peers = [{**asdict(p), "last_seen_s": round(max(0.0, now - p.last_seen), 1) if p.last_seen else None}
                     for p in sorted(self.peers.values(), key=lambda p: (p.gone, p.id))]
            live = [p for p in self.peers.values() if not p.gone and p.state not in COORDINATOR_STATES]
            stages: dict[int, list[str]] = {}
            for p in live:
                if p.stage >= 0:
                    stages.setdefault(p.stage, []).append(p.id)
            latest = max(self.rounds.values(), key=lambda r: r.round, default=None)
            return {
                "run": self.run, "source": self.source, "now": now, "updated": self.updated,
                "totals": {"peers_live": len(live), "peers_gone": sum(p.gone for p in self.peers.values()),
                           "round": latest.round if latest else None,
                           "tokens": sum(p.tokens for p in self.peers.values()),
                           "bytes": sum(p.sent for p in self.peers.values()),
                           "rejects": sum(p.rejects for p in self.peers.values()),
                           "resyncs": sum(p.resyncs for p in self.peers.values()),
                           "loss": self.evals[-1]["loss"] if self.evals else None},
                "peers": peers,
                "rounds": [r.as_json() for r in sorted(self.rounds.values(), key=lambda r: r.round)],
                "evals": list(self.evals),
                "stages": [{"stage": s, "peers": sorted(ids)} for s, ids in sorted(stages.items())],
                "events": list(self.events),
            }


class DhtSource:
    """The run's live peer records, read at each poll (`control`: a transport.control.ControlPlane), and
    their stats (``stats(records)``: peer id -> checked stats; by default the DHT's stats key)."""

    def __init__(self, control, view: RunView, stats=None):
        self.control, self.view = control, view
        self.stats = stats if stats is not None else lambda records: control.live_stats()
        self.live: set[str] = set()
        self.held_out: dict[str, float] = {}  # each peer's last held-out loss seen

    def poll(self) -> None:
        records = self.control.live_peers()
        every_stats = self.stats(records)
        now = time.time()
        with self.view.lock:
            view = self.view
            for peer_id, r in records.items():
                p = view.peer(peer_id)
                if peer_id not in self.live:
                    view.event(r.heartbeat, "join", peer_id, state=r.state, device=r.device)
                if r.state == "leaving" and p.state != "leaving":
                    view.event(r.heartbeat, "leave", peer_id, round=r.round)
                stats = every_stats.get(peer_id, {})
                for name in ("rejects", "resyncs"):
                    grown = int(stats.get(name, 0)) - getattr(p, name)
                    if grown > 0 and peer_id in self.live:
                        view.event(now, name[:-1], peer_id, count=grown)
                p.device, p.link, p.state, p.endpoint = r.device, r.link, r.state, r.endpoint[:128]
                p.round, p.step, p.stage, p.throughput = r.round, r.step, r.stage, r.throughput
                p.last_seen, p.gone, p.gone_why = r.heartbeat, False, ""
                if r.loss >= 0:
                    p.loss, p.loss_kind = r.loss, r.loss_kind
                for name in ("tokens", "sent", "received", "contributed", "participated", "rejects", "resyncs"):
                    setattr(p, name, int(stats.get(name, getattr(p, name))))
                last = stats.get("last_round")
                if last and "round" in last:
                    view.round_seen(int(last["round"]), peer_id, r.heartbeat, int(last.get("participants", 0)),
                                    int(last.get("contributors", 0)), int(last.get("bytes", 0)),
                                    float(last.get("sync_s", 0.0)), last.get("norm"), last.get("phi", ""))
            tokens = sum(p.tokens for p in view.peers.values())
            for peer_id, r in records.items():
                if r.loss_kind == "held-out" and self.held_out.get(peer_id) != r.loss:
                    self.held_out[peer_id] = r.loss
                    view.eval_seen(r.heartbeat, tokens, r.loss)
            for peer_id in self.live - set(records):
                if peer_id in view.peers:
                    p = view.peers[peer_id]
                    view.gone(p, now, "left" if p.state == "leaving" else "its record expired")
            self.live = set(records)
            view.updated = now


class RecordsSource:
    """The JSONL records under `folders` (a simulation's RUN_DIR/peers and RUN_DIR/launcher), tailed:
    each poll reads what was appended since the last, a torn last line waits for the next poll. Records
    older than `since` (a reused run folder's) are skipped."""

    def __init__(self, folders: list[Path], view: RunView, since: float = 0.0):
        self.folders, self.view, self.since = [Path(f) for f in folders], view, since
        self.offsets: dict[Path, int] = {}

    def poll(self) -> None:
        records = []
        for folder in self.folders:
            for path in sorted(folder.glob("*.jsonl")):
                records.extend(self._read_new(path))
        with self.view.lock:
            for record in sorted(records, key=lambda r: r["t"]):
                try:
                    self._apply(record)
                except (KeyError, TypeError, ValueError, AttributeError):
                    continue  # a record of another shape: shown nowhere
            self.view.updated = time.time()

    def _read_new(self, path: Path) -> list[dict]:
        offset = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(MAX_READ)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offsets[path] = offset + end
        out = []
        for line in data[:end].splitlines():
            if len(line) > MAX_LINE:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("t"), (int, float)) \
                    and record["t"] >= self.since and isinstance(record.get("peer"), str):
                out.append(record)
        return out

    def _apply(self, r: dict) -> None:
        view, kind, t = self.view, r["type"], float(r["t"])
        if kind == "event":
            self._event(r, t)
            return
        p = view.peer(r["peer"])
        p.last_seen = max(p.last_seen, t)
        if kind == "round":
            contributors = r.get("contributors") or []
            p.round = int(r["round"]) + 1
            p.contributed += p.id in contributors
            p.participated += p.id in (r.get("participants") or []) or p.id in contributors
            p.sync_s = finite(r.get("sync_s")) or 0.0
            view.round_seen(int(r["round"]), p.id, t, len(r.get("participants") or []), len(contributors),
                            int(r.get("bytes") or 0), p.sync_s, r.get("norm"),
                            str(r.get("phi_hash") or ""))
        elif kind == "eval":
            p.loss, p.loss_kind = finite(r["loss"]), "held-out"
            view.eval_seen(t, int(r.get("tokens") or 0), r["loss"])
        elif kind == "train":
            if p.loss_kind != "held-out":
                p.loss, p.loss_kind = finite(r["loss"]), "train"
            p.step = max(p.step, int(r.get("step") or 0))
        elif kind == "compute":
            p.step, p.tokens = int(r.get("steps") or 0), int(r.get("tokens") or 0)
            p.sent = int(r.get("bytes_sent") or 0)
            compute_s = finite(r.get("compute_s")) or 0.0
            p.throughput = p.tokens / compute_s if compute_s > 0 else 0.0

    def _event(self, r: dict, t: float) -> None:
        view, kind = self.view, str(r.get("kind"))
        by_launcher = r.get("by") == "churn"
        subject = str(r.get("peer") or "") if by_launcher else r["peer"]
        detail = {k: v for k, v in r.items() if k not in ("type", "peer", "t", "kind", "by")}
        view.event(t, "join" if kind == "start" else kind, subject, **detail)
        if not subject or subject == "coordinator":
            return
        p = view.peer(subject)
        if not by_launcher:
            p.last_seen = max(p.last_seen, t)
        if kind == "start":
            p.device, p.endpoint = str(r.get("device") or "")[:64], str(r.get("endpoint") or "")[:128]
            p.link, p.state = str(r.get("link") or "")[:64], "training"
        elif kind == "state":
            p.state = str(r.get("state") or "")[:32]
        elif kind == "stage":
            p.stage = int(r.get("stage", -1))
        elif kind == "rebalance":
            p.stage = int(r.get("stage", p.stage))
        elif kind in ("reject", "resync"):
            setattr(p, kind + "s", getattr(p, kind + "s") + 1)
        elif kind in ("kill", "leave") and by_launcher:
            view.gone(p, t, "killed" if kind == "kill" else "left")
        elif kind in ("done", "stopped", "leave"):
            p.state = kind
            view.gone(p, t, "finished" if kind == "done" else "left")


class Observer:
    """Polls its sources every `refresh_s` seconds in a daemon thread until `close()`."""

    def __init__(self, view: RunView, sources: list, refresh_s: float = 2.0):
        self.view, self.sources, self.refresh_s = view, sources, refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def poll(self) -> None:
        for source in self.sources:
            try:
                source.poll()
            except Exception as e:  # a DHT hiccup or an unreadable file: the page shows the last state
                self.failures += 1
                if self.failures in (1, 10, 100) or self.failures % 1000 == 0:
                    logger.warning("status page: could not read %s (%d failures): %s", type(source).__name__,
                                   self.failures, e)

    def start(self) -> "Observer":
        def loop():
            self.poll()
            while not self._stop.wait(self.refresh_s):
                self.poll()
        self._thread = threading.Thread(target=loop, daemon=True, name="observer")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
