"""NoLoCo's pair exchange against lowcomm's dense all-reduce (ShardedReduce): N peers, S bytes each.

    sudo python experiments/noloco_vs_allreduce.py [--peers 16] [--sizes-mb 4 16] [--rounds 3]
        [--rate-mbit 100] [--out experiments/out/noloco_exchange] [--retry-failed] [--table-only]

A row is (system, N, S), measured as one cell of experiments/sync_efficiency.py (`run_cell`: a
NetnsLab with N worker nodes capped at B each way by htb, one experiments/sync_worker.py per node
in its own process group, file barriers between rounds, veth byte counters):

- `lowcomm`: the sharded all-reduce of an S-byte float32 vector (fp32, no zstd);
- `lowcomm-pairs`: collectives.pair_exchange on the same S bytes, cut in two tensors as NoLoCo's
  (θ − φ, φ): each worker pushes them to its mate of noloco.groups (pairs) and holds the pair's
  mean. Every worker's result is checked against the true mean of its group's inputs.

Per peer the all-reduce sends 2(N−1)/N·S, the pair exchange S, so where the links bind the pairs
should be 2(N−1)/N times faster; the issue's target is a speedup of at least 0.8 of that. The
speedup is taken on the exchange itself (`transfer`: after the manifest, the slowest worker of a
round, rounds ≥ 1 so connection set-up is left out) and, for reference, on the whole round (the
DHT announce + manifest included, which both pay alike). Note for reading it per model: S is
what a peer contributes. DiLoCo's Δ is one model (S = M); NoLoCo's contribution carries progress
and φ, so for the same model it is S = 2M.

Each row's JSON under OUT/ is kept and skipped on a rerun (--retry-failed reruns failed rows);
OUT/table.md and OUT/results.json are rewritten after every row. Must run as root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "experiments"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from sync_efficiency import MB, MEMORY_PER_S, MEMORY_RESERVE, bound_s, mem_available, run_cell  # noqa: E402

from lowcomm.transport.netns import NetnsUnavailable, unavailable_reason  # noqa: E402

SYSTEMS = {"lowcomm": "all-reduce", "lowcomm-pairs": "pairs"}
TARGET_FRACTION = 0.8


def row_name(system: str, peers: int, size_mb: int) -> str:
    return f"{SYSTEMS[system]}-n{peers}-s{size_mb}"


def ideal_speedup(peers: int) -> float:
    """Bytes per peer, all-reduce over pairs: 2(N−1)/N · S over S."""
    return 2 * (peers - 1) / peers


def steady(values: list[float]) -> float:
    return statistics.mean(values[1:] or values)


def slowest_transfer_s(cell: dict) -> list[float]:
    """Per round, the exchange time of the slowest worker (after the manifest)."""
    return [max(r["transfer_s"]) for r in cell["per_round"]]


def compare(allreduce: dict | None, pairs: dict | None, peers: int, size_mb: int) -> dict:
    row = {"peers": peers, "size_mb": size_mb, "ideal_speedup": ideal_speedup(peers),
           "target_speedup": TARGET_FRACTION * ideal_speedup(peers)}
    for name, cell in (("allreduce", allreduce), ("pairs", pairs)):
        if cell is None or "error" in cell:
            row[name] = {"error": (cell or {}).get("error", "not run")}
            continue
        row[name] = {"transfer_s": steady(slowest_transfer_s(cell)), "round_s": cell["steady_round_s"],
                     "mb_sent_per_peer": cell["mb_sent_per_peer"], "correct": cell["correct"],
                     "wrong_rounds": [r["round"] for r in cell["per_round"] if not r["correct"]],
                     "control_mb_per_peer": steady([statistics.mean(w["control_tx"] for w in r["wire"]) / MB
                                                    for r in cell["per_round"]]),
                     "rounds": cell["rounds"], "bound_s": cell["bound_s"]}
    if "error" not in row["allreduce"] and "error" not in row["pairs"]:
        a, p = row["allreduce"], row["pairs"]
        row["speedup_transfer"] = a["transfer_s"] / p["transfer_s"]
        row["speedup_round"] = a["round_s"] / p["round_s"]
        row["target_met"] = row["speedup_transfer"] >= row["target_speedup"]
    return row


COLUMNS = ["N", "S MB", "all-reduce exchange s", "pairs exchange s", "speedup", "ideal 2(N−1)/N", "target (0.8×)",
           "met?", "all-reduce round s", "pairs round s", "round speedup", "MB sent/peer (all-reduce / pairs)",
           "of which DHT", "correct?"]


def table_row(r: dict) -> list[str]:
    a, p = r["allreduce"], r["pairs"]
    head = [str(r["peers"]), str(r["size_mb"])]
    if "speedup_transfer" not in r:
        why = "; ".join(f"{name}: {x['error'][:80]}" for name, x in (("all-reduce", a), ("pairs", p)) if "error" in x)
        return head + [why] + [""] * (len(COLUMNS) - 3)
    return head + [f"{a['transfer_s']:.2f}", f"{p['transfer_s']:.2f}", f"**{r['speedup_transfer']:.2f}**",
                   f"{r['ideal_speedup']:.2f}", f"{r['target_speedup']:.2f}", "yes" if r["target_met"] else "NO",
                   f"{a['round_s']:.2f}", f"{p['round_s']:.2f}", f"{r['speedup_round']:.2f}",
                   f"{a['mb_sent_per_peer']:.1f} / {p['mb_sent_per_peer']:.1f}",
                   f"{a['control_mb_per_peer']:.1f} / {p['control_mb_per_peer']:.1f}",
                   _correct(a, p)]


def _correct(a: dict, p: dict) -> str:
    """"yes", or which rounds of which system gave a worker a result that is not its group's mean."""
    wrong = [f"{name} round {', '.join(map(str, x.get('wrong_rounds', [])))}"
             for name, x in (("all-reduce", a), ("pairs", p)) if not x["correct"]]
    return "yes" if not wrong else "NO: " + "; ".join(wrong)


