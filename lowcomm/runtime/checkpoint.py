"""Checkpoints of the global model: φ and the outer optimizer state in safetensors, plus a small JSON.

Written atomically (temp file, fsync, rename) so a crash never leaves a half-written checkpoint;
the newest `keep` are kept. Each holds the run config it belongs to (`config.json`), so
`lowcomm export` can rebuild the model from the folder alone. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from lowcomm.runtime.state_transfer import Snapshot


@dataclass
class CheckpointConfig:
    """The [checkpoint] section: how often the coordinator checkpoints the global model, how many it keeps."""

    every_rounds: int = 5  # 0: never
    every_s: float = 600.0  # and at least this long after the last one (0: rounds alone)
    max_share: float = 0.05  # and only while the downloads stay within this share of the run's bytes (0: no cap)
    keep: int = 3  # the newest this many are kept


CONFIG_FILE = "config.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for."""


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: Path, snapshot: Snapshot, keep: int = 3, config_json: str | None = None) -> Path:
    root = Path(root)
    final = root / f"round-{snapshot.round:06d}"
    staging = root / f".round-{snapshot.round:06d}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _atomic_write(staging / "state.safetensors", snapshot.blob)
    meta = {"round": snapshot.round, "tokens": snapshot.tokens, "config_hash": snapshot.config_hash,
            "phi_hash": snapshot.phi_hash}
    _atomic_write(staging / "meta.json", json.dumps(meta, indent=1).encode())
    if config_json is not None:
        _atomic_write(staging / CONFIG_FILE, config_json.encode())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in sorted(root.glob("round-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(root: Path, with_folder: bool = False):
    """The newest complete checkpoint under `root` (a run's checkpoint folder or one round folder);
    with `with_folder`, (the snapshot, its round folder)."""
    root = Path(root)
    candidates = [root] if (root / "meta.json").exists() else sorted(root.glob("round-*"), reverse=True)
    for folder in candidates:
        try:
            meta = json.loads((folder / "meta.json").read_text())
            blob = (folder / "state.safetensors").read_bytes()
            snapshot = Snapshot(int(meta["round"]), int(meta.get("tokens", 0)), str(meta["config_hash"]),
                                str(meta.get("phi_hash", "")), blob)
            return (snapshot, folder) if with_folder else snapshot
        except (OSError, ValueError, KeyError):
            continue
    raise CheckpointError(f"no complete checkpoint under {root}; name the checkpoints folder of a "
                          "`lowcomm coordinator start` run dir (it holds round-NNNNNN/ folders), or one of those")
