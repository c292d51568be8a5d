"""The cost of authenticated data-plane calls: unsigned (dc5e231) against signed (210e25a) parts, side by side.

    python experiments/auth_cost.py [--payloads small large] [--reps 3] [--peers 4] [--seed 0]
        [--unsigned dc5e231] [--signed 210e25a] [--worktrees /tmp/lowcomm-auth-cost] [--keep-worktrees]
        [--out experiments/out/auth_cost] [--timeout-s 900] [--table-only]

Commit 210e25a signs every sharded-reduce part: its first chunk carries the sender's RSA public key
(OpenSSH form), a 256-byte RSA-PSS signature and the 32-byte sha256 of the part, and the owner checks
all three before it admits the part (lowcomm/transport/signing.py, collectives/reduce_messages.py).
Its parent dc5e231 sends the same parts unsigned. The script checks both revisions out as git
worktrees under --worktrees (reused when they are at the right commit; removed at the end unless
--keep-worktrees) and runs each revision's own source with this venv's python (PYTHONPATH and the
working directory are the worktree; every row records the `lowcomm.__file__` its runs imported).

A row is one `lowcomm simulate --peers N` of DiLoCo (uint8, loopback, no shaping) at one revision,
one payload and one repetition. Payloads: ``small`` is byzantine.py's small run (GPT d=64, 2 layers,
10 rounds of H = 10); ``large`` is the default model (d=128, 4 layers, 0.87M parameters, 6 rounds of
H = 5), about 7x the bytes per round. Repetitions alternate the order of the two revisions
(unsigned, signed, signed, unsigned, ...), so that the load of other work on the host falls on both
alike; every row has the same seed, so the final losses should agree.

Per row, from the peers' `round` records (one per peer and round): bytes sent per peer per round
(mean), the peers' sync time per round (`sync_s`, the whole sync from announcement to the applied
aggregate; median) and reduce time (`reduce_s`, the parts' transfer and reduce; median), and the
report's final held-out loss. The table gives each revision's mean over its repetitions and the
signed / unsigned ratio. A micro-benchmark (run in the signed worktree) times Signer.sign and
Verifier.verify of one part's header (mean over 200 calls each, after a warm-up) and the sha256 of a
part of each payload's size, and measures the exact per-part byte overhead: the ByteSize of a real
first ReduceChunk (reduce_messages.part_chunks) with and without its sender_key, signature and
digest fields.

A row whose JSON exists under --out is skipped (resumable per row); OUT/table.md is rewritten after
every row, listing the rows still missing; the runs go to OUT/runs/ (not in git).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from revisions import fresh_run_dir, imported_from, in_tree, round_records, tree_commit, tree_env, worktree
from simulate_launch import run_simulate, save_table  # beside this script (its folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]  # not put on sys.path: each revision's lowcomm is imported from its worktree

SMALL = {  # byzantine.py's SMALL: a run of ROUNDS rounds of H steps on a small GPT; only the final evaluation
    "run.algo": "diloco", "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 2, "model.context": 64,
    "inner.batch_size": 8, "inner.warmup_steps": 10, "data.eval_batches": 8, "data.eval_every_tokens": 1 << 40,
    "sync.announce_s": 3.0, "sync.manifest_s": 3.0, "sync.reduce_timeout_s": 10.0, "checkpoint.every_rounds": 0}
LARGE = {k: v for k, v in SMALL.items() if not k.startswith("model.")}  # the default model, the rest as SMALL
PAYLOADS = {"small": (SMALL, 10, 10), "large": (LARGE, 6, 5)}  # overrides, rounds, H
VARIANTS = ("unsigned", "signed")


# ---- one row ---------------------------------------------------------------------------------------

def row_name(payload: str, variant: str, rep: int, args) -> str:
    return f"{payload}-{variant}-rep{rep}-p{args.peers}-s{args.seed}"


def planned_rows(args) -> list[tuple[str, str, int]]:
    """(payload, variant, repetition), the order of the two variants alternating from one repetition to the next."""
    rows = []
    for payload in args.payloads:
        for rep in range(args.reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            rows += [(payload, variant, rep) for variant in order]
    return rows


def run_row(payload: str, variant: str, rep: int, tree: Path, args) -> dict:
    name = row_name(payload, variant, rep, args)
    run_dir = fresh_run_dir(args.out, name)
    overrides, rounds, inner = PAYLOADS[payload]
    overrides = overrides | {"run.steps": rounds * inner, "diloco.inner_steps": inner, "run.seed": args.seed}
    config_path = run_dir / "config.json"
    config_path.write_text(in_tree(tree, "import json, sys; from lowcomm.config import default_config; "
                                         f"print(json.dumps(default_config().override({overrides!r}).to_dict(), "
                                         "indent=1))"))
    report_path = run_dir / "report.json"
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--config", str(config_path), "--peers", str(args.peers),
           "--report", str(report_path), "--run-dir", str(run_dir / "run")]
    t0 = time.time()
    rc = run_simulate(cmd, tree, run_dir / "simulate.log", args.timeout_s, env=tree_env(tree))
    out = {"row": name, "payload": payload, "variant": variant, "rep": rep, "rev": getattr(args, variant),
           "commit": tree_commit(tree),
           "lowcomm_file": imported_from(tree), "peers": args.peers, "seed": args.seed, "rounds_planned": rounds,
           "inner_steps": inner, "rc": rc, "row_wall_s": time.time() - t0, "report": str(report_path),
           "command": " ".join(cmd[1:])}
    if report_path.exists():
        report = json.loads(report_path.read_text())
        out.update(figures(report, round_records(run_dir / "run")))
    out["finished"] = rc == 0 and out.get("rounds") == rounds
    return out


def figures(report: dict, records: list[dict]) -> dict:
    sync = [r["sync_s"] for r in records if r.get("sync_s") is not None]
    reduce = [r["reduce_s"] for r in records if r.get("reduce_s") is not None]
    return {"final_loss": report["final_loss"], "rounds": len(report["rounds"]), "model_params": report["model_params"],
            "bytes_sent": report["bytes_sent"], "round_records": len(records),
            "bytes_per_peer_round": statistics.mean(r["bytes"] for r in records) if records else None,
            "sync_s_median": statistics.median(sync) if sync else None,
            "reduce_s_median": statistics.median(reduce) if reduce else None,
            "round_sync_s_median": statistics.median(r["sync_s"] for r in report["rounds"]) if report["rounds"] else None,
            "rejects": sum(e["kind"] == "reject" for e in report["events"]),
            "timeouts": sum(e["kind"] == "timeout" for e in report["events"]),
            "wall_s": report["wall_s"]}


# ---- the micro-benchmark (runs inside the signed worktree: `--micro`) -------------------------------

def micro(payload_bytes: list[int], calls: int) -> dict:
    from lowcomm.collectives.reduce_messages import KIND, part_chunks, signed_header
    from lowcomm.transport.signing import Signer, Verifier, digest

    signer, verifier = Signer.generate(), Verifier()
    blob = os.urandom(64 * 1024)
    header = dict(run_id="lowcomm-default", group="diloco", round=7, epoch=7, shard=2, weight=5120.0, codec="uint8")
    first = next(part_chunks(signer, header, blob, 1 << 20))
    fields = signed_header(first)
    bare = type(first)()
    bare.CopyFrom(first)
    for field in ("sender_key", "signature", "digest"):
        bare.ClearField(field)
    out = {"part_bytes_signed": first.ByteSize(), "part_bytes_unsigned": bare.ByteSize(),
           "overhead_bytes": first.ByteSize() - bare.ByteSize(), "sender_key_bytes": len(first.sender_key),
           "signature_bytes": len(first.signature), "digest_bytes": len(first.digest), "calls": calls}
    for _ in range(10):  # warm-up (the verifier's key cache included)
        verifier.verify(KIND, fields, first.sender, first.sender_key, signer.sign(KIND, fields)[1])
    t0 = time.perf_counter()
    sigs = [signer.sign(KIND, fields)[1] for _ in range(calls)]
    out["sign_ms"] = (time.perf_counter() - t0) / calls * 1e3
    t0 = time.perf_counter()
    for sig in sigs:
        verifier.verify(KIND, fields, first.sender, first.sender_key, sig)
    out["verify_ms"] = (time.perf_counter() - t0) / calls * 1e3
    out["sha256_ms"] = {}
    for size in payload_bytes:
        data = os.urandom(size)
        t0 = time.perf_counter()
        for _ in range(20):
            digest(data)
        out["sha256_ms"][str(size)] = (time.perf_counter() - t0) / 20 * 1e3
    return out


def run_micro(tree: Path, args, part_sizes: list[int]) -> dict:
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--micro", "--micro-sizes",
                           *map(str, part_sizes), "--micro-calls", str(args.micro_calls)], cwd=tree,
                          env=tree_env(tree), check=True, capture_output=True, text=True)
    return json.loads(done.stdout) | {"commit": tree_commit(tree), "lowcomm_file": imported_from(tree)}


# ---- the table -------------------------------------------------------------------------------------

def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(values) if values else None


def _spread(rows: list[dict], key: str, fmt: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def write_table(out: Path, planned: list[tuple[str, str, int]], args) -> str:
    done = {}
    for path in out.glob("*.json"):
        row = json.loads(path.read_text())
        if "row" in row and row.get("peers") == args.peers and row.get("seed") == args.seed:
            done[(row["payload"], row["variant"], row["rep"])] = row
    lines = [f"Unsigned (dc5e231) against signed (210e25a) sharded-reduce parts: DiLoCo (uint8), {args.peers} peers "
             f"on loopback, seed {args.seed}, the two revisions alternating. Per revision: the mean over its "
             "repetitions (min-max in brackets) of each run's mean bytes sent per peer per round, median sync and "
             "reduce time per peer round, and final held-out loss; ratio: signed / unsigned.", "",
             "| payload | revision | runs | bytes / peer / round | sync s / round (median) | reduce s / round "
             "(median) | final loss | rejects, timeouts |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for payload in dict.fromkeys(p for p, _, _ in planned):
        per = {}
        for variant in VARIANTS:
            rows = [r for (p, v, _), r in sorted(done.items()) if p == payload and v == variant and r.get("finished")]
            per[variant] = rows
            if not rows:
                continue
            first = rows[0]
            label = f"{payload} ({first['model_params'] / 1e6:.2f}M params, {first['rounds_planned']}x H={first['inner_steps']})"
            lines.append(f"| {label} | {variant} ({first['commit'][:7]}) | {len(rows)} | "
                         f"{_spread(rows, 'bytes_per_peer_round', ',.0f')} | {_spread(rows, 'sync_s_median', '.3f')} | "
                         f"{_spread(rows, 'reduce_s_median', '.3f')} | {_spread(rows, 'final_loss', '.4f')} | "
                         f"{sum(r['rejects'] for r in rows)}, {sum(r['timeouts'] for r in rows)} |")
        u, s = per["unsigned"], per["signed"]
        if u and s:
            extra = _mean(s, "bytes_per_peer_round") - _mean(u, "bytes_per_peer_round")
            lines.append(f"| {payload} | signed / unsigned | | {_ratio(_mean(s, 'bytes_per_peer_round'), _mean(u, 'bytes_per_peer_round'))} "
                         f"(+{extra:,.0f} B) | {_ratio(_mean(s, 'sync_s_median'), _mean(u, 'sync_s_median'))} | "
                         f"{_ratio(_mean(s, 'reduce_s_median'), _mean(u, 'reduce_s_median'))} | "
                         f"{_ratio(_mean(s, 'final_loss'), _mean(u, 'final_loss'))} | |")
    micro_path = out / "micro.json"
    if micro_path.exists():
        m = json.loads(micro_path.read_text())
        sha = ", ".join(f"{int(size) / 1024:,.0f} KiB {ms:.3f} ms" for size, ms in m["sha256_ms"].items())
        lines += ["", f"Per part (signed worktree, {m['commit'][:7]}, mean of {m['calls']} calls): sign "
                  f"{m['sign_ms']:.3f} ms, verify {m['verify_ms']:.3f} ms; sha256 of a part ({sha}). Bytes: "
                  f"+{m['overhead_bytes']} B per part on its first chunk ({m['part_bytes_unsigned']} → "
                  f"{m['part_bytes_signed']} B for a 64 KiB chunk): sender key {m['sender_key_bytes']} B, signature "
                  f"{m['signature_bytes']} B, digest {m['digest_bytes']} B, plus protobuf tags and lengths."]
    missing = [row_name(*r, args) for r in planned if r not in done]
    unfinished = [r["row"] for r in done.values() if not r.get("finished")]
    if unfinished:
        lines += ["", f"Rows that did not finish (left out of the means): {', '.join(sorted(unfinished))}."]
    return save_table(out, lines, missing)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--payloads", nargs="+", default=list(PAYLOADS), choices=list(PAYLOADS))
    ap.add_argument("--reps", type=int, default=3, help="runs of each revision per payload")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unsigned", default="dc5e231", help="the revision without signatures")
    ap.add_argument("--signed", default="210e25a", help="the revision with signatures")
    ap.add_argument("--worktrees", type=Path, default=Path("/tmp/lowcomm-auth-cost"))
    ap.add_argument("--keep-worktrees", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "auth_cost")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="a row still running after this is stopped")
    ap.add_argument("--micro-calls", type=int, default=200)
    ap.add_argument("--table-only", action="store_true", help="rewrite OUT/table.md from the rows done")
    ap.add_argument("--micro", action="store_true", help=argparse.SUPPRESS)  # inside a worktree: print micro()'s JSON
    ap.add_argument("--micro-sizes", nargs="*", type=int, default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.micro:
        print(json.dumps(micro(args.micro_sizes, args.micro_calls)))
        return 0
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    planned = planned_rows(args)
    if args.table_only:
        print(write_table(args.out, planned, args))
        return 0
    trees = {variant: worktree(args, variant) for variant in VARIANTS}
    for variant, tree in trees.items():
        print(f"{variant}: {getattr(args, variant)} in {tree}, lowcomm from {imported_from(tree)}", flush=True)
    todo = [r for r in planned if not (args.out / f"{row_name(*r, args)}.json").exists()]
    print(f"{len(todo)} of {len(planned)} rows to run, one at a time", flush=True)
    took = []
    for i, (payload, variant, rep) in enumerate(todo):
        result = run_row(payload, variant, rep, trees[variant], args)
        (args.out / f"{result['row']}.json").write_text(json.dumps(result, indent=1))
        took.append(result["row_wall_s"])
        left = len(todo) - i - 1
        print(f"{result['row']}: {'finished' if result['finished'] else 'did not finish'} in "
              f"{result['row_wall_s']:.0f} s; {left} left, ETA {statistics.mean(took) * left / 60:.0f} min", flush=True)
        print(write_table(args.out, planned, args), flush=True)
    if not (args.out / "micro.json").exists():
        rows = [json.loads(p.read_text()) for p in args.out.glob("*-rep*.json")]
        sizes = sorted({r["model_params"] // args.peers for r in rows if r.get("model_params")}) or [64 * 1024]
        (args.out / "micro.json").write_text(json.dumps(run_micro(trees["signed"], args, sizes), indent=1))
    print(write_table(args.out, planned, args), flush=True)
    if not args.keep_worktrees:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
