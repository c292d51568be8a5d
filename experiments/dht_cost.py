"""What one DHT call costs on the wire: 5 hivemind DHT nodes (lowcomm's ControlPlane) in network namespaces.

    sudo python experiments/dht_cost.py [--nodes 5] [--calls idle store get announce] [--warmup-s 25]
        [--window-s 40] [--out experiments/out/dht_cost]

Node 0 bootstraps the DHT and only idles; nodes 1..N-1 each make one call per second of one kind
and nothing else: `store` refreshes the node's peer record under the run's peers key (a heartbeat),
`get` reads that key (every node's record, merged from every node: the read agreement makes),
`announce` stores an announcement under a new round key each time, `idle` makes no call. The kernel
counts the bytes each namespace sends on the DHT's plane (the lab's htb control class) over
--window-s seconds after --warmup-s; per call is what all nodes sent per second (a call's own bytes
and the answers to it) less the idle row's, over the calls per second. Each kind is one row, resumable (OUT/<kind>.json); OUT/table.md is rewritten
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


def measure(kind: str, args) -> dict:
    with NetnsLab() as lab:
        nodes = [lab.add_node(f"n{i}") for i in range(args.nodes)]
        life_s = args.warmup_s + args.window_s + 30
        boot_file = args.out / f".{kind}.boot"
        boot_file.unlink(missing_ok=True)
        procs = []
        try:
            def start(node, boot, node_kind, out):
                cmd = node.wrap([sys.executable, "-c", NODE, node.control_address, boot, node_kind, out, str(life_s)])
                procs.append(subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
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
            "callers_B_s": sum(per_s[1:]) / (args.nodes - 1), "per_node_B_s": per_s}


def table(rows: dict[str, dict], kinds: list[str], args) -> str:
    idle = sum(rows["idle"]["per_node_B_s"]) if "idle" in rows else None
    lines = [f"{args.nodes} DHT nodes in network namespaces, uncapped; nodes 1..{args.nodes - 1} make one call a "
             f"second each, node 0 idles; bytes sent on the DHT's plane over {args.window_s:.0f} s. Per call: "
             "what all the nodes sent (callers and answerers), less the idle row's, over the calls made.", "",
             "| calls | bytes/s per calling node | bytes/s of node 0 | wire bytes per call |",
             "| --- | --- | --- | --- |"]
    for kind in kinds:
        if kind in rows:
            r = rows[kind]
            per_call = (f"{(sum(r['per_node_B_s']) - idle) / (args.nodes - 1) / 1e3:.1f} KB"
                        if idle is not None and kind != "idle" else "")
            lines.append(f"| {kind} | {r['callers_B_s']:,.0f} | {r['bootstrap_B_s']:,.0f} | {per_call} |")
    return save_table(args.out, lines, [k for k in kinds if k not in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--calls", nargs="+", default=["idle", "store", "get", "announce"],
                    choices=["idle", "store", "get", "announce"])
    ap.add_argument("--warmup-s", type=float, default=25.0)
    ap.add_argument("--window-s", type=float, default=40.0)
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "dht_cost")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("dht_cost.py makes network namespaces: run it as root (sudo)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for i, kind in enumerate(args.calls):
        path = args.out / f"{kind}.json"
        if not path.exists():
            left = (len(args.calls) - i) * (args.warmup_s + args.window_s + 10)
            print(f"[{i + 1}/{len(args.calls)}] {kind} (about {left / 60:.0f} min left)", flush=True)
            path.write_text(json.dumps(measure(kind, args), indent=1))
        rows[kind] = json.loads(path.read_text())
        print(table(rows, args.calls, args), flush=True)


if __name__ == "__main__":
    main()
