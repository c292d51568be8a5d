"""What a peer says on its terminal: one status line that updates in place, and a summary at the end.

On a terminal the line is rewritten in place; into a file or a pipe (simulate's logs, systemd's
journal) a line is written at most every `every_s` seconds, so a log stays readable.
"""

from __future__ import annotations

import sys
import time


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Console:
    def __init__(self, stream=None, every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s
        self._last = float("-inf")
        self._width = 0

    def say(self, line: str) -> None:
        """A line of its own (a join, a resync, the summary)."""
        self._end_status()
        print(line, file=self.stream, flush=True)

    def status(self, line: str) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self.stream.flush()
            self._width = len(line)
        elif now - self._last >= self.every_s:
            print(line, file=self.stream, flush=True)
            self._last = now

    def _end_status(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
