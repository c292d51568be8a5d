"""Helpers for tests that start and watch child processes: a bounded wait on a condition, the
SIGINT disposition a child needs to see Ctrl-C, and lookups in the peers' records."""

from __future__ import annotations

import signal
import time


def wait_until(predicate, timeout: float, what: str, poll_s: float = 0.2):
    """The first truthy value of ``predicate()``, polled until ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout}s")
        time.sleep(poll_s)


def default_sigint() -> None:
    """A child of a shell that started this run in the background inherits SIGINT ignored, and
    Python then never raises KeyboardInterrupt: give the child the default disposition back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def events(records: list[dict], kind: str, peer: str | None = None) -> list[dict]:
    """The event records of ``kind`` (of one peer when given), in record order."""
    return [r for r in records if r["type"] == "event" and r.get("kind") == kind and (peer is None or r["peer"] == peer)]


def rounds_of(records: list[dict]) -> dict[int, list[dict]]:
    """Every peer's round records, by round."""
    by_round: dict[int, list[dict]] = {}
    for r in records:
        if r["type"] == "round":
            by_round.setdefault(r["round"], []).append(r)
    return by_round


def small_diloco_toml(inner_steps: int, rounds: int, eval_every_tokens: int, checkpoint_every_rounds: int) -> str:
    """A DiLoCo run of `rounds` short rounds with tight sync deadlines, as a config file for the command line."""
    return f"""
[run]
steps = {inner_steps * rounds}
[diloco]
inner_steps = {inner_steps}
[data]
eval_every_tokens = {eval_every_tokens}
[sync]
reduce_timeout_s = 8.0
announce_s = 3.0
manifest_s = 3.0
[checkpoint]
every_rounds = {checkpoint_every_rounds}
"""