NOTES = """\
Exchange: after the round's manifest, the slowest worker of the round, mean over rounds ≥ 1 (round 0 sets up
connections). Round: barrier release to the last worker holding its result, the DHT announce + manifest included
(both systems pay it alike). Speedup: all-reduce over pairs. MB sent/peer: the node's wire bytes (Ethernet frames,
TCP/IP headers, ACKs, DHT) per round; of which DHT: the control plane's share (its own subnet, under the same cap).
Correct: every worker's result equals the mean of its group's inputs (all N for the all-reduce, its pair for
NoLoCo) within 1e-5; the rounds where some worker's is not are named (a reduce that passes its deadline excludes
the late members and applies no update to a shard nobody received, by design). S is what a peer contributes; for
one model of M bytes NoLoCo's contribution (progress and φ) is 2M, DiLoCo's Δ is M. The host has 2 cores.
"""


def write_outputs(out: Path, rows: list[dict], rate_mbit: float) -> None:
    lines = [COLUMNS, ["---"] * len(COLUMNS)] + [table_row(r) for r in rows]
    text = "\n".join("| " + " | ".join(line) + " |" for line in lines)
    (out / "table.md").write_text(f"NoLoCo's pair exchange vs the dense all-reduce at {rate_mbit:g} Mbit/s per peer "
                                  f"each way (netns + htb), fp32, no compression.\n\n{text}\n\n{NOTES}")
    (out / "results.json").write_text(json.dumps(rows, indent=1))


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[16])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retry-failed", action="store_true")
    parser.add_argument("--table-only", action="store_true", help="rewrite table.md and results.json, run nothing")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "noloco_exchange")
    args = parser.parse_args()
    args.matchmaking_s, args.epoch_rounds = 5.0, 1  # what sync_efficiency.run_cell reads for lowcomm cells
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell ignores SIGINT
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    reason = unavailable_reason()
    if reason and not args.table_only:
        print(f"noloco_vs_allreduce: {reason}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    grid = [(n, s) for n in args.peers for s in args.sizes_mb]

    def rows() -> list[dict]:
        return [compare(load(args.out / f"{row_name('lowcomm', n, s)}.json"),
                        load(args.out / f"{row_name('lowcomm-pairs', n, s)}.json"), n, s) for n, s in grid]

    write_outputs(args.out, rows(), args.rate_mbit)
    if args.table_only:
        print((args.out / "table.md").read_text())
        return 0
    for n, s in grid:
        for system in SYSTEMS:
            path = args.out / f"{row_name(system, n, s)}.json"
            kept = load(path)
            if kept is not None and not ("error" in kept and args.retry_failed):
                continue
            need, free = n * MEMORY_PER_S["lowcomm"] * s * MB, mem_available()
            if need + MEMORY_RESERVE > free:  # not recorded: a rerun tries again
                print(f"{path.stem}: skipped, needs ~{need / 1e9:.1f} GB, {free / 1e9:.1f} GB available", flush=True)
                continue
            print(f"{path.stem}: bound (all-reduce) {bound_s(n, s * MB, args.rate_mbit * 1e6):.2f}s", flush=True)
            started = time.time()
            try:
                result = run_cell(args, system, n, s)
            except NetnsUnavailable as e:
                print(f"noloco_vs_allreduce: {e}", file=sys.stderr)
                return 2
            except Exception as e:  # a failed row is recorded and the grid goes on
                result = {"system": system, "peers": n, "size_mb": s, "error": f"{type(e).__name__}: {e}"}
            result["wall_s"] = time.time() - started
            path.write_text(json.dumps(result, indent=1))
            write_outputs(args.out, rows(), args.rate_mbit)
            print(f"  {'failed: ' + result['error'] if 'error' in result else 'done'} "
                  f"({result['wall_s']:.0f}s)", flush=True)
    print((args.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
