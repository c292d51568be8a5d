"""Chaos: kill -9, leave, join, link down and a slow peer over one run, and a whole-swarm kill + resume.

    python experiments/chaos.py [--rows none chaos resume] [--peers 8] [--rounds 50] [--inner-steps 10]
        [--seed 0] [--spec SPEC] [--checkpoint-every 5] [--kill-round 23] [--margin-s 2] [--no-netns]
        [--out experiments/out/chaos] [--timeout-s 1500] [--table-only]

Rows, each one `lowcomm simulate` of DiLoCo with --peers processes in network namespaces (`--netns`;
`--no-netns` runs them on loopback and drops the link-down actions from the schedule), on the small model of
experiments/byzantine.py (SMALL) so that 50 rounds take minutes on 2 cores:

- ``none``: no chaos, the baseline of the gaps;
- ``chaos``: the schedule --spec (default CHAOS: kill -9, slow peer, link down, leave, joins, a
  second kill and link down, spread over the rounds; docs/simulation.md, "Churn");
- ``resume``: checkpoints every --checkpoint-every rounds, `kill:all` at --kill-round (kill -9 of
  every process group, the coordinator's included), then a second simulate with `--resume` from
  the first one's checkpoint folder and fresh peers, to the end of the run. It checks that the
  peers of the resumed run start from the newest checkpoint's round, and counts the rounds lost
  (rounds the first run finished minus that round; at most the interval).

Per row: the final held-out loss and its gap to ``none``; the rounds completed; the longest sync
wait of any peer's round against the bound of one round's deadlines (announce_s + manifest_s +
reduce_timeout_s + --margin-s: gathering the announcements, the leader's manifest, the reduce to its
deadline), read from the peers' round records; a peer's own rounds while its link was down are
left out of it (they wait for their own outage) and shown apart; the churn events, `reject`
and `timeout` events, and the row's wall time (start-up included). A row whose JSON exists under
--out is skipped (resumable per row); OUT/table.md is rewritten after every row, listing the rows
still missing; the runs' records go to OUT/runs/ (not in git).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from byzantine import SMALL, _gap, _loss  # noqa: E402
from simulate_launch import run_simulate, save_table  # noqa: E402

ROWS = ["none", "chaos", "resume"]
CHAOS = ("kill:1@r6,slow:1:3x@r10,linkdown:1:20s@r14,leave:1@r18,join:2@r22,kill:1@r28,linkdown:1:20s@r33,"
         "join:1@r38")


def row_name(kind: str, args) -> str:
    mode = "" if args.netns else "-loopback"
    extra = f"-k{args.checkpoint_every}-at{args.kill_round}" if kind == "resume" else ""
    return f"{kind}{extra}-p{args.peers}-r{args.rounds}-h{args.inner_steps}-s{args.seed}{mode}"


def write_config(run_dir: Path, args, checkpoint_every: int = 0) -> Path:
    from lowcomm.config import load_config

    overrides = dict(SMALL) | {"run.steps": args.rounds * args.inner_steps, "diloco.inner_steps": args.inner_steps,
                               "run.seed": args.seed, "checkpoint.every_rounds": checkpoint_every,
                               "checkpoint.every_s": 0.0, "checkpoint.max_share": 0.0}
    path = run_dir / "config.json"
    path.write_text(json.dumps(load_config(None).override(overrides).to_dict(), indent=1))
    return path


def simulate(run_dir: Path, config: Path, args, *extra: str) -> tuple[int | str, dict | None, list[str]]:
    """One `lowcomm simulate` in its own process group: (exit code or "timeout", its report or None, command)."""
    report_path = run_dir / "report.json"
    report_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--config", str(config), "--peers", str(args.peers),
           "--report", str(report_path), "--run-dir", str(run_dir / "run"), *(["--netns"] if args.netns else []),
           *extra]
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(run_dir / "run", run_dir.name, args.rounds, stop), daemon=True)
    watcher.start()
    try:
        rc = run_simulate(cmd, REPO, run_dir / "simulate.log", args.timeout_s)
    finally:
        stop.set()
    return rc, json.loads(report_path.read_text()) if report_path.exists() else None, cmd


def watch(run_dir: Path, label: str, rounds: int, stop: threading.Event, every_s: float = 30.0) -> None:
    """Prints the swarm's round every `every_s` seconds while a simulate runs."""
    from lowcomm.runtime.churn import swarm_round
    from lowcomm.runtime.runlog import read_records

    t0 = time.time()
    while not stop.wait(every_s):
        peers = run_dir / "peers"
        records = [r for r in read_records(peers) if r["type"] == "round"] if peers.is_dir() else []
        top = max((r["round"] for r in records), default=-1) + 1
        print(f"  {label}: swarm at round {top}/{rounds} ({swarm_round(records)} rounds run here) after "
              f"{time.time() - t0:.0f} s", flush=True)


