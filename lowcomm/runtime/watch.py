"""Watching a run from outside it: `lowcomm status` (one table of the live records) and `lowcomm
observe` (a read-only DHT node that serves the status page until stopped)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

from lowcomm.transport.control import ControlPlane
from lowcomm.transport.identity import Identity


def print_status(coordinators: list[str], run: str) -> int:
    control = ControlPlane.start(Identity.generate(), run, initial_peers=coordinators)
    try:
        peers = control.live_peers()
        now = time.time()
        print(f"run {run}: {len(peers)} live records")
        if not peers:
            others = [name for name in control.runs_seen() if name != run]
            seen = f"runs this DHT holds: {', '.join(others)}" if others else "this DHT lists no run"
            print(f"no peer or coordinator of run {run!r} is live ({seen}); pass --run with the join "
                  "command's --run")
            return 1
        print(f"{'peer':22} {'state':12} {'round':>6} {'step':>7} {'loss':>8} {'tok/s':>9} {'age':>5}  endpoint")
        for p in sorted(peers.values(), key=lambda r: r.peer_id):
            loss = f"{p.loss:.4f}{'*' if p.loss_kind == 'train' else ' '}" if p.loss >= 0 else "n/a "
            print(f"{p.peer_id:22} {p.state:12} {p.round:>6} {p.step:>7} {loss:>8} {p.throughput:>9.0f} "
                  f"{now - p.heartbeat:>4.0f}s  {p.endpoint}{' (client mode)' if p.client_mode else ''}")
        if any(p.loss_kind == "train" for p in peers.values()):
            print("loss: the latest held-out loss; * marks a training loss (no held-out evaluation yet)")
    finally:
        control.shutdown()
    return 0


def observe_until_stopped(coordinators: list[str], run: str, open_page: Callable[[ControlPlane], object]) -> int:
    """Joins the DHT as a node that trains nothing, opens the page `open_page(control)` returns and
    serves it until Ctrl-C or SIGTERM."""
    control = ControlPlane.start(Identity.generate(), run, initial_peers=coordinators)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        page = open_page(control)
        print(f"observing run {run}; Ctrl-C stops", file=sys.stderr, flush=True)
        try:
            while not stop.wait(1.0):
                pass
        finally:
            page.close()
    finally:
        control.shutdown()
    return 0
