"""What the control plane costs on the wire: revisions side by side in network namespaces at 20 Mbit/s.

    sudo python experiments/control_plane.py [--revisions polling=42d939f wakes=HEAD replica-reads=5840d0c]
        [--algos diloco sparseloco] [--peers 4] [--steps 300] [--link 20mbit] [--seed 0] [--reps 1]
        [--worktrees /tmp/lowcomm-control-plane] [--keep-worktrees] [--out experiments/out/control_plane]
        [--timeout-s 900] [--table-only] [--settings NAME:SECTION.KEY=VALUE ...]

The revisions: ``polling`` (42d939f) polls the DHT every 50 ms while a round is agreed, each read
merged from every DHT node (hivemind's latest=True), and the coordinator checkpoints every 5 rounds;
``wakes`` (this tree, Decision 28) ends those waits on Wake hints (transport.wakeups) with a 0.5 s
fallback poll, turns hivemind's caching off, and the coordinator follows rounds every second and
checkpoints at most every 600 s; ``replica-reads`` (5840d0c, withdrawn) also read the round's
records from the first replica found, the node's own storage in a swarm this small. Each runs from
a git worktree of its own (experiments/revisions.py).

A row is one `lowcomm simulate --netns --link RATE --peers N --steps S` of one algorithm at one
revision, with the default run otherwise (DiLoCo uint8 or SparseLoCo, H = 30, the default model):
the kernel counts every byte each namespace sends, the DHT's apart. Per row: the wire bytes, the
DHT's (control) and the checkpoint downloads' shares of them, the DHT's share of what the nodes
sent from the peers' release on ("in training": joining left out; revisions that report it), the
DHT's bytes per node and second of the run (startup included), the peers' mean `manifest_s` per
round (announcement to manifest, waiting for slower peers included), the DHT calls by kind
(revisions that count them), the final held-out loss. Repetitions alternate the order of the revisions.

``--settings ttl30:sync.record_ttl_s=30`` runs the revision named ttl30 with that config value (a TOML
file given to `simulate --config`), so one commit can be measured under other settings.

A row whose JSON exists under --out is skipped (resumable per row); OUT/table.md is rewritten after
every row, listing the rows still missing; the runs go to OUT/runs/ (not in git).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from revisions import agreement_s, fresh_run_dir, imported_from, round_records, tree_commit, tree_env, worktree
from simulate_launch import run_simulate, save_table  # beside this script (its folder is on sys.path)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REVISIONS = ["polling=42d939f", "wakes=HEAD", "replica-reads=5840d0c"]


def parse_revisions(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, rev = item.partition("=")
        if not sep or not name or not rev:
            raise SystemExit(f"--revisions takes NAME=REV, e.g. polling=42d939f (got {item!r})")
        out[name] = rev
    return out


def parse_settings(items: list[str]) -> dict[str, dict[str, str]]:
    """NAME:SECTION.KEY=VALUE items -> {NAME: {"SECTION.KEY": "VALUE"}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, setting = item.partition(":")
        key, eq, value = setting.partition("=")
        if not sep or not eq or "." not in key:
            raise SystemExit(f"--settings takes NAME:SECTION.KEY=VALUE, e.g. ttl30:sync.record_ttl_s=30 (got {item!r})")
        out.setdefault(name, {})[key] = value
    return out


def settings_toml(settings: dict[str, str]) -> str:
    """A run config overlay of these SECTION.KEY values (TOML literals: numbers, true/false, quoted strings)."""
    sections: dict[str, list[str]] = {}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, []).append(f"{name} = {value}")
    return "".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in sections.items())


def row_name(algo: str, name: str, rep: int, args) -> str:
    return f"{algo}-{name}-rep{rep}-p{args.peers}-{args.steps}-{args.link}-s{args.seed}"


def planned_rows(args) -> list[tuple[str, str, int]]:
    names = list(args.revisions)
    rows = []
    for algo in args.algos:
        for rep in range(args.reps):
            rows += [(algo, name, rep) for name in (names if rep % 2 == 0 else names[::-1])]
    return rows


def run_row(algo: str, name: str, rep: int, tree: Path, args) -> dict:
    row = row_name(algo, name, rep, args)
    run_dir = fresh_run_dir(args.out, row)
    report_path = run_dir / "report.json"
    cmd = [sys.executable, "-m", "lowcomm.cli", "simulate", "--netns", "--link", args.link, "--algo", algo,
           "--peers", str(args.peers), "--steps", str(args.steps), "--seed", str(args.seed),
           "--report", str(report_path), "--run-dir", str(run_dir / "run")]
    if args.settings.get(name):
        config = run_dir / "settings.toml"
        config.write_text(settings_toml(args.settings[name]))
        cmd += ["--config", str(config)]
    t0 = time.time()
    rc = run_simulate(cmd, tree, run_dir / "simulate.log", args.timeout_s, env=tree_env(tree))
    out = {"row": row, "algo": algo, "revision": name, "rev": args.revisions[name], "commit": tree_commit(tree),
           "rep": rep,
           "lowcomm_file": imported_from(tree), "peers": args.peers, "steps": args.steps, "link": args.link,
           "seed": args.seed, "rc": rc, "row_wall_s": time.time() - t0, "command": " ".join(cmd[1:])}
    if report_path.exists():
        out.update(figures(json.loads(report_path.read_text()), round_records(run_dir / "run")))
    out["finished"] = rc == 0 and bool(out.get("rounds"))
    return out