def run_row(kind: str, args) -> dict:
    name = row_name(kind, args)
    root = args.out / "runs" / name
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    out = {"row": name, "kind": kind, "peers": args.peers, "rounds_planned": args.rounds,
           "inner_steps": args.inner_steps, "seed": args.seed, "netns": args.netns}
    if kind != "resume":
        spec = args.spec if kind == "chaos" else "none"
        rc, report, cmd = simulate(root, write_config(root, args), args, "--churn", spec)
        out.update(rc=rc, spec=spec, command=" ".join(cmd[1:]))
        if report is not None:
            out.update(figures(report, root / "run", args))
        out["finished"] = rc == 0 and out.get("rounds") == args.rounds
    else:
        out.update(resume_row(root, args))
    out["row_wall_s"] = time.time() - t0
    return out


def resume_row(root: Path, args) -> dict:
    """kill:all at --kill-round with checkpoints every --checkpoint-every rounds, then --resume to the end."""
    from lowcomm.runtime.checkpoint import CheckpointError, load_checkpoint

    first, second = root / "killed", root / "resumed"
    for folder in (first, second):
        folder.mkdir(parents=True, exist_ok=True)
    spec = f"kill:all@r{args.kill_round}"
    rc1, report1, cmd1 = simulate(first, write_config(first, args, args.checkpoint_every), args, "--churn", spec)
    out = {"spec": spec, "rc_killed": rc1, "command": " ".join(cmd1[1:]), "checkpoint_every": args.checkpoint_every}
    if report1 is None:
        return out | {"rc": rc1, "finished": False}
    done_before = max((r["round"] for r in report1["rounds"]), default=-1) + 1
    try:
        checkpoint = load_checkpoint(first / "run" / "checkpoints").round
    except CheckpointError as e:
        return out | {"rc": rc1, "finished": False, "error": str(e), "rounds_before_kill": done_before}
    rc, report, cmd2 = simulate(second, write_config(second, args, args.checkpoint_every), args,
                                "--resume", str(first / "run" / "checkpoints"))
    out.update(rc=rc, command_resumed=" ".join(cmd2[1:]), rounds_before_kill=done_before, checkpoint_round=checkpoint,
               rounds_lost=done_before - checkpoint,
               killed=sum(e["kind"] == "kill" and e.get("by") == "churn" for e in report1["events"]),
               wall_s_killed=report1["wall_s"], startup_s_killed=report1["startup_s"])
    if report is None:
        return out | {"finished": False}
    received = sorted({e["round"] for e in report["events"] if e["kind"] == "state_received"})
    out.update(figures(report, second / "run", args), resumed_at=received)
    rounds = [r["round"] for r in report["rounds"]]
    out["resumed_rounds"] = [min(rounds), max(rounds)] if rounds else None
    out["rounds"] = len(set(range(done_before)) | set(rounds))  # distinct rounds the swarm completed
    out["starts_at_checkpoint"] = received == [checkpoint] and bool(rounds) and min(rounds) == checkpoint
    # the killed run's own exit code is kept apart (rc_killed): its job is to leave a checkpoint and a report
    out["finished"] = rc == 0 and bool(rounds) and max(rounds) == args.rounds - 1 and out["starts_at_checkpoint"]
    return out


