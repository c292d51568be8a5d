"""Defaults in one truth: the embedded default.toml lists every field of every section, with the
value its component's dataclass holds, so a run loaded from it and a dataclass built bare agree."""

import dataclasses
import tomllib
from importlib import resources

import pytest

from lowcomm.config import RunConfig

TOML = tomllib.loads(resources.files("lowcomm").joinpath("configs/default.toml").read_text())
SECTIONS = {f.name: f.default_factory() for f in dataclasses.fields(RunConfig)}
OPTIONAL = {("noloco", "consensus")}  # None in the dataclass: TOML has no null, so the file shows it commented out


def test_default_toml_has_exactly_the_run_configs_sections():
    assert set(TOML) == set(SECTIONS)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_field_of_a_section_is_in_default_toml_with_the_dataclass_default(section):
    defaults = dataclasses.asdict(SECTIONS[section])
    listed = TOML[section]
    assert set(listed) - set(defaults) == set(), f"[{section}] in default.toml has keys its dataclass lacks"
    missing = {key for key in defaults if key not in listed and (section, key) not in OPTIONAL}
    assert missing == set(), f"[{section}] in default.toml does not list {sorted(missing)}"
    for key, value in listed.items():
        assert value == defaults[key] and type(value) is type(defaults[key]) or \
            isinstance(defaults[key], float) and isinstance(value, int) and value == defaults[key], \
            f"{section}.{key}: default.toml says {value!r}, the dataclass {defaults[key]!r}"
    for section_name, key in OPTIONAL:
        if section_name == section:
            assert defaults[key] is None


def test_the_loaded_default_run_equals_the_bare_dataclasses():
    from lowcomm.config import default_config

    assert default_config() == RunConfig()
