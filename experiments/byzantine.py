"""Byzantine members against lowcomm's defences: each attack, f of N peers, aggregate defended or not.

    python experiments/byzantine.py [--kinds ...] [--f 2 3] [--aggregates default mean] [--peers 8]
        [--rounds 10] [--inner-steps 10] [--seed 0] [--config TOML] [--aggregate-key KEY]
        [--noise-seeds 1 2] [--out experiments/out/byzantine] [--timeout-s 900] [--table-only]

A row is one `lowcomm simulate` of DiLoCo with --peers processes, f of them Byzantine members of one
kind (`simulate --byzantine KIND:f`, docs/simulation.md), under one aggregate: ``default`` (the run
config's own: defences on) or a named one set through the run-config key `--aggregate-key` (found in
lowcomm.config when not given; ``mean`` is the plain token-weighted mean, defences off). Each
aggregate also gets an honest row (f = 0). The model and run are small (below; `--config` replaces
them with a TOML of your own, layered on the embedded default) so that one row takes a minute or
two on 2 cores.

Per row: the honest peers' final held-out loss (the report's `final_loss`, Byzantine members' own
left out), its gap in % to the honest row under the default aggregate, the peers' `reject` events
(the owners' refusals of parts, and records refused as the DHT returned them),
the rounds in which some member was left out (a `timeout` event: its part was refused or late), the
longest round's sync time against the reduce deadline (a round past it is a stall; "did not
finish": a non-zero exit, a missing report, or fewer rounds than planned), the Byzantine members'
`byzantine` events, and the row's wall time (start-up included). `--noise-seeds` adds honest rows
at other seeds under the default aggregate: their spread is the seed noise a gap is read against.
The ``outsider`` row (every peer honest, under the default aggregate) runs tests/outsider.py beside
the swarm for the whole run: fresh keys that forge parts under members' ids, send parts as
non-members, a decompression bomb, a stream flood, manifests of the coming rounds and sybil φ votes
with a poisoned state (tests/integration/test_outsider_e2e.py); its rejects are the peers' refusals. A row whose JSON exists under --out is skipped (resumable per row);
OUT/table.md is rewritten after every row, listing the rows still missing; the runs' records go to
OUT/runs/ (not in git).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.runtime.byzantine import Kind  # noqa: E402
from simulate_launch import run_simulate, save_table  # noqa: E402

KINDS = [k.value for k in Kind]
SMALL = {  # a run of ROUNDS rounds of H steps on a small GPT; only the final evaluation
    "run.algo": "diloco", "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 2, "model.context": 64,
    "inner.batch_size": 8, "inner.warmup_steps": 10, "data.eval_batches": 8, "data.eval_every_tokens": 1 << 40,
    "sync.announce_s": 3.0, "sync.manifest_s": 3.0, "sync.reduce_timeout_s": 10.0, "checkpoint.every_rounds": 0}


def aggregate_key() -> str | None:
    """The run-config key that names the dense aggregate, where this tree has one."""
    from lowcomm.config import default_config

    config = default_config()
    for section in ("diloco", "sync"):
        if hasattr(getattr(config, section), "aggregate"):
            return f"{section}.aggregate"
    return None


def rows(kinds: list[str], fs: list[int], aggregates: list[str]) -> list[tuple[str, int, str]]:
    """(kind, f, aggregate) of every row, the honest ones (kind "honest", f = 0) first, the outsider last."""
    return ([("honest", 0, a) for a in aggregates] + [(k, f, a) for k in kinds for f in fs for a in aggregates]
            + [("outsider", 0, "default")])


def row_name(kind: str, f: int, aggregate: str, args, seed: int | None = None) -> str:
    who = kind if kind in ("honest", "outsider") else f"{kind}-f{f}"
    return f"{who}-{aggregate}-p{args.peers}-r{args.rounds}-h{args.inner_steps}-s{args.seed if seed is None else seed}"


def run_row(kind: str, f: int, aggregate: str, args, seed: int | None = None) -> dict:
    """One `lowcomm simulate` in its own process group; its figures (and where its report is)."""
    from lowcomm.config import load_config

    seed = args.seed if seed is None else seed
    name = row_name(kind, f, aggregate, args, seed)
    run_dir = args.out / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = ({} if args.config else dict(SMALL)) | {
        "run.steps": args.rounds * args.inner_steps, "diloco.inner_steps": args.inner_steps, "run.seed": seed}
    if aggregate != "default":
        if args.aggregate_key is None:
            raise SystemExit(f"aggregate {aggregate!r}: this tree's run config names no aggregate; give --aggregate-key")
        overrides[args.aggregate_key] = aggregate
    config_path = run_dir / "config.json"
    config = load_config(args.config).override(overrides)
    config_path.write_text(json.dumps(config.to_dict(), indent=1))
    report_path = run_dir / "report.json"
    report_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--config", str(config_path), "--peers", str(args.peers),
           "--report", str(report_path), "--run-dir", str(run_dir / "run")]
    if kind not in ("honest", "outsider"):
        cmd += ["--byzantine", f"{kind}:{f}"]
    t0 = time.time()
    outsider = None
    if kind == "outsider":
        sys.path.insert(0, str(REPO / "tests"))
        from outsider_process import start_outsider, stop_outsider

        outsider = start_outsider(run_dir / "run", args.timeout_s)
    try:
        rc = run_simulate(cmd, REPO, run_dir / "simulate.log", args.timeout_s)
    finally:
        if outsider is not None:
            stop_outsider(outsider, run_dir / "run")
    out = {"row": name, "kind": kind, "f": f, "aggregate": aggregate, "peers": args.peers, "rounds_planned": args.rounds,
           "inner_steps": args.inner_steps, "seed": seed, "rc": rc, "deadline_s": config.sync.reduce_timeout_s, "row_wall_s": time.time() - t0,
           "report": str(report_path), "command": " ".join(cmd[1:])}
    if report_path.exists():
        out.update(figures(json.loads(report_path.read_text())))
    out["finished"] = rc == 0 and out.get("rounds") == args.rounds
    return out


def figures(report: dict) -> dict:
    events = report["events"]
    timeouts = sorted({e["round"] for e in events if e["kind"] == "timeout" and e.get("round") is not None})
    return {"final_loss": report["final_loss"], "final_loss_byzantine": report.get("final_loss_byzantine"),
            "byzantine_peers": report.get("byzantine", []), "rounds": len(report["rounds"]),
            "rejects": sum(e["kind"] == "reject" for e in events),
            "byzantine_events": sum(e["kind"] == "byzantine" for e in events),
            "timeout_rounds": timeouts, "longest_sync_s": max((r["sync_s"] for r in report["rounds"]), default=None),
            "mean_sync_s": statistics.fmean([r["sync_s"] for r in report["rounds"]]) if report["rounds"] else None,
            "announce_waits": sum(e["kind"] == "timeout" and e.get("stage") == "announce" and not e.get("settled")
                                  for e in events),
            "wall_s": report["wall_s"], "startup_s": report["startup_s"],
            "failed_peers": report.get("failed_peers", [])}


# ---- the table -----------------------------------------------------------------------------------

def _loss(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.3g}"  # a diverged run's loss in a few digits


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _gap(loss, base) -> str:
    if loss is None or not base:
        return "n/a"
    if not math.isfinite(loss):
        return "diverged"
    gap = (loss / base - 1) * 100
    return f"{gap:+.2f}%" if abs(gap) < 1e3 else f"{gap:+.2g}%"


def write_table(out: Path, planned: list[tuple[str, int, str]], args) -> str:
    done = {}
    for path in out.glob("*.json"):
        row = json.loads(path.read_text())
        done[(row["kind"], row["f"], row["aggregate"], row["peers"], row["rounds_planned"], row["inner_steps"],
              row["seed"])] = row
    same = (args.peers, args.rounds, args.inner_steps, args.seed)
    base = done.get(("honest", 0, "default", *same), {}).get("final_loss")
    lines = [f"Byzantine members, {args.peers} peers of DiLoCo, {args.rounds} rounds of H = {args.inner_steps}, "
             f"seed {args.seed}. Gap: the honest peers' final loss against the honest row under the default "
             "aggregate. Left out: rounds in which some member was left out (its part refused or late); "
             "longest sync: the slowest round's sync time against the reduce deadline (past it: a stall); "
             "announce waits: the peer-rounds whose gather waited `sync.announce_s` for a record that did not "
             "announce (not those that ended on the round's manifest).", ""]
    noise = {s: done.get(("honest", 0, "default", *same[:3], s), {}).get("final_loss")
             for s in [args.seed, *args.noise_seeds]}
    if len(noise) > 1 and all(v is not None for v in noise.values()) and base:
        gaps = ", ".join(f"seed {s}: {_gap(v, base)}" for s, v in noise.items() if s != args.seed)
        lines += [f"Seed noise: the honest run under the default aggregate at other seeds, against seed {args.seed}: "
                  f"{gaps}.", ""]
    lines += ["| attack | f | aggregate | honest final loss | gap vs honest | rejects | left out | longest sync (s) "
              "| mean sync (s) | announce waits | byzantine events | row wall (s) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    missing = []
    for kind, f, aggregate in planned + sorted(k[:3] for k in done if k[3:] == same and k[:3] not in planned):
        row = done.get((kind, f, aggregate, *same))
        if row is None:
            missing.append(row_name(kind, f, aggregate, args))
            continue
        loss = row.get("final_loss")
        left_out = f"{len(row['timeout_rounds'])} rounds" if row.get("timeout_rounds") else "none"
        longest, deadline = row.get("longest_sync_s"), row.get("deadline_s")
        sync = "n/a" if longest is None else f"{longest:.1f}" + (f" of {deadline:g}" if deadline else "")
        if deadline and longest is not None and longest > deadline:
            sync += " (stall)"
        if not row.get("finished"):
            sync += f"; did not finish (rc {row['rc']}, {row.get('rounds', 0)}/{row['rounds_planned']} rounds)"
        lines.append(f"| {kind} | {f} | {aggregate} | {_loss(loss)} | {_gap(loss, base)} | {row.get('rejects', 'n/a')} | "
                     f"{left_out} | {sync} | {_num(row.get('mean_sync_s'))} | {row.get('announce_waits', 'n/a')} | "
                     f"{row.get('byzantine_events', 'n/a')} | {row['row_wall_s']:.0f} |")
    return save_table(out, lines, missing)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", nargs="*", default=KINDS, choices=KINDS, help="none: the honest and outsider rows only")
    ap.add_argument("--f", nargs="+", type=int, default=[2, 3], help="Byzantine members per row")
    ap.add_argument("--aggregates", nargs="+", default=["default", "mean"],
                    help="default: the run config's own (defences on); any other is set through --aggregate-key")
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inner-steps", type=int, default=10, help="H")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise-seeds", nargs="*", type=int, default=[1, 2],
                    help="honest rows at these seeds too (default aggregate): the seed noise")
    ap.add_argument("--config", type=Path, help="a run config (TOML) instead of the script's small run")
    ap.add_argument("--aggregate-key", default=None, help="run-config key of the aggregate (default: found in "
                    "lowcomm.config, e.g. diloco.aggregate)")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "byzantine")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="a row still running after this is stopped")
    ap.add_argument("--table-only", action="store_true", help="rewrite OUT/table.md from the rows done")
    args = ap.parse_args()
    args.aggregate_key = args.aggregate_key or aggregate_key()
    if any(f >= args.peers for f in args.f):
        ap.error(f"--f must leave honest peers among --peers {args.peers}")
    args.out.mkdir(parents=True, exist_ok=True)
    planned = rows(args.kinds, args.f, args.aggregates)
    if args.table_only:
        if not any(args.out.glob("*.json")):  # the rows are not kept in git: keep the table that is there
            print(f"no rows in {args.out}: run the rows first (without --table-only)", file=sys.stderr)
            return 1
        print(write_table(args.out, planned, args))
        return 0
    planned_runs = [(*r, args.seed) for r in planned] + [("honest", 0, "default", s) for s in args.noise_seeds]
    todo = [r for r in planned_runs if not (args.out / f"{row_name(*r[:3], args, r[3])}.json").exists()]
    print(f"{len(todo)} of {len(planned_runs)} rows to run, one at a time", flush=True)
    took = []
    for i, (kind, f, aggregate, seed) in enumerate(todo):
        result = run_row(kind, f, aggregate, args, seed)
        (args.out / f"{result['row']}.json").write_text(json.dumps(result, indent=1))
        took.append(result["row_wall_s"])
        left = len(todo) - i - 1
        print(f"{result['row']}: {'finished' if result['finished'] else 'did not finish'} in "
              f"{result['row_wall_s']:.0f} s; {left} left, ETA {statistics.mean(took) * left / 60:.0f} min", flush=True)
        print(write_table(args.out, planned, args), flush=True)
    print(write_table(args.out, planned, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
