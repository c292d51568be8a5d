"""`[model] factory = "package.module:callable"`: a user's model built on every peer from the same seed,
loading errors in one line, and the export of such a model loaded back through the factory."""

from __future__ import annotations

import textwrap

import pytest
import torch

from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.local import LocalGroup
from lowcomm.config import ConfigError, default_config
from lowcomm.models.factory import ModelFactoryError, build_model
from lowcomm.models.gpt import GPT, ModelConfig
from lowcomm.runtime.checkpoint import save_checkpoint
from lowcomm.runtime.export import export_checkpoint, load_exported
from lowcomm.runtime.sim import Simulation
from lowcomm.runtime.state_transfer import encode_state

MODULE = textwrap.dedent('''
    import torch
    from torch import nn

    class BagLM(nn.Module):
        def __init__(self, vocab, width):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.out = nn.Linear(width, vocab)

        def forward(self, x):
            return self.out(torch.tanh(self.embed(x)))

    def build(config):
        return BagLM(config.vocab_size, config.d_model)

    def returns_a_string(config):
        return "a model"

    def frozen(config):
        return nn.Linear(2, 2).requires_grad_(False)

    def raises(config):
        raise RuntimeError("no GPU here")

    class Nested:
        @staticmethod
        def build(config):
            return BagLM(config.vocab_size, 8)

    NOT_CALLABLE = 3
''')


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    package = tmp_path / "mylab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(MODULE)
    (package / "broken.py").write_text("raise ImportError('needs flash-attn')\n")
    (package / "crashes.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mylab.models"


def test_the_factory_builds_the_same_weights_on_every_peer(user_models):
    config = ModelConfig(factory=f"{user_models}:build", d_model=16)
    a, b = build_model(config, seed=3), build_model(config, seed=3)
    assert type(a).__name__ == "BagLM" and a.embed.weight.shape == (256, 16)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(build_model(config, seed=4).embed.weight, a.embed.weight)
    assert type(build_model(ModelConfig(factory=f"{user_models}:Nested.build"))).__name__ == "BagLM"
    assert isinstance(build_model(ModelConfig()), GPT)  # "" is the built-in GPT


@pytest.mark.parametrize("spec, expected", [
    ("mylab.nowhere:build", "cannot import 'mylab.nowhere'"),
    ("mylab.broken:build", "needs flash-attn"),
    ("mylab.crashes:build", "importing 'mylab.crashes' failed: ZeroDivisionError"),
    ("mylab.models:missing", "has no 'missing'"),
    ("mylab.models:NOT_CALLABLE", "is a int, not a callable"),
    ("mylab.models:returns_a_string", "returned a str; it must return a torch.nn.Module"),
    ("mylab.models:frozen", "no trainable parameters"),
    ("mylab.models:raises", "raised RuntimeError: no GPU here"),
])
def test_a_factory_that_cannot_build_a_model_is_one_line(user_models, spec, expected):
    with pytest.raises(ModelFactoryError) as error:
        build_model(ModelConfig(factory=spec))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_the_run_config_checks_the_factorys_form_and_refuses_it_in_pipelines():
    base = default_config()
    for spec in ("mylab.models", "mylab/models.py:build", ":build", "mylab.models:"):
        with pytest.raises(ConfigError, match="package.module:callable"):
            base.override({"model.factory": spec})
    with pytest.raises(ConfigError, match="pipelines cut the built-in GPT only"):
        base.override({"model.factory": "mylab.models:build", "pipeline.stages": 2})
    # the module is imported where the model is built, not where the config is read (the coordinator)
    assert base.override({"model.factory": "not.installed.here:build"}).model.factory


def test_simulate_checks_the_factory_and_the_data_before_any_process(user_models, tmp_path):
    config = default_config().override({"model.factory": "mylab.nowhere:build"})
    with pytest.raises(ConfigError, match="cannot import"):
        Simulation(config, 2, tmp_path / "run").check_model_and_data()
    config = default_config().override({"data.corpus": "tokens", "data.path": str(tmp_path / "none.bin")})
    with pytest.raises(ConfigError, match="does not exist"):
        Simulation(config, 2, tmp_path / "run").check_model_and_data()


def test_an_exported_factory_model_loads_back_through_the_factory(user_models, tmp_path):
    config = default_config().override({"model.factory": f"{user_models}:build", "model.d_model": 16})
    model = build_model(config.model, seed=0)
    replica = DiLoCo(model, config.diloco, LocalGroup(1).member(0), GroupKey("run"))
    with torch.no_grad():
        for p in replica.phi:
            p.add_(1.0)
    snapshot = encode_state(replica.state_tensors(), 3, 100, config.config_hash(), replica.phi_hash())
    root = save_checkpoint(tmp_path / "checkpoints", snapshot, config_json=config.to_json())
    loaded = load_exported(export_checkpoint(root.parent, tmp_path / "out"))
    assert type(loaded).__name__ == "BagLM"
    for p, phi in zip(loaded.parameters(), replica.phi):
        assert torch.equal(p.detach(), phi.detach())



@pytest.mark.parametrize("factory", ["", "build"])
def test_a_seeded_build_is_the_seeds_model_and_leaves_the_callers_rng_alone(user_models, factory):
    import importlib
    config = ModelConfig(factory=f"{user_models}:{factory}" if factory else "", d_model=16, n_layers=1, n_heads=2)
    build = importlib.import_module(user_models).build if factory else GPT
    torch.manual_seed(7)
    reference = build(config)  # the seed's model: built right after torch.manual_seed
    torch.manual_seed(99)
    state = torch.get_rng_state()
    model = build_model(config, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG goes on where it was
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
