"""Checks of what a peer says about itself in its DHT records: short printable labels and its stats.
A record is a stranger's claim: it is shown, never trusted."""

from __future__ import annotations

import math
from typing import Any

STATS_NUMBERS = ("tokens", "steps", "sent", "received", "rejects", "resyncs", "contributed", "participated",
                 "sync_s")
LAST_ROUND_NUMBERS = ("round", "participants", "contributors", "bytes", "sync_s", "norm")
MAX_PHI_CHARS = 64


def short_label(value: Any, limit: int = 64) -> str:
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise ValueError("peer record holds a label that is not a short printable string")
    return value


def clean_stats(value: Any) -> dict:
    """A peer record's `stats`: the known keys only, finite non-negative numbers, a short φ hash; a
    ValueError for anything else (a record is a stranger's claim: it is shown, never trusted)."""
    if not isinstance(value, dict):
        raise ValueError("peer record's stats is not a dict")

    def numbers(table: dict, names: tuple[str, ...]) -> dict:
        out = {}
        for name in names:
            if name in table:
                number = table[name]
                if isinstance(number, bool) or not isinstance(number, (int, float)) \
                        or not math.isfinite(number) or not 0 <= number < 1e18:
                    raise ValueError(f"peer record's stats.{name} is not a finite non-negative number")
                out[name] = number
        return out

    stats = numbers(value, STATS_NUMBERS)
    last = value.get("last_round", {})
    if not isinstance(last, dict):
        raise ValueError("peer record's stats.last_round is not a dict")
    if last:
        stats["last_round"] = numbers(last, LAST_ROUND_NUMBERS)
        phi = last.get("phi", "")
        stats["last_round"]["phi"] = short_label(phi, MAX_PHI_CHARS) if phi else ""
    return stats