def figures(report: dict, run_dir: Path, args) -> dict:
    from lowcomm.runtime.runlog import read_records

    events = report["events"]
    sync = json.loads((run_dir / "run.json").read_text())["sync"]
    bound = sync["announce_s"] + sync["manifest_s"] + sync["reduce_timeout_s"] + args.margin_s
    records = read_records(run_dir / "peers")
    outages = {}  # peer -> [(down t, back t)] in wall time: from its link down until it holds the swarm's state again
    launcher = read_records(run_dir / "launcher")
    for down in (r for r in launcher if r.get("kind") == "linkdown"):
        up = next((r["t"] for r in launcher if r.get("kind") == "linkup" and r.get("name") == down["name"]
                   and r["t"] >= down["t"]), float("inf"))
        back = min((r["t"] for r in records if r["peer"] == down["peer"] and r.get("kind") == "state_received"
                    and r["t"] >= up), default=float("inf"))
        outages.setdefault(down["peer"], []).append((down["t"], back))
    waits, own = [], []
    for r in (r for r in records if r["type"] == "round"):
        hit = any(r["t0"] < up and r["t0"] + r["sync_s"] > down for down, up in outages.get(r["peer"], []))
        (own if hit else waits).append((r["sync_s"], r["round"]))
    churn = Counter(e["kind"] for e in events if e.get("by") == "churn")
    cut_off = sorted({e["peer"] for e in events if e["kind"] == "linkdown"} - {
        r["peer"] for r in records if r.get("kind") == "state_received"})
    finals = [r["loss"] for r in records if r["type"] == "eval" and r.get("final") and r["peer"] not in cut_off]
    return {"final_loss": report["final_loss"], "final_loss_spread": report.get("final_loss_spread"),
            "rounds": len(report["rounds"]), "bound_s": bound,
            "longest_sync_s": max(waits, default=(None, None))[0], "longest_sync_round": max(waits, default=(0, None))[1],
            "rounds_past_bound": sorted({rnd for s, rnd in waits if s > bound}),
            "longest_own_outage_sync_s": max(own, default=(None, None))[0],
            "churn_events": dict(churn), "rejects": sum(e["kind"] == "reject" for e in events),
            "timeouts": sum(e["kind"] == "timeout" for e in events),
            "timeout_rounds": len({e.get("round") for e in events if e["kind"] == "timeout"}),
            "cut_off_final": cut_off, "final_loss_without_cut_off": sum(finals) / len(finals) if finals else None,
            "slowdown_events": sum(e["kind"] == "slowdown" for e in events),
            "wall_s": report["wall_s"], "startup_s": report["startup_s"], "failed_peers": report.get("failed_peers", [])}


def refigure(path: Path, args) -> None:
    """Recomputes a row's figures from the report and records it left under OUT/runs."""
    if not path.exists():
        return
    row = json.loads(path.read_text())
    root = args.out / "runs" / row["row"] / ("resumed" if row["kind"] == "resume" else "")
    if (root / "report.json").exists():
        rounds = row.get("rounds")
        row.update(figures(json.loads((root / "report.json").read_text()), root / "run", args))
        if row["kind"] == "resume":
            row["rounds"] = rounds
            row["finished"] = row["rc"] == 0 and row.get("starts_at_checkpoint") and row["resumed_rounds"] \
                and row["resumed_rounds"][1] == args.rounds - 1
        path.write_text(json.dumps(row, indent=1))


# ---- the table -----------------------------------------------------------------------------------

def _events(row: dict) -> str:
    counts = dict(row.get("churn_events") or {})
    if row["kind"] == "resume":
        counts = {"kill (all)": row.get("killed", 0)} | {k: v for k, v in counts.items() if k != "kill"}
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def _stall(row: dict) -> str:
    longest = row.get("longest_sync_s")
    if longest is None:
        return "n/a"
    past = row.get("rounds_past_bound") or []
    text = f"{longest:.1f} / {row['bound_s']:.0f} (r{row['longest_sync_round']})"
    text += f", {len(past)} past it: r{', r'.join(map(str, past))}" if past else ", none past it"
    if row.get("longest_own_outage_sync_s") is not None:
        text += f"; own outage {row['longest_own_outage_sync_s']:.1f}"
    return text


def _rounds(row: dict, args) -> str:
    text = f"{row.get('rounds', 0)}/{args.rounds}"
    if row["kind"] == "resume" and row.get("checkpoint_round") is not None:
        text += (f" ({row['rounds_before_kill']} before the kill, resumed at r{row['checkpoint_round']} "
                 f"= newest checkpoint{'' if row.get('starts_at_checkpoint') else ' NOT'}: "
                 f"{row['rounds_lost']} rounds lost, interval {row['checkpoint_every']})")
    if not row.get("finished"):
        text += f", did not finish (rc {row.get('rc')})"
    return text


