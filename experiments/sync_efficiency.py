"""Sync efficiency: lowcomm's dense collective and hivemind's DecentralizedAverager against 2(N−1)/N·S/B.

    sudo python experiments/sync_efficiency.py [--peers 4 8] [--sizes-mb 4 64 256] [--rounds 3]
        [--systems lowcomm hivemind] [--rate-mbit 100] [--out experiments/out/sync_efficiency]

A cell is (system, N, S). It opens a NetnsLab with one uncapped node for the DHT bootstrap and N
worker nodes capped at B each way (htb: every byte of every process is shaped and counted), starts
one experiments/sync_worker.py per node in its own process group, and runs `--rounds` averaging
rounds of S bytes of float32 per worker, fp32 with no compression (lowcomm: sync.zstd_level 0;
hivemind: NoCompression). Each round is released by a file barrier; its time runs from the
release to the moment the last worker holds the result, so round agreement (lowcomm's DHT
announce + manifest, hivemind's matchmaking) is included. Bytes are the node's veth counters
(Ethernet frames, TCP/IP headers, ACKs and DHT traffic included) over the round.

    efficiency = bound / measured round time,   bound = 2(N−1)/N · S / B   (S in bytes, B = rate/8)

Each cell also records, per round, every node's CPU seconds and its tx/rx counters every 50 ms (where
the links were busy or idle), and per worker the agreement / transfer split.

Diagnostics: `--rate-mbit 10000` (no real cap: the host's CPU floor), `--epoch-rounds 3` (lowcomm
reuses one manifest for 3 rounds), `--systems lowcomm-zstd1` (the default zstd level 1).

A cell's JSON under OUT/ is kept and skipped on a rerun (--retry-failed reruns failed ones); the
markdown table OUT/table.md is rewritten after every cell (--table-only rewrites it and runs nothing).
A cell whose workers would not fit in memory is skipped and noted. Must run as root.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.transport.netns import NetnsLab, NetnsUnavailable, unavailable_reason  # noqa: E402

WORKER = REPO / "experiments" / "sync_worker.py"
MB = 1_000_000
STARTUP_TIMEOUT_S = 600.0
STARTUP_ESTIMATE_S = 45.0  # for the ETA before any cell ran: processes, DHT, first connections
# a worker's peak memory above its baseline, in S (the table's column; 64 MB, N=4: lowcomm 6.9-7.1, hivemind
# 3.6-4.5), with room to spare: a cell that would not fit is skipped
MEMORY_PER_S = {"lowcomm": 8, "lowcomm-zstd1": 8, "hivemind": 6}
MEMORY_RESERVE = 4 << 30  # left to the other jobs on the host: an OOM kill could hit one of theirs


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def bound_s(peers: int, size_bytes: int, rate_bits: float) -> float:
    return 2 * (peers - 1) / peers * size_bytes * 8 / rate_bits


def cell_name(system: str, peers: int, size_mb: int) -> str:
    return f"{system}-n{peers}-s{size_mb}"


# ---- one cell ---------------------------------------------------------------------------------

class CellFailed(RuntimeError):
    pass


def _wait_files(paths: list[Path], procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]  # 0: done, result written
        missing = [p.name for p in paths if not p.exists()]
        if dead:
            names = ["boot" if i == 0 else f"worker {i - 1}" for i in dead]
            raise CellFailed(f"{what}: {', '.join(names)} exited (codes {[procs[i].returncode for i in dead]}); "
                             f"still missing {missing[:4]}")
        if time.monotonic() > deadline:
            raise CellFailed(f"{what}: {missing[:4]} not there after {timeout:.0f}s")
        time.sleep(0.005)


def _touch(path: Path, text: str = "") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _cpu_s(namespaces: list[str]) -> dict[str, tuple[float, float]]:
    """CPU seconds (user, system) used so far by the processes now inside each namespace."""
    inodes = {}
    for ns in namespaces:
        st = os.stat(f"/run/netns/{ns}")
        inodes[(st.st_ino, st.st_dev)] = ns
    used = {ns: (0.0, 0.0) for ns in namespaces}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
            ns = inodes.get((st.st_ino, st.st_dev))
            if ns is not None:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                user, system = used[ns]
                used[ns] = (user + int(fields[11]) / tick, system + int(fields[12]) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return used


def _snapshot(nodes) -> list[dict]:
    cpu = _cpu_s([node.ns for node in nodes])
    return [{"counters": node.counters(), "class_bytes": node.class_bytes(), "cpu_s": sum(cpu[node.ns]),
             "sys_s": cpu[node.ns][1]} for node in nodes]


class Sampler(threading.Thread):
    """Every node's tx/rx byte counters every `period` s: where in a round the links were busy or idle."""

    def __init__(self, nodes, period: float = 0.05):
        super().__init__(daemon=True)
        self.paths = [(Path("/sys/class/net") / n.host_veth / "statistics" / "rx_bytes",  # the node's tx
                       Path("/sys/class/net") / n.host_veth / "statistics" / "tx_bytes") for n in nodes]
        self.period = period
        self.samples: list[list] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            try:
                row = [time.time()]
                for tx, rx in self.paths:
                    row += [int(tx.read_text()), int(rx.read_text())]
                self.samples.append(row)
            except OSError:
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def window(self, start: float, end: float) -> list[list]:
        return [row for row in self.samples if start - self.period <= row[0] <= end + self.period]


