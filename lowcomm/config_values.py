"""How a value from a TOML file, a JSON config or a command-line override becomes a field of a config
section: typed as the field's default is, or refused with a one-line error naming the key."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which key and what is allowed."""


def apply_values(target: Any, section: str, values: dict[str, Any]) -> None:
    fields = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(fields)}")
        current = getattr(target, key)
        if current is None:  # an optional number (noloco.consensus): checked by validate()
            setattr(target, key, value)
            continue
        converted = _convert(value, current)
        if converted is None:
            expected = {list: "a list of strings", dict: "a table of strings", bool: "true or false", int: "an integer",
                        float: "a number", str: "a string"}[type(current)]
            raise ConfigError(f"{section}.{key} = {value!r}: expected {expected}")
        setattr(target, key, converted)


def _convert(value: Any, like: Any) -> Any:
    """`value` as the type of the default `like`, or None where it is not one (no bools as numbers,
    no strings as numbers, no fractions as integers)."""
    if isinstance(like, list):
        return list(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else None
    if isinstance(like, dict):
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return {str(k): v for k, v in value.items()}
        return None
    if isinstance(like, bool) or isinstance(like, str):
        return value if isinstance(value, type(like)) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(like, int):
        return int(value) if math.isfinite(value) and value == int(value) else None
    return float(value)
