"""Run config loading and the freshness of the checked-in protobuf modules."""

import filecmp
from pathlib import Path

import pytest

from lowcomm.config import ConfigError, RunConfig, default_config, load_config
from lowcomm.proto import regenerate


def test_default_config_is_the_reference_setup():
    c = default_config()
    assert (c.model.vocab_size, c.model.d_model, c.model.n_layers, c.model.n_heads, c.model.context) == (256, 128, 4, 4, 64)
    assert (c.inner.batch_size, c.inner.lr, c.inner.warmup_steps, c.inner.weight_decay) == (16, 1e-3, 50, 0.1)
    assert (c.diloco.inner_steps, c.diloco.outer_lr, c.diloco.outer_momentum) == (30, 0.7, 0.9)


def test_config_round_trips_through_json_with_the_same_hash():
    c = default_config().override({"run.steps": 7, "diloco.codec": "fp32"})
    again = RunConfig.from_json(c.to_json())
    assert again == c and again.config_hash() == c.config_hash()
    assert again.config_hash() != default_config().config_hash()


@pytest.mark.parametrize("text, field", [("[run]\nalgo = 'nope'\n", "run.algo"),
                                          ("[model]\nd_modle = 3\n", "model.d_modle"),
                                          ("[inner]\nlr = 'fast'\n", "inner.lr"),
                                          ("[bogus]\nx = 1\n", "bogus")])
def test_bad_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field.split(".")[-1]):
        load_config(path)


def test_checked_in_protos_are_fresh(tmp_path):
    regenerate.generate(tmp_path)
    for name in ("wire_pb2.py", "wire_pb2_grpc.py"):
        fresh = tmp_path / "lowcomm" / "proto" / name
        checked_in = Path(regenerate.__file__).parent / name
        assert filecmp.cmp(fresh, checked_in, shallow=False), f"{name} is stale: run python -m lowcomm.proto.regenerate"


def test_streaming_section_parses_and_defines_the_rounds(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[run]\nalgo = 'streaming-diloco'\nsteps = 120\n[diloco]\ninner_steps = 30\n"
                    "[streaming]\nfragments = 4\nfragment_sync_delay = 3\nalpha = 0.5\ncodec = 'fp8'\n")
    c = load_config(path)
    assert (c.streaming.fragments, c.streaming.fragment_sync_delay, c.streaming.alpha, c.streaming.codec) == \
        (4, 3, 0.5, "fp8")
    assert c.streaming_run and c.steps_per_sync == 30
    assert c.total_rounds == 16  # 4 fragment rounds per 30 steps, the last one starting at step 120
    assert [c.step_after_rounds(r) for r in range(5)] == [0, 10, 17, 24, 33]  # round r−1 started + τ
    plain = c.override({"run.algo": "diloco"})
    assert plain.total_rounds == 4 and [plain.step_after_rounds(r) for r in range(3)] == [0, 30, 60]
    assert default_config().streaming.codec == "uint8" and default_config().streaming.alpha == 0.0


@pytest.mark.parametrize("overrides, key", [
    ({"streaming.fragment_sync_delay": 15}, "fragment_sync_delay"),  # τ must be < ⌊30/2⌋
    ({"streaming.fragments": 5}, "fragments"),  # more fragments than the 4 transformer blocks
    ({"streaming.codec": "q2"}, "codec"),
    ({"streaming.alpha": 1.5}, "alpha")])
def test_bad_streaming_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        default_config().override({"run.algo": "streaming-diloco", **overrides})


def test_cli_simulate_accepts_streaming_diloco():
    from lowcomm.cli import build_parser

    args = build_parser().parse_args(["simulate", "--algo", "streaming-diloco", "--fragments", "4", "--codec", "fp8"])
    assert (args.algo, args.fragments, args.codec) == ("streaming-diloco", 4, "fp8")


def test_noloco_section_defaults_and_validation():
    c = default_config().override({"run.algo": "noloco"})
    n = c.noloco
    assert (n.group_size, n.outer_lr, n.momentum, n.gamma, n.codec) == (2, 0.7, 0.5, 0.7, "fp32")
    assert c.steps_per_sync == n.inner_steps == c.diloco.inner_steps  # round for round with diloco
    assert c.override({"noloco.inner_steps": 7}).steps_per_sync == 7
    assert c.override({"noloco.consensus": 0.25}).noloco.gamma == 0.25
    for key, value in (("noloco.codec", "q2"), ("noloco.group_size", 0), ("noloco.momentum", 1.0),
                       ("noloco.consensus", -1.0)):
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            c.override({key: value})