def _stop_groups(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    """Waits for the processes to exit, then SIGKILLs each one's process group (p2pd and forks included)."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group id is the worker's pid
        except ProcessLookupError:
            pass
        proc.wait()


def run_cell(args, system: str, peers: int, size_mb: int) -> dict:
    numel = size_mb * MB // 4
    bound = bound_s(peers, numel * 4, args.rate_mbit * 1e6)
    work = args.out / "runs" / cell_name(system, peers, size_mb)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    round_timeout = 10 * bound + 300
    procs: list[subprocess.Popen] = []
    logs = []

    def launch(node, argv: list[str], log_name: str) -> None:
        log = open(work / log_name, "w")
        logs.append(log)
        procs.append(subprocess.Popen(node.wrap([sys.executable, str(WORKER), *argv]), env=env, cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True))

    rounds = []
    with NetnsLab() as lab:
        boot = lab.add_node("boot", rate=None)
        nodes = [lab.add_node(f"w{i}", rate=args.rate_mbit * 1e6) for i in range(peers)]
        common = ["--system", system, "--dir", str(work)]
        sampler = Sampler(nodes)
        sampler.start()
        try:
            launch(boot, ["boot", *common, "--host", boot.control_address], "boot.log")
            for i, node in enumerate(nodes):
                launch(node, ["worker", *common, "--index", str(i), "--peers", str(peers), "--numel", str(numel),
                              "--rounds", str(args.rounds), "--host", node.address, "--control-host",
                              node.control_address, "--seed", str(args.seed),
                              "--zstd-level", "1" if system == "lowcomm-zstd1" else "0",
                              "--reduce-timeout-s", f"{max(20.0, 3 * bound + 30):.0f}",
                              "--matchmaking-s", str(args.matchmaking_s), "--epoch-rounds", str(args.epoch_rounds)],
                       f"worker-{i}.log")
            for r in range(args.rounds):
                _wait_files([work / f"ready-{r}-{i}" for i in range(peers)], procs,
                            STARTUP_TIMEOUT_S if r == 0 else round_timeout, f"round {r} ready")
                before = _snapshot(nodes)
                go = time.time()
                _touch(work / f"go-{r}", repr(go))
                _wait_files([work / f"done-{r}-{i}" for i in range(peers)], procs, round_timeout, f"round {r}")
                finished = time.time()
                after = _snapshot(nodes)
                _touch(work / f"alldone-{r}")
                rounds.append({"round": r, "go": go, "all_done_seen": finished, "before": before, "after": after,
                               "timeline": sampler.window(go, finished)})
                print(f"  round {r}: {finished - go:.2f}s (bound {bound:.2f}s)", flush=True)
            _wait_files([work / f"result-{i}.json" for i in range(peers)], procs, round_timeout, "results")
        finally:
            sampler.stop()
            _touch(work / "stop")
            _stop_groups(procs)
            for log in logs:
                log.close()
    workers = [json.loads((work / f"result-{i}.json").read_text()) for i in range(peers)]
    return summarize(system, peers, size_mb, numel, bound, args, rounds, workers)


# ---- numbers ----------------------------------------------------------------------------------

def _delta(before: dict, after: dict) -> dict:
    return {"cpu_s": after["cpu_s"] - before["cpu_s"], "sys_s": after["sys_s"] - before["sys_s"],
            "tx": after["counters"]["tx"] - before["counters"]["tx"],
            "rx": after["counters"]["rx"] - before["counters"]["rx"],
            "data_tx": after["class_bytes"]["data"]["tx"] - before["class_bytes"]["data"]["tx"],
            "control_tx": after["class_bytes"]["control"]["tx"] - before["class_bytes"]["control"]["tx"]}


def link_phases(timeline: list[list], peers: int, rate_bits: float, go: float, end: float) -> dict:
    """From the sampled counters: per node, the share of the round its uplink ran near the cap, and the
    time to its first and after its last busy interval (agreement before, stragglers after)."""
    busy_at, near_cap, first, last = 0.1, 0.8, [], []
    shares = []
    for node in range(peers):
        busy = full = 0.0
        first_busy = last_busy = None
        for a, b in zip(timeline, timeline[1:]):
            dt = b[0] - a[0]
            if dt <= 0 or b[0] < go or a[0] > end:
                continue
            rate = (b[1 + 2 * node] - a[1 + 2 * node]) * 8 / dt
            if rate >= busy_at * rate_bits:
                first_busy = a[0] if first_busy is None else first_busy
                last_busy = b[0]
                busy += dt
            if rate >= near_cap * rate_bits:
                full += dt
        shares.append(full / max(end - go, 1e-9))
        first.append((first_busy or end) - go)
        last.append(end - (last_busy or end))
    return {"uplink_near_cap_share": shares, "before_first_busy_s": first, "after_last_busy_s": last}


def summarize(system, peers, size_mb, numel, bound, args, rounds, workers) -> dict:
    per_round = []
    for r, wire in enumerate(rounds):
        mine = [w["rounds"][r] for w in workers]
        last_end = max(m["t_end"] for m in mine)
        traffic = [_delta(b, a) for b, a in zip(wire["before"], wire["after"])]
        hashes = {}
        for w, m in enumerate(mine):
            hashes.setdefault(tuple(m["group_workers"]), set()).add(m["result_hash"])
        per_round.append({
            "round": r,
            "round_s": last_end - wire["go"],  # release to the last worker holding the result
            "first_start_to_last_end_s": last_end - min(m["t_start"] for m in mine),
            "start_lag_s": max(m["t_start"] for m in mine) - wire["go"],  # barrier-poll latency, max
            "worker_round_s": [m["round_s"] for m in mine],
            "agreement_s": [m["agreement_s"] for m in mine],
            "transfer_s": [m["transfer_s"] for m in mine],
            "group_sizes": [m["group_size"] for m in mine],
            "all_n": all(m["group_size"] == peers for m in mine),
            "correct": all(m["correct"] for m in mine),
            "max_abs_err": max(m["max_abs_err"] for m in mine),
            "checked_fraction": min(m["checked_fraction"] for m in mine),
            "same_bytes_within_groups": all(len(h) == 1 for h in hashes.values()),
            "groups": sorted({tuple(m["group_workers"]) for m in mine}),
            "wire": traffic,
            "cpu_s_per_node": [t["cpu_s"] for t in traffic],
            "sys_s_per_node": [t["sys_s"] for t in traffic],
            "peak_mem_s": [m.get("peak_mem_bytes", float("nan")) / (numel * 4) for m in mine],
            "phases": link_phases(wire["timeline"], peers, args.rate_mbit * 1e6, wire["go"], last_end),
            "timeline": [[round(row[0] - wire["go"], 3), *row[1:]] for row in wire["timeline"]],
            **({"grpc_bytes_sent": [m["grpc_bytes_sent"] for m in mine]} if "grpc_bytes_sent" in mine[0] else {}),
        })
    times = [r["round_s"] for r in per_round]
    steady = times[1:] or times
    sent = [statistics.mean(t["tx"] for t in r["wire"]) for r in per_round]
    return {
        "system": system, "peers": peers, "size_mb": size_mb, "numel": numel, "rate_mbit": args.rate_mbit,
        "zstd_level": 1 if system == "lowcomm-zstd1" else (0 if system.startswith("lowcomm") else None),
        "matchmaking_s": args.matchmaking_s if system == "hivemind" else None,
        "epoch_rounds": args.epoch_rounds if system.startswith("lowcomm") else None,
        "rounds": len(per_round), "bound_s": bound,
        "mean_round_s": statistics.mean(times), "std_round_s": statistics.pstdev(times),
        "min_round_s": min(times), "steady_round_s": statistics.mean(steady),
        "efficiency": bound / statistics.mean(times), "steady_efficiency": bound / statistics.mean(steady),
        "mean_agreement_s": statistics.mean(statistics.mean(r["agreement_s"]) for r in per_round),
        "mean_transfer_s": statistics.mean(statistics.mean(r["transfer_s"]) for r in per_round),
        "mb_sent_per_peer": statistics.mean(sent) / MB,
        "mb_expected_per_peer": 2 * (peers - 1) / peers * numel * 4 / MB,
        "link_utilization": statistics.mean(max(t["tx"] for t in r["wire"]) * 8 / (args.rate_mbit * 1e6)
                                            / r["round_s"] for r in per_round),
        "mean_cpu_s_per_node": statistics.mean(statistics.mean(r["cpu_s_per_node"]) for r in per_round),
        "kernel_cpu_share": sum(sum(r["sys_s_per_node"]) for r in per_round)
                            / max(1e-9, sum(sum(r["cpu_s_per_node"]) for r in per_round)),
        "peak_mem_s": max(max(r["peak_mem_s"]) for r in per_round),
        "uplink_near_cap_share": statistics.mean(statistics.mean(r["phases"]["uplink_near_cap_share"])
                                                 for r in per_round),
        "all_n": all(r["all_n"] for r in per_round), "correct": all(r["correct"] for r in per_round),
        "per_round": per_round, "host_load": os.getloadavg(), "finished": time.time(),
        "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True).stdout.strip(),
    }


COLUMNS = ["system", "N", "S MB", "rounds", "mean round s", "bound s", "efficiency", "eff. rounds ≥1", "agreement s",
           "transfer s", "MB sent/peer (wire)", "2(N−1)/N·S MB", "link util.", "uplink ≥80% of cap",
           "CPU s/peer/round", "peak memory/worker (S)", "peak memory by round (S)", "all-N groups?", "correct?",
           "identical replicas?", "host load"]

NOTES = """\
Round time: barrier release to the last worker holding the result, agreement included. Efficiency: bound / mean
round time; 'eff. rounds ≥1' leaves out the first round (connection setup). Agreement / transfer: mean over
workers and rounds (lowcomm: manifest_s / reduce_s; hivemind: until RUNNING_ALLREDUCE / after). Wire bytes are
Ethernet frames (TCP/IP headers, ACKs, DHT included): a perfect all-reduce sends ~1.05x the payload, so ~0.95 is
the ceiling of any TCP system here. Link util.: busiest uplink's wire bytes / (B · round time). 'Uplink ≥80% of
cap': mean share of the round a peer's uplink ran at ≥ 80% of the cap (50 ms samples). CPU s/peer/round: user +
system CPU of every process in a peer's namespace over a round (kernel: the system part: the emulated links'
TCP, veth and htb, page faults). Peak memory/worker: the most resident memory a worker process held during a
round, above what it held set up and connected before its first input, in units of S (its input is one of them,
and its result another unless the worker donates its input, as lowcomm's does); the worst worker and round, then
the worst worker of each round. Host
load: 1-min load average when the cell ended; the host had 2 cores shared with other jobs, so every number is noisy and CPU-starved. Correct: every
worker's result within 1e-5 of the true mean of its group's inputs (every block up to 64 MB, 16 random 4 MB
blocks above). Identical replicas: all members of a group hold the same bytes.
"""


def table_row(r: dict) -> list[str]:
    if "error" in r or "skipped" in r:
        why = f"failed: {r['error'][:100]}" if "error" in r else f"not run: {r['skipped']}"
        return [r["system"], str(r["peers"]), str(r["size_mb"]), why] + [""] * (len(COLUMNS) - 4)
    identical = all(x["same_bytes_within_groups"] for x in r["per_round"])
    groups = "yes" if r["all_n"] else "no: " + ", ".join(
        "/".join(map(str, sorted(set(x["group_sizes"])))) for x in r["per_round"])
    return [r["system"], str(r["peers"]), str(r["size_mb"]), str(r["rounds"]),
            f"{r['mean_round_s']:.2f} ± {r['std_round_s']:.2f}", f"{r['bound_s']:.2f}", f"**{r['efficiency']:.2f}**",
            f"{r['steady_efficiency']:.2f}", f"{r['mean_agreement_s']:.2f}", f"{r['mean_transfer_s']:.2f}",
            f"{r['mb_sent_per_peer']:.1f}", f"{r['mb_expected_per_peer']:.1f}", f"{r['link_utilization']:.2f}",
            f"{r['uplink_near_cap_share']:.2f}", _cpu(r),
            _times_s(r.get("peak_mem_s")), " / ".join(_times_s(max(x["peak_mem_s"])) for x in r["per_round"]), groups,
            "yes" if r["correct"] else "NO", "yes" if identical else "no", f"{r['host_load'][0]:.0f}"]


def _cpu(r: dict) -> str:
    """CPU seconds per peer and round, with the kernel's share where it was measured."""
    share = r.get("kernel_cpu_share")
    return f"{r['mean_cpu_s_per_node']:.1f}" + (f" ({share:.0%} kernel)" if share is not None else "")


def _times_s(value) -> str:
    """A memory figure in units of S, or n/a (not measured)."""
    return f"{value:.1f}" if isinstance(value, float) and math.isfinite(value) else "n/a"


def table(results: list[dict]) -> str:
    rows = [COLUMNS, ["---"] * len(COLUMNS)]
    rows += [table_row(r) for r in sorted(results, key=lambda r: (r["peers"], r["size_mb"], r["system"]))]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"


def write_outputs(out: Path, results: list[dict], skipped: list[dict] = ()) -> None:
    rates = "/".join(f"{rate:g}" for rate in sorted({r["rate_mbit"] for r in results if "rate_mbit" in r})) or "?"
    (out / "table.md").write_text(f"Sync efficiency at {rates} Mbit/s per peer each way (netns + htb), fp32, "
                                  f"no compression.\n\n{table([*results, *skipped])}\n{NOTES}")
    (out / "results.json").write_text(json.dumps(
        {cell_name(r["system"], r["peers"], r["size_mb"]): {k: v for k, v in r.items() if k != "per_round"}
         for r in results}, indent=1))


# ---- the grid ---------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--systems", nargs="+", default=["lowcomm", "hivemind"],
                        choices=["lowcomm", "lowcomm-zstd1", "hivemind"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matchmaking-s", type=float, default=5.0, help="hivemind's min_matchmaking_time")
    parser.add_argument("--epoch-rounds", type=int, default=1,
                        help="lowcomm: rounds one manifest covers (1: agreement in every round, as hivemind matches)")
    parser.add_argument("--retry-failed", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite table.md and results.json, run nothing")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "sync_efficiency")
    args = parser.parse_args()
    # detached runs: a background shell ignores SIGINT; both signals unwind, so workers and the lab are removed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    reason = unavailable_reason()
    if reason and not args.table_only:
        print(f"sync_efficiency: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(system, n, s) for n in args.peers for s in args.sizes_mb for system in args.systems]
    cells.sort(key=lambda c: (c[2] > 64 and c[1] > 4, c[1], c[2]))  # N=8 at 256 MB last: the biggest
    results, todo, skipped = {}, [], []
    for cell in cells:
        path = args.out / f"{cell_name(*cell)}.json"
        skip_note = args.out / f"{cell_name(*cell)}.skipped.json"
        if skip_note.exists() and not path.exists():
            skipped.append(json.loads(skip_note.read_text()))
        if path.exists():
            results[cell] = json.loads(path.read_text())
            if not ("error" in results[cell] and args.retry_failed):
                continue
        todo.append(cell)
    write_outputs(args.out, list(results.values()), skipped)
    if args.table_only:
        print(table([*results.values(), *skipped]))
        return 0

    def estimate(cell) -> float:
        return STARTUP_ESTIMATE_S + args.rounds * (bound_s(cell[1], cell[2] * MB, args.rate_mbit * 1e6) / 0.6 + 5)

    started, spent_estimate = time.time(), 0.0
    for k, cell in enumerate(todo):
        bound = bound_s(cell[1], cell[2] * MB, args.rate_mbit * 1e6)
        print(f"[{k + 1}/{len(todo)}] {cell_name(*cell)}: bound {bound:.2f}s", flush=True)
        need, free = cell[1] * MEMORY_PER_S[cell[0]] * cell[2] * MB, mem_available()
        if need + MEMORY_RESERVE > free:  # skipped, not recorded: a rerun tries again
            why = (f"needs ~{need / 1e9:.1f} GB + {MEMORY_RESERVE / 2**30:.0f} GiB reserve, "
                   f"{free / 1e9:.1f} GB available")
            print(f"  skipped: {why}", flush=True)
            note = {"system": cell[0], "peers": cell[1], "size_mb": cell[2], "skipped": why}
            (args.out / f"{cell_name(*cell)}.skipped.json").write_text(json.dumps(note))
            skipped = [x for x in skipped if (x["system"], x["peers"], x["size_mb"]) != cell] + [note]
            write_outputs(args.out, list(results.values()), skipped)
            continue
        skipped = [x for x in skipped if (x["system"], x["peers"], x["size_mb"]) != cell]
        (args.out / f"{cell_name(*cell)}.skipped.json").unlink(missing_ok=True)
        try:
            result = run_cell(args, *cell)
        except NetnsUnavailable as e:
            print(f"sync_efficiency: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # a failed cell is recorded and the grid goes on
            result = {"system": cell[0], "peers": cell[1], "size_mb": cell[2], "error": f"{type(e).__name__}: {e}"}
            print(f"  failed: {result['error']}", flush=True)
        (args.out / f"{cell_name(*cell)}.json").write_text(json.dumps(result, indent=1))
        results[cell] = result
        write_outputs(args.out, list(results.values()), skipped)
        spent_estimate += estimate(cell)
        scale = (time.time() - started) / spent_estimate
        eta = scale * sum(estimate(c) for c in todo[k + 1:])
        if "error" not in result:
            print(f"  {result['mean_round_s']:.2f}s per round, efficiency {result['efficiency']:.2f}, "
                  f"{result['mb_sent_per_peer']:.1f} MB sent/peer, all-N {result['all_n']}, "
                  f"correct {result['correct']}", flush=True)
        print(f"  ETA {eta / 60:.1f} min", flush=True)
    print(table([*results.values(), *skipped]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
