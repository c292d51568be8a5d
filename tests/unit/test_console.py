"""A peer's terminal output (runtime.console): a status line in place on a terminal, throttled lines in a log."""

from __future__ import annotations

import io

from lowcomm.runtime.console import Console


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_into_a_log_a_status_line_is_written_at_most_every_interval():
    out = io.StringIO()
    console = Console(out, every_s=3600.0)
    console.status("round 1")
    console.status("round 2")  # within the interval: dropped
    console.say("done: 10 steps")
    assert out.getvalue().splitlines() == ["round 1", "done: 10 steps"]


def test_on_a_terminal_the_status_line_is_rewritten_in_place():
    out = Terminal()
    console = Console(out, every_s=3600.0)
    console.status("round 1 · long line")
    console.status("round 2")
    console.say("done")
    assert out.getvalue() == "\rround 1 · long line\rround 2" + " " * 12 + "\ndone\n"
