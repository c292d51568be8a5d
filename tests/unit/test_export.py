"""`lowcomm export`: a coordinator's checkpoint → model.safetensors + config.json, loadable into the model class."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.cli import main
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import LocalGroup
from lowcomm.config import default_config
from lowcomm.models.gpt import GPT
from lowcomm.runtime.checkpoint import CheckpointError, save_checkpoint
from lowcomm.runtime.export import export_checkpoint, load_exported
from lowcomm.runtime.state_transfer import encode_state
from lowcomm.transport.identity import Identity

SMALL = {"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 2, "model.context": 16}


def _checkpoint(tmp_path, config, with_config: bool = True):
    """A DiLoCo replica's state after training moved θ away from φ_0, saved as the coordinator does."""
    torch.manual_seed(1)
    model = GPT(config.model)
    replica = DiLoCo(model, config.diloco, LocalGroup(1).member(0), GroupKey("run"))
    with torch.no_grad():
        for p in replica.phi:
            p.add_(torch.randn_like(p))  # φ differs from the model's own initial weights
    snapshot = encode_state(replica.state_tensors(), 7, 1234, config.config_hash(), replica.phi_hash())
    root = save_checkpoint(tmp_path / "checkpoints", snapshot, config_json=config.to_json() if with_config else None)
    return replica, root.parent


def test_an_exported_model_loads_back_with_the_global_parameters(tmp_path):
    config = default_config().override(SMALL)
    replica, checkpoints = _checkpoint(tmp_path, config)
    out = export_checkpoint(checkpoints, tmp_path / "model")
    model = load_exported(out)
    for (name, p), phi in zip(model.named_parameters(), replica.phi):
        assert torch.equal(p.detach(), phi.detach()), name
    meta = json.loads((out / "config.json").read_text())
    assert meta["round"] == 7 and meta["config_hash"] == config.config_hash()
    assert meta["model"]["d_model"] == 32
    logits, _ = model(torch.zeros(1, 4, dtype=torch.int64))
    assert logits.shape == (1, 4, config.model.vocab_size)


def test_export_without_the_checkpoints_config_needs_the_runs_and_refuses_another(tmp_path):
    config = default_config().override(SMALL)
    _, checkpoints = _checkpoint(tmp_path, config, with_config=False)
    with pytest.raises(CheckpointError, match="--config"):
        export_checkpoint(checkpoints, tmp_path / "a")
    with pytest.raises(CheckpointError, match="is for config"):
        export_checkpoint(checkpoints, tmp_path / "b", default_config())
    assert export_checkpoint(checkpoints, tmp_path / "c", config).exists()


def test_the_cli_exports_and_says_what_to_do_when_it_cannot(tmp_path, capsys):
    config = default_config().override(SMALL)
    _, checkpoints = _checkpoint(tmp_path, config)
    assert main(["export", str(checkpoints), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowcomm: export: no complete checkpoint")


def test_a_checkpoint_that_is_not_this_model_is_refused(tmp_path):
    config = default_config().override(SMALL)
    other = default_config().override({**SMALL, "model.d_model": 64, "model.n_heads": 4})
    _, checkpoints = _checkpoint(tmp_path, other, with_config=False)
    (next(checkpoints.glob("round-*")) / "meta.json").write_text(json.dumps(
        {"round": 7, "tokens": 0, "config_hash": config.config_hash(), "phi_hash": ""}))
    with pytest.raises(CheckpointError, match="not of this run's model"):
        export_checkpoint(checkpoints, tmp_path / "x", config)


def test_the_coordinators_key_is_owner_only(tmp_path):
    Identity.load_or_create(tmp_path / "coordinator.key")
    mode = stat.S_IMODE(os.stat(tmp_path / "coordinator.key").st_mode)
    assert mode == 0o600
