"""What one DHT call costs on the wire: 5 hivemind DHT nodes (lowcomm's ControlPlane) in network namespaces.

    sudo python experiments/dht_cost.py [--nodes 5] [--calls idle store get announce] [--warmup-s 25]
        [--window-s 40] [--p2p NAME:KEY=VALUE,... ...] [--out experiments/out/dht_cost]

Node 0 bootstraps the DHT and only idles; nodes 1..N-1 each make one call per second of one kind
and nothing else: `store` refreshes the node's peer record under the run's peers key (a heartbeat),
`get` reads that key (every node's record, merged from every node: the read agreement makes),
`announce` stores an announcement under a new round key each time, `idle` makes no call. The kernel
counts the bytes each namespace sends on the DHT's plane (the lab's htb control class) over
--window-s seconds after --warmup-s; per call is what all nodes sent per second (a call's own bytes
and the answers to it) less the idle row's, over the calls per second. Start-up is what all nodes
sent from the first node's launch to the window's start.

``--p2p base: autonat-off:auto_nat=false`` runs each kind once per variant, with those options of
hivemind's P2P daemon (hivemind.P2P.create: auto_nat, nat_port_map, use_relay, dht_mode, ...) added
to the DHT's (transport.control.DHT_TRAFFIC); values are JSON (true, false, 5) or else strings. Each kind is one row, resumable (OUT/<kind>.json); OUT/table.md is rewritten
after every row. Must run as root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.transport.netns import NetnsLab  # noqa: E402
from simulate_launch import save_table  # noqa: E402  (beside this script)

READY_S = 120.0  # the bootstrap node's address must appear within this
NODE = """
import sys, time
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity
host, boot, kind, out, life_s = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
import json
from lowcomm.transport import control
control.DHT_TRAFFIC.update(json.loads(sys.argv[6]))
identity = Identity.generate()
plane = ControlPlane.start(identity, "cost", initial_peers=[boot] if boot != "-" else None, host=host)
if boot == "-":
    open(out + ".tmp", "w").write(plane.visible_maddrs()[0])
    import os; os.replace(out + ".tmp", out)
record = PeerRecord(identity.peer_id, host + ":5000", state="training")
plane.publish_peer(record, 10.0)
start, n = time.monotonic(), 0
while time.monotonic() - start < life_s:
    if kind == "store":
        plane.publish_peer(record, 10.0)
    elif kind == "get":
        plane.live_peers()
    elif kind == "announce":
        plane.announce("0-0", n, {"endpoint": host + ":5000", "client_mode": False}, 30.0)
    n += 1
    time.sleep(max(0.0, start + n - time.monotonic()))
