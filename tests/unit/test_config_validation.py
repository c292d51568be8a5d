"""Values that cannot run are refused with one line that names the key and says what is allowed."""

import dataclasses
import math

import pytest

from lowcomm.config import RANGES, ConfigError, RunConfig, default_config, load_config


def refusal(overrides: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        default_config().override(overrides)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("key, value, allowed", [
    ("sparseloco.topk", 63, "even"),  # the codec would quietly send 62 (k pairs share 3 bytes of indices)
    ("sparseloco.topk", 0, "[2, sparseloco.chunk² = 4096]"),
    ("sparseloco.topk", 4098, "[2, sparseloco.chunk² = 4096]"),  # more than a 64x64 chunk holds
    ("inner.lr", -1, "> 0"),
    ("sync.reduce_timeout_s", -3, "> 0"),
    ("demo.topk", 4097, "[1, demo.chunk² = 4096]"),
    ("sparseloco.chunk", 1, "[2, "),
])
def test_the_reported_gaps_are_refused(key, value, allowed):
    message = refusal({key: value})
    assert message.startswith(f"{key} = {value!r}") and allowed in message


def test_topk_fits_the_chunk_it_is_given():
    c = default_config().override({"sparseloco.chunk": 8, "sparseloco.topk": 64, "demo.chunk": 4, "demo.topk": 16})
    assert (c.sparseloco.topk, c.demo.topk) == (64, 16)
    assert "sparseloco.chunk² = 16" in refusal({"sparseloco.chunk": 4, "sparseloco.topk": 18})


def bad_values(key: str) -> list:
    """Values just outside what RANGES allows for `key`, plus the non-finite floats."""
    allowed, _ = RANGES[key]
    section, _, name = key.partition(".")
    default = getattr(RunConfig(), section).__dict__[name]
    candidates = [-1, 0, 1, 2, 0.5, 1.5, -0.5, 10 ** 9] if isinstance(default, float) else [-1, 0, 1, 2, 10 ** 9]
    bad = [v for v in candidates if not allowed(v)]
    if isinstance(default, float):
        bad += [math.nan, math.inf, -math.inf]
    return bad


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_numeric_field_refuses_what_is_outside_its_range(key):
    bad = bad_values(key)
    assert bad, f"{key}: no value outside its range was tried"
    for value in bad:
        message = refusal({key: value})
        assert message.startswith(f"{key} = ")


def test_every_numeric_field_has_a_range():
    numeric = {f"{section}.{name}" for section, values in RunConfig().to_dict().items()
               for name, value in values.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert numeric - set(RANGES) == {"sparseloco.topk", "demo.topk"}  # bounded by their chunk: tested above


@pytest.mark.parametrize("key, value, expected", [
    ("inner.lr", True, "a number"),  # TOML booleans are not numbers
    ("inner.lr", "1e-3", "a number"),  # nor are strings
    ("run.steps", "600", "an integer"),
    ("run.steps", 2.5, "an integer"),
    ("diloco.nesterov", 1, "true or false"),
    ("run.name", 3, "a string"),
])
def test_wrong_types_are_refused_by_name(key, value, expected):
    message = refusal({key: value})
    assert message == f"{key} = {value!r}: expected {expected}"


def test_a_file_with_a_negative_timeout_is_refused(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[sync]\nreduce_timeout_s = -3\n")
    with pytest.raises(ConfigError, match=r"^sync.reduce_timeout_s = -3.0: must be > 0$"):
        load_config(path)


def test_the_defaults_and_integral_floats_pass():
    c = default_config().override({"run.steps": 60.0, "inner.lr": 1})
    assert c.run.steps == 60 and isinstance(c.run.steps, int) and c.inner.lr == 1.0
    assert dataclasses.asdict(default_config()) == dataclasses.asdict(RunConfig())
