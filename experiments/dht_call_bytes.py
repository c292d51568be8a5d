"""What one DHT call of lowcomm's control plane puts on the wire, by kind and by replica count.

    sudo python experiments/dht_call_bytes.py [--nodes 5] [--replicas 5 3] [--cache on off]
        [--mode searched direct] [--transport tcp] [--spacing-s 0] [--calls 20] [--out experiments/out/dht_call_bytes]

A row is one replica count (hivemind's `num_replicas`), caching (hivemind's `cache_locally`;
lowcomm's are transport.control.DHT_TRAFFIC's) and mode: ``searched`` searches the key's nodes at
every store (as hivemind's store does), ``direct`` stores straight to the nodes the last search of
the key found (transport.dht_stores, lowcomm's); reads are hivemind's in both. --nodes DHT nodes (transport.control.ControlPlane, each with its own identity and p2pd) start in one
network namespace created for the row (and deleted after it), every node stores its peer record and
its announcement of a round and reads both keys once (as every peer of a run does), then one node makes --calls calls of each kind.
``store new key`` stores under a key nobody stored before (as a round's manifest and anchor are: always
a search, in both modes); ``get one record`` reads a key that holds one record (a manifest's). The kernel's count of
the bytes sent on the namespace's loopback, less the idle rate measured first, divided by the calls,
is a call's cost: every byte between the nodes, each counted once. Unlike experiments/dht_cost.py (one
kind of call per node, each in a namespace of its own), every node here has read the keys first, as
in a run, which is what decides how many nodes answer a search with them when they keep copies.
``--transport tcp`` (the default) starts the nodes as a run does, on TCP; ``quic`` adds a QUIC
multiaddr of each node (`/udp/PORT/quic-v1`), which libp2p then dials (tried and withdrawn,
docs/round-protocol.md, Decision 57). ``--spacing-s S``
waits S seconds after each call, as a run spaces its calls: back to back, the RPCs' frames share TCP
segments and ACKs that spaced calls each send on their own. A row whose JSON exists under
--out is skipped (resumable per row); OUT/table.md is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

KINDS = ["get peers", "get announce", "store peers", "store announce", "store new key", "get one record"]
IDLE_S = 10.0  # the idle rate's window, by default (--idle-s)


def _lo_sent() -> int:
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


def measure(nodes: int, replicas: int, calls: int, cache: bool, mode: str, idle_s: float = IDLE_S,
            transport: str = "tcp", spacing_s: float = 0.0) -> dict:
    """Runs inside the row's namespace: bytes per call of each kind."""
    from lowcomm.transport import control, dht_stores
    from lowcomm.transport.control import ControlPlane, PeerRecord
    from lowcomm.transport.identity import Identity

    if transport == "quic":  # each TCP multiaddr with a QUIC one beside it
        tcp_only = control.dht_maddrs
        control.dht_maddrs = lambda *a: tuple(
            m and [x for tcp in m for x in (tcp, tcp.replace("/tcp/", "/udp/") + "/quic-v1")] for m in tcp_only(*a))

    control.DHT_TRAFFIC.update(num_replicas=replicas, cache_locally=cache)
    if mode == "searched":  # the DHT's processes are forked from this one: they search at every store
        dht_stores.NEAREST_MAX_AGE_S = -1.0
    ids = [Identity.generate() for _ in range(nodes)]
    planes = [ControlPlane.start(ids[0], "probe")]
    planes += [ControlPlane.start(i, "probe", initial_peers=planes[0].visible_maddrs()) for i in ids[1:]]
    try:
        for plane, identity in zip(planes, ids):
            plane.publish_peer(PeerRecord(identity.peer_id, "10.0.0.1:5000", state="training", round=3), 60)
            plane.announce("0-0", 3, {"endpoint": "10.0.0.1:5000"}, 60)
        planes[0].announce("0-0", 2, {"endpoint": "10.0.0.1:5000"}, 60)  # a key of one record (a manifest's)
        for plane in planes:  # every node reads every key, as in a run (each keeps what it read, if it caches)
            plane.live_peers(), plane.announcers("0-0", 3)
        sent = _lo_sent()
        time.sleep(idle_s)  # a measurement window, not a wait for anything
        idle = (_lo_sent() - sent) / idle_s
        me, who = planes[1], ids[1]
        fresh = iter(range(100, 100 + calls))
        actions = {"get peers": me.live_peers, "get announce": lambda: me.announcers("0-0", 3),
                   "store peers": lambda: me.publish_peer(PeerRecord(who.peer_id, "10.0.0.1:5000",
                                                                     state="training", round=4), 60),
                   "store announce": lambda: me.announce("0-0", 4, {"endpoint": "10.0.0.1:5000"}, 60),
                   "store new key": lambda: me.announce("0-0", next(fresh), {"endpoint": "10.0.0.1:5000"}, 60),
                   "get one record": lambda: me.announcers("0-0", 2)}
        out = {"nodes": nodes, "replicas": replicas, "cache": cache, "mode": mode, "calls": calls,
               "transport": transport, "spacing_s": spacing_s, "idle_bytes_per_s": idle}
        for kind in KINDS:
            sent, started = _lo_sent(), time.monotonic()
            for _ in range(calls):
                actions[kind]()
                time.sleep(spacing_s)  # the shape of a run's traffic, not a wait for anything
            out[kind] = (_lo_sent() - sent - idle * (time.monotonic() - started)) / calls
        return out
    finally:
        for plane in planes:
            plane.shutdown()


