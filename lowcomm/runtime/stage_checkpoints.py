"""Stage checkpoints for the restart baseline (`pipeline.recovery = "checkpoint"`).

Every `pipeline.checkpoint_every_rounds` rounds, each stage's round leader writes that stage's full
state (the same safetensors blob it serves to movers) to `<dir>/stage-<s>-r<round>.safetensors`,
atomically. The folder stands for storage every peer can reach (simulate's run folder; a bucket in a
real deployment). A restart uses the newest round for which every stage has a file, so the restored
pipeline is one consistent model: a stage keeps its newest KEEP files and every file from that
round on (a stage that is down writes nothing, so the others must not prune the round it has), and
from the round a restart pinned on (the other stages load theirs two rounds later).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

KEEP = 3
_NAME = re.compile(r"^stage-(\d+)-r(\d+)\.safetensors$")
_PIN = re.compile(r"^pinned-r(\d+)$")


class StageCheckpoints:
    def __init__(self, folder: Path, stages: int):
        self.folder, self.stages = folder, stages

    def path(self, stage: int, round_: int) -> Path:
        return self.folder / f"stage-{stage}-r{round_}.safetensors"

    def write(self, stage: int, round_: int, blob: bytes) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(stage, round_)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        floors = [r for r in (self.consistent_round(), self.pinned()) if r is not None]
        for old in self.rounds(stage)[:-KEEP]:
            if floors and old < min(floors):
                self.path(stage, old).unlink(missing_ok=True)
        return path

    def pin(self, round_: int) -> None:
        """A restart is loading `round_`: no stage may prune it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"pinned-r{round_}").touch()

    def pinned(self) -> int | None:
        if not self.folder.is_dir():
            return None
        found = [int(m[1]) for m in (_PIN.match(p.name) for p in self.folder.iterdir()) if m]
        return max(found) if found else None

    def rounds(self, stage: int) -> list[int]:
        """The rounds stage `stage` has a checkpoint of, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.folder.iterdir())
        return sorted(int(m[2]) for m in found if m and int(m[1]) == stage)

    def consistent_round(self) -> int | None:
        """The newest round every stage has a checkpoint of (None if there is none)."""
        common = set(self.rounds(0))
        for stage in range(1, self.stages):
            common &= set(self.rounds(stage))
        return max(common) if common else None
