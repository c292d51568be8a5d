"""Revisions side by side: each in a git worktree of its own, its lowcomm imported from there.

An experiment that compares commits (auth_cost.py, control_plane.py) runs each revision's own source
with this venv's python: PYTHONPATH and the working directory are the revision's worktree, and each
row records the `lowcomm.__file__` its runs imported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worktree(args, variant: str, rev: str | None = None) -> Path:
    """A worktree at ``rev`` (default: the variant's own option, e.g. args.signed) under --worktrees, made or
    reused."""
    rev = rev if rev is not None else getattr(args, variant)
    commit = subprocess.run(["git", "rev-parse", f"{rev}^{{commit}}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    path = args.worktrees / f"{variant}-{commit[:7]}"
    if path.exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()
        if head == commit:
            return path
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True,
                   capture_output=True)
    return path


def tree_env(tree: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")


def in_tree(tree: Path, code: str) -> str:
    """Runs ``code`` with the worktree's lowcomm; its stdout."""
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=tree_env(tree), check=True,
                          capture_output=True, text=True).stdout


def imported_from(tree: Path) -> str:
    where = in_tree(tree, "import lowcomm; print(lowcomm.__file__)").strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"{tree}: lowcomm was imported from {where}, not from the worktree")
    return where


def tree_commit(tree: Path) -> str:
    """The commit a worktree has checked out."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()


def fresh_run_dir(out: Path, row: str) -> Path:
    """OUT/runs/ROW, empty: a killed row's leftovers are removed and the row starts over."""
    run_dir = out / "runs" / row
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    return run_dir


def round_records(run_dir: Path) -> list[dict]:
    """Every `round` record of the peers' JSONL files under the run dir."""
    records = []
    for path in sorted(run_dir.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("type") == "round":
                records.append(record)
    return records


def agreement_s(records: list[dict]) -> float | None:
    """The median over the rounds every peer recorded of the shortest wait for the manifest: the last peer
    to reach a round finds every other one waiting, so its wait is the agreement itself."""
    waits: dict[int, list[float]] = {}
    for r in records:
        if r.get("manifest_s") is not None:
            waits.setdefault(r["round"], []).append(r["manifest_s"])
    everyone = max((len(w) for w in waits.values()), default=0)
    shortest = [min(w) for w in waits.values() if len(w) == everyone]
    return statistics.median(shortest) if shortest else None