def figures(report: dict, records: list[dict]) -> dict:
    wire, control = report.get("wire_bytes"), report.get("control_bytes")
    lifetime_s = report["startup_s"] + report["wall_s"]
    nodes = len(report.get("netns_nodes") or {}) or None
    manifest = [r["manifest_s"] for r in records if r.get("manifest_s") is not None]
    return {"final_loss": report["final_loss"], "rounds": len(report["rounds"]), "bytes_sent": report["bytes_sent"],
            "wire_bytes": wire, "control_bytes": control, "checkpoint_bytes": report.get("checkpoint_bytes", 0),
            "wire_bytes_training": report.get("wire_bytes_training"),
            "control_bytes_training": report.get("control_bytes_training"),
            "nodes": nodes, "lifetime_s": lifetime_s,
            "control_bytes_per_node_s": control / nodes / lifetime_s if control is not None and nodes else None,
            "manifest_s_mean": statistics.mean(manifest) if manifest else None,
            "agreement_s": agreement_s(records),
            "control_calls": report.get("control_calls") or {}, "wall_s": report["wall_s"]}


def write_table(out: Path, planned: list[tuple[str, str, int]], args) -> str:
    done = {}
    for path in out.glob("*.json"):
        row = json.loads(path.read_text())
        if row.get("row") and row.get("finished"):
            if "agreement_s" not in row and (out / "runs" / row["row"] / "run").is_dir():  # a row written without the column
                row["agreement_s"] = agreement_s(round_records(out / "runs" / row["row"] / "run"))
            done[(row["algo"], row["revision"], row["rep"])] = row
    lines = [f"{args.peers} peers in network namespaces, {args.link} htb caps, {args.steps} steps each (the default "
             f"run: H = 30), seed {args.seed}. Shares are of every byte the namespaces sent; DHT B/s per node: "
             "the DHT's bytes over the run's life (startup and training) and its nodes (the peers and the "
             "coordinator); manifest s: the peers' mean wait from announcing a round to its manifest, waiting "
             "for slower peers included; agreement s: the median over rounds of the last peer's wait (everyone "
             "else waits already); DHT calls: per peer and round, where counted.", "",
             "| algorithm | revision | runs | wire MB | DHT share | in training | checkpoint share | "
             "DHT KB/s per node | manifest s | agreement s | DHT calls / peer / round | final loss |",
             "| --- " * 12 + "|"]
    for algo in dict.fromkeys(a for a, _, _ in planned):
        for name in args.revisions:
            rows = [r for (a, n, _), r in sorted(done.items()) if a == algo and n == name]
            if not rows:
                continue
            mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
            share = lambda key: statistics.mean(r[key] / r["wire_bytes"] for r in rows)  # noqa: E731
            calls = [sum(r["control_calls"].values()) / (r["rounds"] * r["peers"]) for r in rows if r["control_calls"]]
            training = [r["control_bytes_training"] / r["wire_bytes_training"] for r in rows
                        if r.get("wire_bytes_training")]
            lines.append(f"| {algo} | {name} ({rows[0]['commit'][:7]}) | {len(rows)} | "
                         f"{mean('wire_bytes') / 1e6:.1f} | "
                         f"{share('control_bytes'):.1%} | "
                         f"{f'{statistics.mean(training):.1%}' if training else 'n/a'} | "
                         f"{share('checkpoint_bytes'):.1%} | "
                         f"{mean('control_bytes_per_node_s') / 1e3:.1f} | {mean('manifest_s_mean'):.3f} | "
                         f"{mean('agreement_s'):.3f} | "
                         f"{f'{statistics.mean(calls):.1f}' if calls else 'not counted'} | {mean('final_loss'):.4f} |")
    missing = [row_name(a, n, r, args) for a, n, r in planned if (a, n, r) not in done]
    return save_table(out, lines, missing)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revisions", nargs="+", default=DEFAULT_REVISIONS, help="NAME=REV, in the table's order")
    ap.add_argument("--algos", nargs="+", default=["diloco", "sparseloco"])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--link", default="20mbit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--worktrees", type=Path, default=Path("/tmp/lowcomm-control-plane"))
    ap.add_argument("--keep-worktrees", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "control_plane")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--settings", nargs="*", default=[], help="NAME:SECTION.KEY=VALUE: a config value for that revision")
    args = ap.parse_args()
    args.revisions = parse_revisions(args.revisions)
    args.settings = parse_settings(args.settings)
    args.out = args.out.resolve()  # the runs start in each revision's worktree
    args.out.mkdir(parents=True, exist_ok=True)
    planned = planned_rows(args)
    if args.table_only:
        print(write_table(args.out, planned, args))
        return
    trees = {name: worktree(args, name, rev) for name, rev in args.revisions.items()}
    try:
        for i, (algo, name, rep) in enumerate(planned):
            path = args.out / f"{row_name(algo, name, rep, args)}.json"
            if path.exists() and json.loads(path.read_text()).get("finished"):
                continue
            started = time.time()
            print(f"[{i + 1}/{len(planned)}] {algo} at {name} ({args.revisions[name]}), rep {rep}", flush=True)
            row = run_row(algo, name, rep, trees[name], args)
            path.write_text(json.dumps(row, indent=1))
            left = len(planned) - i - 1
            print(f"  rc {row['rc']}, {time.time() - started:.0f}s; about {left * (time.time() - started) / 60:.0f} "
                  "min left", flush=True)
            write_table(args.out, planned, args)
    finally:
        if not args.keep_worktrees:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    print(write_table(args.out, planned, args))


if __name__ == "__main__":
    main()
