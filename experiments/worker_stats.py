"""What a sync worker measures of its own process over a round: its peak resident memory (with what glibc's
malloc held at that peak) and its threads' CPU by name (experiments/sync_worker.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from lowcomm.collectives.allocator import heap_stats, resident_bytes


def thread_cpu() -> dict[str, list[float]]:
    """CPU seconds [user, system] this process's threads used so far, by thread name (gRPC's event engine
    apart from the Python threads)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for task in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{task}/stat").read_text()
        except OSError:
            continue  # the thread ended
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        used = out.setdefault(name, [0.0, 0.0])
        used[0], used[1] = used[0] + int(fields[11]) / tick, used[1] + int(fields[12]) / tick
    return out


class PeakRss:
    """The most resident memory this process held while inside the block (sampled every 5 ms), and what
    glibc's malloc held at that moment (``at_peak``: in its arenas, free in them, mapped on its own)."""

    def __enter__(self):
        self.peak, self._stop = resident_bytes(), threading.Event()
        self.at_peak = heap_stats()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            rss = resident_bytes()
            if rss > self.peak:
                self.peak, self.at_peak = rss, heap_stats()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())
