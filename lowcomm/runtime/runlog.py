"""Per-peer JSONL records (rounds, evals, events, compute), appended and flushed as they happen,
so a killed peer's work still counts in the simulation report."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class RunLog:
    def __init__(self, path: Path | None, peer_id: str):
        self.peer_id = peer_id
        self.path = path
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