plane.shutdown()
"""


def parse_p2p(items: list[str]) -> dict[str, dict]:
    """NAME or NAME:KEY=VALUE,... items -> {NAME: {KEY: VALUE}} (VALUE as JSON, else the string)."""
    out = {}
    for item in items:
        name, _, settings = item.partition(":")
        options = {}
        for setting in filter(None, settings.split(",")):
            key, eq, value = setting.partition("=")
            if not eq or not key:
                raise SystemExit(f"--p2p takes NAME:KEY=VALUE,..., e.g. autonat-off:auto_nat=false (got {item!r})")
            try:
                options[key] = json.loads(value)
            except ValueError:
                options[key] = value
        out[name] = options
    return out


def measure(kind: str, args, options: dict) -> dict:
    with NetnsLab() as lab:
        nodes = [lab.add_node(f"n{i}") for i in range(args.nodes)]
        life_s = args.warmup_s + args.window_s + 30
        boot_file = args.out / f".{kind}.boot"
        boot_file.unlink(missing_ok=True)
        procs = []
        try:
            def start(node, boot, node_kind, out):
                cmd = node.wrap([sys.executable, "-c", NODE, node.control_address, boot, node_kind, out, str(life_s),
                                 json.dumps(options)])
                procs.append(subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            launched = [n.class_bytes()["control"]["tx"] for n in nodes]
            start(nodes[0], "-", "idle", str(boot_file))
            deadline = time.monotonic() + READY_S
            while not boot_file.exists():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise SystemExit("the bootstrap DHT node did not start; see that p2pd runs in a namespace")
                time.sleep(0.2)
            for node in nodes[1:]:
                start(node, boot_file.read_text(), kind, "/dev/null")
            print(f"{kind}: warming up {args.warmup_s:.0f} s, then counting {args.window_s:.0f} s", flush=True)
            time.sleep(args.warmup_s)
            before = [n.class_bytes()["control"]["tx"] for n in nodes]
            time.sleep(args.window_s)
            after = [n.class_bytes()["control"]["tx"] for n in nodes]
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            boot_file.unlink(missing_ok=True)
    per_s = [(b - a) / args.window_s for a, b in zip(before, after)]
    return {"kind": kind, "nodes": args.nodes, "window_s": args.window_s, "bootstrap_B_s": per_s[0],
            "callers_B_s": sum(per_s[1:]) / (args.nodes - 1), "per_node_B_s": per_s, "p2p": options,
            "startup_bytes": sum(b - a for a, b in zip(launched, before)), "warmup_s": args.warmup_s}


def row_name(kind: str, variant: str) -> str:
    return kind if variant == "base" else f"{kind}-{variant}"


def table(rows: dict[str, dict], planned: list[tuple[str, str]], args) -> str:
    lines = [f"{args.nodes} DHT nodes in network namespaces, uncapped; nodes 1..{args.nodes - 1} make one call a "
             f"second each, node 0 idles; bytes sent on the DHT's plane over {args.window_s:.0f} s. Per call: "
             "what all the nodes sent (callers and answerers), less the same P2P options' idle row's, over the "
             f"calls made. Start-up: what all the nodes sent from the first one's launch to {args.warmup_s:.0f} s "
             "later.", "",
             "| calls | P2P options | bytes/s per calling node | bytes/s of node 0 | wire bytes per call | start-up KB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind, variant in planned:
        r = rows.get(row_name(kind, variant))
        if r is None:
            continue
        idle_row = rows.get(row_name("idle", variant))
        idle = sum(idle_row["per_node_B_s"]) if idle_row is not None else None
        per_call = (f"{(sum(r['per_node_B_s']) - idle) / (args.nodes - 1) / 1e3:.1f} KB"
                    if idle is not None and kind != "idle" else "")
        options = ", ".join(f"{k}={v}" for k, v in r.get("p2p", {}).items()) or "hivemind's"
        startup = f"{r['startup_bytes'] / 1e3:,.0f}" if "startup_bytes" in r else ""
        lines.append(f"| {kind} | {variant}: {options} | {r['callers_B_s']:,.0f} | {r['bootstrap_B_s']:,.0f} | "
                     f"{per_call} | {startup} |")
    return save_table(args.out, lines, [row_name(k, v) for k, v in planned if row_name(k, v) not in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--calls", nargs="+", default=["idle", "store", "get", "announce"],
                    choices=["idle", "store", "get", "announce"])
    ap.add_argument("--warmup-s", type=float, default=25.0)
    ap.add_argument("--window-s", type=float, default=40.0)
    ap.add_argument("--p2p", nargs="+", default=["base"], help="NAME or NAME:KEY=VALUE,...: P2P options per variant")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "dht_cost")
    args = ap.parse_args()
    variants = parse_p2p(args.p2p)
    if os.geteuid() != 0:
        raise SystemExit("dht_cost.py makes network namespaces: run it as root (sudo)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    planned = [(kind, variant) for variant in variants for kind in args.calls]
    for i, (kind, variant) in enumerate(planned):
        name = row_name(kind, variant)
        path = args.out / f"{name}.json"
        if not path.exists():
            left = (len(planned) - i) * (args.warmup_s + args.window_s + 10)
            print(f"[{i + 1}/{len(planned)}] {name} (about {left / 60:.0f} min left)", flush=True)
            path.write_text(json.dumps(measure(kind, args, variants[variant]), indent=1))
        rows[name] = json.loads(path.read_text())
        print(table(rows, planned, args), flush=True)


if __name__ == "__main__":
    main()
