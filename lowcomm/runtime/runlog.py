"""Per-peer JSONL records (rounds, evals, events, compute), appended and flushed as they happen,
so a killed peer's work still counts in the simulation report.

Sinks (callables taking the record dict, such as runtime.peer_stats.PeerStats.observe) see every
record after it is written, with or without a file. A sink that raises is logged once and never
stops the record, the other sinks or the caller.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)
COORDINATOR_CALLS_FILE = "coordinator-calls.json"  # in the run dir: the coordinator's DHT calls, as it stopped


class RunLog:
    def __init__(self, path: Path | None, peer_id: str, sinks: list[Callable[[dict], None]] | None = None):
        self.peer_id = peer_id
        self.path = path
        self.sinks = list(sinks or [])
        self._failed: set[int] = set()  # ids of the sinks whose failure was logged
        self._lock = threading.Lock()
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, type_: str, **fields) -> None:
        record = {"type": type_, "peer": self.peer_id, "t": time.time(), **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
                os.fsync(self._file.fileno())
        for sink in self.sinks:
            self._feed(sink, record)

    def _feed(self, sink: Callable[[dict], None], record: dict) -> None:
        try:
            sink(record)
        except Exception:
            if id(sink) not in self._failed:
                self._failed.add(id(sink))
                logger.exception("a run log sink failed on a %s record; its later failures are not logged",
                                 record.get("type"))

    def event(self, kind: str, **fields) -> None:
        self.write("event", kind=kind, **fields)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_records(folder: Path) -> list[dict]:
    """Every record of every peer log under `folder`, skipping a torn last line of a killed peer."""
    records = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
