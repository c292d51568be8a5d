"""What a run's DHT bytes are made of on the wire, packet by packet: revisions side by side in network namespaces.

    sudo python experiments/dht_packets.py [--revisions tcp=HEAD quic=aafb14c] [--algo sparseloco]
        [--peers 4] [--steps 900] [--link 20mbit] [--seed 0] [--timeout-s 1200]
        [--worktrees /tmp/lowcomm-dht-packets] [--out experiments/out/dht_packets]

A row is one `lowcomm simulate --netns --link RATE` run of one revision (each from a git worktree of
its own, experiments/revisions.py), with tcpdump (Debian's `tcpdump`) capturing the headers of
every frame on the lab's bridge. Every frame a node sends crosses the bridge once, so the frames
sent from the nodes' control addresses (the DHT's, transport.netns) add up to the report's
`control_bytes` (checked: both columns are in the table). Per row: the DHT's frames and bytes, the
mean frame, and how the bytes split between TCP segments by payload size (none: a bare ACK; 1-30 B:
yamux's window updates and stream opens and closes inside TLS records; 31-60 B: multistream-select's
protocol lines, by their size; more: the calls' requests and answers), UDP datagrams (QUIC) and
other frames (ICMP: a closed UDP port's answer as the nodes stop).
A row whose JSON exists under --out is skipped (resumable per row); OUT/table.md is rewritten after
every row; the captures and runs go to OUT/runs/ (not in git).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from revisions import fresh_run_dir, tree_commit, tree_env, worktree
from simulate_launch import save_table

REPO = Path(__file__).resolve().parents[1]
FRAME = re.compile(r"length (\d+): (\d+\.\d+\.\d+\.\d+)\.\d+ > \d+\.\d+\.\d+\.\d+\.\d+: (\w+)(.*)$")
PORTLESS = re.compile(r"length (\d+): (\d+\.\d+\.\d+\.\d+) > \d+\.\d+\.\d+\.\d+: ")  # ICMP and the like
TCP_PAYLOAD = re.compile(r", length (\d+)")
CLASSES = ["tcp ack", "tcp 1-30 B", "tcp 31-60 B", "tcp more", "udp", "other"]


def bridges() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line}


def capture(cmd: list[str], tree: Path, run_dir: Path, timeout_s: float) -> tuple[int | str, Path]:
    """Runs the simulation with tcpdump on its lab's bridge from the moment the bridge exists."""
    pcap, before = run_dir / "control.pcap", bridges()
    with open(run_dir / "simulate.log", "w") as log:
        sim = subprocess.Popen(cmd, cwd=tree, env=tree_env(tree), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        dump = None
        deadline = time.monotonic() + timeout_s
        try:
            while dump is None and sim.poll() is None and time.monotonic() < deadline:
                new = bridges() - before
                if new:  # the lab's bridge: every frame between its nodes crosses it
                    dump = subprocess.Popen(["tcpdump", "-i", new.pop(), "-s", "128", "-n", "-w", str(pcap)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                else:
                    time.sleep(0.05)  # the bridge appears within the launcher's first second
            rc = sim.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            subprocess.run(["kill", "-TERM", f"-{sim.pid}"], capture_output=True)
            sim.wait(timeout=120)
            rc = "timeout"
        finally:
            if dump is not None:
                dump.terminate()
                dump.wait(timeout=30)
    return rc, pcap


def classify(pcap: Path, control_addresses: set[str]) -> dict:
    """Frames and bytes the control addresses sent, by class (CLASSES)."""
    text = subprocess.run(["tcpdump", "-r", str(pcap), "-nn", "-e"], capture_output=True, text=True).stdout
    frames, sent = Counter(), Counter()
    for line in text.splitlines():
        match = FRAME.search(line)
        if match is None:  # no ports: ICMP (a closed UDP port's "unreachable" as the nodes stop), ARP
            other = PORTLESS.search(line)
            if other is not None and other.group(2) in control_addresses:
                frames["other"] += 1
                sent["other"] += int(other.group(1))
            continue
        if match.group(2) not in control_addresses:
            continue
        length, proto, rest = int(match.group(1)), match.group(3), match.group(4)
        if proto != "Flags":  # "UDP", or tcpdump's name for what it recognised in the datagram (quic)
            kind = "udp"
        else:
            payload = TCP_PAYLOAD.search(rest)
            size = int(payload.group(1)) if payload else 0
            kind = ("tcp ack" if size == 0 else "tcp 1-30 B" if size <= 30 else "tcp 31-60 B" if size <= 60
                    else "tcp more")
        frames[kind] += 1
        sent[kind] += length
    return {"frames": dict(frames), "bytes": dict(sent)}


def run_row(name: str, rev: str, tree: Path, args) -> dict:
    row = f"{args.algo}-{name}-p{args.peers}-{args.steps}-{args.link}-s{args.seed}"
    run_dir = fresh_run_dir(args.out, row)
    report_path = run_dir / "report.json"
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--netns", "--link", args.link, "--algo", args.algo,
           "--peers", str(args.peers), "--steps", str(args.steps), "--seed", str(args.seed),
           "--report", str(report_path), "--run-dir", str(run_dir / "run")]
    rc, pcap = capture(cmd, tree, run_dir, args.timeout_s)
    out = {"row": row, "revision": name, "rev": rev, "commit": tree_commit(tree), "rc": rc,
           "command": " ".join(cmd[1:]), "finished": False}
    if rc == 0 and report_path.exists() and pcap.exists():
        report = json.loads(report_path.read_text())
        control = {n["control_address"] for n in report["netns_nodes"].values()}
        out.update(classify(pcap, control), control_bytes=report["control_bytes"], wire_bytes=report["wire_bytes"],
                   wall_s=report["wall_s"], final_loss=report["final_loss"], finished=True)
    return out


def write_table(out: Path, names: list[str], args) -> str:
    rows = {}
    for path in out.glob("*.json"):
        row = json.loads(path.read_text())
        if row.get("finished"):
            rows[row["revision"]] = row
    lines = [f"{args.peers} peers ({args.algo}) in network namespaces, {args.link} htb caps, {args.steps} steps "
             f"each, seed {args.seed}: the frames the DHT's addresses sent, from a capture on the lab's bridge. "
             "Shares are of the captured DHT bytes; TCP segments by payload size.", "",
             "| revision | DHT MB (kernel) | captured MB | frames | mean frame B | "
             + " | ".join(CLASSES) + " | DHT share of the wire | wall s |",
             "| --- " * (7 + len(CLASSES)) + "|"]
    for name in names:
        if name not in rows:
            continue
        r = rows[name]
        total = sum(r["bytes"].values())
        frames = sum(r["frames"].values())
        shares = " | ".join(f"{r['bytes'].get(c, 0) / total:.0%}" for c in CLASSES)
        lines.append(f"| {name} ({r['commit'][:7]}) | {r['control_bytes'] / 1e6:.2f} | {total / 1e6:.2f} | {frames} | "
                     f"{total / frames:.0f} | {shares} | {r['control_bytes'] / r['wire_bytes']:.1%} | "
                     f"{r['wall_s']:.0f} |")
    return save_table(out, lines, [n for n in names if n not in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revisions", nargs="+", default=["tcp=HEAD", "quic=aafb14c"], help="NAME=REV, in the table's order")
    ap.add_argument("--algo", default="sparseloco")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--link", default="20mbit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    ap.add_argument("--worktrees", type=Path, default=Path("/tmp/lowcomm-dht-packets"))
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "dht_packets")
    ap.add_argument("--reclassify", action="store_true", help="classify the finished rows' captures again, run nothing")
    args = ap.parse_args()
    revisions = dict(item.split("=", 1) for item in args.revisions)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reclassify:
        for path in args.out.glob("*.json"):
            row = json.loads(path.read_text())
            run_dir = args.out / "runs" / row["row"]
            if row.get("finished") and (run_dir / "control.pcap").exists():
                report = json.loads((run_dir / "report.json").read_text())
                row.update(classify(run_dir / "control.pcap",
                                    {n["control_address"] for n in report["netns_nodes"].values()}))
                path.write_text(json.dumps(row, indent=1))
        print(write_table(args.out, list(revisions), args))
        return
    for i, (name, rev) in enumerate(revisions.items()):
        path = args.out / f"{args.algo}-{name}.json"
        if path.exists() and json.loads(path.read_text()).get("finished"):
            continue
        started = time.time()
        print(f"[{i + 1}/{len(revisions)}] {args.algo} at {name} ({rev})", flush=True)
        row = run_row(name, rev, worktree(args, name, rev), args)
        path.write_text(json.dumps(row, indent=1))
        left = len(revisions) - i - 1
        print(f"  rc {row['rc']}, {time.time() - started:.0f}s; about {left * (time.time() - started) / 60:.0f} min left",
              flush=True)
        write_table(args.out, list(revisions), args)
    print(write_table(args.out, list(revisions), args))


if __name__ == "__main__":
    main()
