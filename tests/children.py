"""Helpers for tests that start and watch child processes: a bounded wait on a condition, the
SIGINT disposition a child needs to see Ctrl-C, lookups in the peers' records, and reading a
status page the children serve."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request


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


# ---- a status page served on this machine (runtime.dashboard) --------------------------------

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page_get(url: str) -> bytes | None:
    """The body at `url`; None while nothing listens there yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read()
    except OSError:
        return None


def page_status(url: str) -> dict | None:
    """The status page's JSON (`url` is the page's, ending in /); None while it does not answer."""
    body = page_get(url + "api/status")
    return json.loads(body) if body else None