def write_table(out: Path, args) -> str:
    done = {}
    for path in out.glob("*.json"):
        row = json.loads(path.read_text())
        done[row["row"]] = row
    base = done.get(row_name("none", args), {}).get("final_loss")
    mode = "network namespaces" if args.netns else "loopback"
    lines = [f"Chaos, {args.peers} peers of DiLoCo in {mode}, {args.rounds} rounds of H = {args.inner_steps}, seed "
             f"{args.seed}, the small model of experiments/byzantine.py. Gap: final held-out loss against the row "
             "without chaos. Longest sync: the longest any peer's round waited in its sync (s) / the bound of one "
             f"round's deadlines (announce + manifest + reduce deadline + {args.margin_s:g} s margin), its round, the "
             "rounds past it; a peer's own rounds from its link going down until it holds the swarm's state again "
             "(its next `state_received`) are shown apart (own outage). Final loss: the mean of the peers' final "
             "evaluations, with their spread.", "",
             f"Chaos schedule: `{args.spec}`.", "",
             "| row | final loss | gap vs none | rounds | longest sync (s) / bound | churn events | rejects "
             "| timeouts | wall (s) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    missing = []
    for kind in args.rows:
        row = done.get(row_name(kind, args))
        if row is None:
            missing.append(row_name(kind, args))
            continue
        loss, spread = row.get("final_loss"), row.get("final_loss_spread") or 0
        shown = _loss(loss) + (f" (spread {spread:.4f})" if spread > 1e-6 else "")
        timeouts = f"{row.get('timeouts', 'n/a')} in {row.get('timeout_rounds', 'n/a')} rounds"
        lines.append(f"| {kind} | {shown} | {_gap(loss, base)} | {_rounds(row, args)} | {_stall(row)} | "
                     f"{_events(row)} | {row.get('rejects', 'n/a')} | {timeouts} | {row['row_wall_s']:.0f} |")
    for kind in args.rows:
        row = done.get(row_name(kind, args), {})
        if row.get("cut_off_final"):
            rest = row["final_loss_without_cut_off"]
            lines += ["", f"{kind}: {len(row['cut_off_final'])} peer(s) whose link went down never downloaded the "
                      f"swarm's state again ({', '.join(row['cut_off_final'])}): cut off, they went on in rounds of "
                      f"their own (until killed, or to the end, when their final evaluation is in the mean); the "
                      f"other peers' final loss "
                      f"is {_loss(rest)} ({_gap(rest, base)} vs none)."]
    return save_table(out, lines, missing)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--inner-steps", type=int, default=10, help="H")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spec", default=CHAOS, help="the chaos row's --churn schedule")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="resume row: coordinator checkpoint interval")
    ap.add_argument("--kill-round", type=int, default=23, help="resume row: kill:all once the swarm reaches it")
    ap.add_argument("--margin-s", type=float, default=2.0, help="added to one round's deadlines for the stall bound")
    ap.add_argument("--no-netns", dest="netns", action="store_false", help="loopback (no linkdown in --spec)")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "chaos")
    ap.add_argument("--timeout-s", type=float, default=1500.0, help="a simulate still running after this is stopped")
    ap.add_argument("--table-only", action="store_true", help="rewrite OUT/table.md from the rows done")
    ap.add_argument("--refigure", action="store_true", help="with --table-only: recompute the rows' figures from "
                    "their reports and records under OUT/runs first")
    args = ap.parse_args()
    if not args.netns:  # a link can be taken down only in namespace mode
        args.spec = ",".join(part for part in args.spec.split(",") if not part.strip().startswith("linkdown"))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        for kind in args.rows if args.refigure else []:
            refigure(args.out / f"{row_name(kind, args)}.json", args)
        print(write_table(args.out, args))
        return 0
    todo = [kind for kind in args.rows if not (args.out / f"{row_name(kind, args)}.json").exists()]
    print(f"{len(todo)} of {len(args.rows)} rows to run, one at a time", flush=True)
    took = []
    for i, kind in enumerate(todo):
        print(f"row {row_name(kind, args)}: running (records in {args.out / 'runs' / row_name(kind, args)})", flush=True)
        result = run_row(kind, args)
        (args.out / f"{result['row']}.json").write_text(json.dumps(result, indent=1))
        took.append(result["row_wall_s"])
        left = len(todo) - i - 1
        print(f"{result['row']}: {'finished' if result['finished'] else 'did not finish'} in "
              f"{result['row_wall_s']:.0f} s; {left} left, ETA {statistics.mean(took) * left / 60:.0f} min", flush=True)
        print(write_table(args.out, args), flush=True)
    print(write_table(args.out, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