def run_row(nodes: int, replicas: int, cache: bool, mode: str, calls: int, idle_s: float = IDLE_S,
            transport: str = "tcp", spacing_s: float = 0.0) -> dict:
    ns = f"lcdht-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, "--inside", "--nodes",
                               str(nodes), "--replicas", str(replicas), "--cache", "on" if cache else "off",
                               "--mode", mode, "--calls", str(calls), "--idle-s", str(idle_s),
                               "--transport", transport, "--spacing-s", str(spacing_s)],
                              capture_output=True, text=True, timeout=600, start_new_session=True)
        if done.returncode != 0:
            raise SystemExit(f"row replicas={replicas} failed: {done.stderr.strip().splitlines()[-1:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:  # whatever still runs in the namespace (p2pd after a timeout), then the namespace
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], check=False)


def write_table(out: Path, rows: list[dict]) -> None:
    lines = ["| DHT nodes | replicas | cache_locally | mode | transport | spacing s | "
             + " | ".join(f"{k} (KB)" for k in KINDS) + " | idle (B/s) |",
             "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in KINDS) + " | --- |"]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['replicas']} | {'on' if r['cache'] else 'off'} | {r['mode']} | "
                     f"{r.get('transport', 'tcp')} | {r.get('spacing_s', 0.0):g} | "
                     + " | ".join(f"{max(r[k], 0.0) / 1e3:.1f}" for k in KINDS)  # less the idle rate: ~0 can dip below
                     + f" | {r['idle_bytes_per_s']:.0f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--replicas", type=int, nargs="+", default=[5, 3])
    parser.add_argument("--cache", choices=["on", "off"], nargs="+", default=["on", "off"],
                        help="hivemind's cache_locally: a node keeps what it read and answers searches with it")
    parser.add_argument("--mode", choices=["searched", "direct"], nargs="+", default=["searched", "direct"],
                        help="searched: every store searches the key's nodes (hivemind's); "
                             "direct: stores straight to the nodes the last search found (lowcomm's)")
    parser.add_argument("--transport", choices=["tcp", "quic"], nargs="+", default=["tcp"],
                        help="tcp: the nodes listen on TCP, as in a run; quic: on QUIC beside it (libp2p dials QUIC)")
    parser.add_argument("--spacing-s", type=float, default=0.0, help="a wait after each call, as a run spaces them")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--idle-s", type=float, default=IDLE_S, help="how long the idle rate is measured first")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "dht_call_bytes")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        print(json.dumps(measure(args.nodes, args.replicas[0], args.calls, args.cache[0] == "on", args.mode[0], args.idle_s,
                                 args.transport[0], args.spacing_s)))
        return
    if os.geteuid() != 0:
        raise SystemExit("this creates a network namespace: run it as root (sudo python experiments/dht_call_bytes.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, cells = [], [(r, c == "on", s, t) for r in args.replicas for c in args.cache for s in args.mode
                       for t in args.transport]
    for i, (replicas, cache, mode, transport) in enumerate(cells):
        path = args.out / (f"n{args.nodes}-r{replicas}-{'cache' if cache else 'nocache'}-{mode}-c{args.calls}"
                           f"-{transport}-s{args.spacing_s:g}.json")
        if not path.exists():
            print(f"[{i + 1}/{len(cells)}] {args.nodes} nodes, {replicas} replicas, cache_locally "
                  f"{'on' if cache else 'off'}, {mode}, {transport}", flush=True)
            path.write_text(json.dumps(run_row(args.nodes, replicas, cache, mode, args.calls, args.idle_s,
                                               transport, args.spacing_s)))
        rows.append(json.loads(path.read_text()))
        write_table(args.out, rows)
    print((args.out / "table.md").read_text())


if __name__ == "__main__":
    main()
