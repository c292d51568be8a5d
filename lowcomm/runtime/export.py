"""`lowcomm export CHECKPOINT OUT`: the trained model out of a coordinator's checkpoint.

OUT gets `model.safetensors` (the global parameters under the model's own parameter names, float32)
and `config.json` (the model section, the run config it was trained with and where it came from).
`load_exported(OUT)` builds the model class back from the two (the built-in GPT, or the
`[model] factory`'s model, whose module must then be importable). A checkpoint holds the algorithm's
state: φ (`phi.*`, the round-based algorithms) or the parameters themselves (`param.*`, ddp and
DeMo); optimizer state is left behind. Pipelined runs keep stage checkpoints instead and are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from torch import nn

from lowcomm.config import ConfigError, RunConfig
from lowcomm.models.factory import build_model
from lowcomm.models.gpt import ModelConfig
from lowcomm.runtime.checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint

MODEL_FILE, EXPORT_CONFIG = "model.safetensors", "config.json"
PREFIXES = ("phi.", "param.")


def checkpoint_config(folder: Path) -> RunConfig | None:
    """The run config a checkpoint was written with (its config.json), or None when it has none."""
    path = Path(folder) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        return RunConfig.from_json(path.read_text())
    except (OSError, ConfigError) as e:
        raise CheckpointError(f"{path} is not a run config ({e}); pass the run's --config instead") from None


def export_checkpoint(checkpoint: Path, out: Path, config: RunConfig | None = None) -> Path:
    """Writes OUT/model.safetensors and OUT/config.json from the newest complete checkpoint under CHECKPOINT."""
    snapshot, folder = load_checkpoint(checkpoint, with_folder=True)
    config = config or checkpoint_config(folder)
    if config is None:
        raise CheckpointError(f"{folder} holds no config.json; pass the run's config with --config run.toml")
    if config.config_hash() != snapshot.config_hash:
        raise CheckpointError(f"{folder} is for config {snapshot.config_hash}, the config given is "
                              f"{config.config_hash()}; pass the --config the run was started with")
    if config.pipelined:
        raise CheckpointError("a pipelined run keeps stage checkpoints (runtime.stage_checkpoints); export "
                              "takes a coordinator's checkpoint of a run without stages")
    shapes = {name: tuple(p.shape) for name, p in build_model(config.model).named_parameters()}
    params = _parameters(snapshot.blob, shapes, folder)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(params, str(out / MODEL_FILE))
    meta = {"model": dataclasses.asdict(config.model), "run": json.loads(config.to_json()),
            "round": snapshot.round, "tokens": snapshot.tokens, "config_hash": snapshot.config_hash,
            "phi_hash": snapshot.phi_hash}
    tmp = out / (EXPORT_CONFIG + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / EXPORT_CONFIG)
    return out


def load_exported(folder: Path) -> nn.Module:
    """The model class with the exported parameters in it (on the CPU, float32)."""
    folder = Path(folder)
    meta = json.loads((folder / EXPORT_CONFIG).read_text())
    model = build_model(ModelConfig(**meta["model"]))
    tensors = load_file(str(folder / MODEL_FILE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, the model {tuple(p.shape)}")
            p.copy_(tensors[name])
    return model


def _parameters(blob: bytes, shapes: dict[str, tuple[int, ...]], folder: Path) -> dict[str, torch.Tensor]:
    """The model's parameters from a checkpoint's state: each present, of its shape, float32 and finite."""
    try:
        state = st_load(blob)
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise CheckpointError(f"{folder}: the state is not a safetensors file ({e})") from None
    prefix = next((p for p in PREFIXES if any(k.startswith(p) for k in state)), None)
    if prefix is None:
        raise CheckpointError(f"{folder}: the state holds no model parameters (phi.* or param.*)")
    out = {}
    for name, shape in shapes.items():
        t = state.get(prefix + name)
        if t is None or tuple(t.shape) != shape or t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{folder}: {prefix}{name} is missing, not {shape} float32, or not finite; "
                                  "the checkpoint is not of this run's model")
        out[name] = t.contiguous()
    return out
