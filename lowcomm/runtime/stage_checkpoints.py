"""Stage checkpoints for the restart baseline (`pipeline.recovery = "checkpoint"`).

Every `pipeline.checkpoint_every_rounds` rounds, each stage's round leader writes that stage's full
state (the same safetensors blob it serves to movers) to `<dir>/stage-<s>-r<round>.safetensors`,
atomically, keeping the newest KEEP per stage. The folder stands for storage every peer can reach
(simulate's run folder; a bucket in a real deployment). A restart uses the newest round for which
every stage has a file, so the restored pipeline is one consistent model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

KEEP = 3
_NAME = re.compile(r"^stage-(\d+)-r(\d+)\.safetensors$")


class StageCheckpoints:
    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, stage: int, round_: int) -> Path:
        return self.folder / f"stage-{stage}-r{round_}.safetensors"

    def write(self, stage: int, round_: int, blob: bytes) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(stage, round_)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        for old in self.rounds(stage)[:-KEEP]:
            self.path(stage, old).unlink(missing_ok=True)
        return path

    def rounds(self, stage: int) -> list[int]:
        """The rounds stage `stage` has a checkpoint of, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.folder.iterdir())
        return sorted(int(m[2]) for m in found if m and int(m[1]) == stage)

    def consistent_round(self, stages: int) -> int | None:
        """The newest round every stage has a checkpoint of (None if there is none)."""
        common = set(self.rounds(0))
        for stage in range(1, stages):
            common &= set(self.rounds(stage))
        return max(common) if common else None
