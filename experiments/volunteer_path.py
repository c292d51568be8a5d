"""The volunteer's path from nothing to contributing, timed on this machine.

    python experiments/volunteer_path.py [--registry] [--checkout .] [--python PYTHON] [--workdir DIR]
        [--venv VENV] [--keep] [--timeout-s 900] [--out experiments/out/volunteer_path]

The install, as the README tells a volunteer: a fresh venv (`python3 -m venv`), `pip install
torch==2.13.0`, then `pip install -c constraints.txt CHECKOUT` (not editable). pip's cache is off
(PIP_NO_CACHE_DIR=1): each package comes from where pip is set up to look, a wheel folder or a local
index included, and pip's `Downloading` lines add up what came over the network. `--registry` makes
the second install `pip --isolated`, so that every package but torch comes from the registry; torch
2.13.0 stays where pip finds it (the registry's own is the CUDA build, several GB). `--venv` skips
the install and times only the join with an existing venv.

Then the join: the run owner's coordinator starts here on the embedded default run (DiLoCo, H = 30,
the byte-level GPT on the stdlib text) and prints the join command; the volunteer runs it with
`--config peers/cpu.toml`, on loopback and free ports, with an empty corpus cache (LOWCOMM_CACHE),
until the peer's first round record lists it among the contributors. From the moment `peer join`
starts, the table gives: joined (its start event: the signed config fetched, DHT and gRPC up),
first inner step, first contribution. Both processes are stopped (SIGTERM to each process group,
then SIGKILL) and the work folder removed unless --keep. Writes result.json and table.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOWNLOAD = re.compile(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")


def timed(label: str, command: list[str], log: Path, env: dict, timeout_s: float, rows: list) -> None:
    started = time.monotonic()
    with open(log, "ab") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=True, timeout=timeout_s)
    rows.append((label, time.monotonic() - started, " ".join(command)))
    print(f"{label}: {rows[-1][1]:.1f} s", file=sys.stderr, flush=True)


def install(python: str, venv: Path, checkout: Path, work: Path, timeout_s: float, rows: list,
            registry: bool) -> float:
    """The three install steps, timed; returns the MB pip downloaded (what it printed as `Downloading`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_NO_CACHE_DIR="1", PIP_PROGRESS_BAR="off")
    log = work / "install.log"
    timed("venv", [python, "-m", "venv", str(venv)], log, env, timeout_s, rows)
    pip = str(venv / "bin" / "pip")
    timed("pip install torch==2.13.0", [pip, "install", "torch==2.13.0"], log, env, timeout_s, rows)
    isolated = ["--isolated"] if registry else []  # no local wheel folder or index: the registry alone
    timed("pip install -c constraints.txt CHECKOUT",
          [pip, *isolated, "install", "-c", str(checkout / "constraints.txt"), str(checkout)],
          log, env, timeout_s, rows)
    units = {"kB": 1 / 1000, "MB": 1.0, "GB": 1000.0}
    return sum(float(size) * units[unit] for size, unit in DOWNLOAD.findall(log.read_text(errors="replace")))


def start(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def wait_for(what: str, check, process: subprocess.Popen, log: Path, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout_s:.0f} s; see {log}")
        time.sleep(0.2)


def join_command(log: Path) -> list[str] | None:
    """The command the coordinator printed under `peers join with:`."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("peers join with:"):
            return lines[i + 1].split()
    return None


def records(folder: Path) -> list[dict]:
    found = []
    for path in sorted(folder.glob("peers/*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    return found


def first(kind: str, found: list[dict], test=lambda r: True) -> dict | None:
    return next((r for r in found if (r["type"] == kind or r.get("kind") == kind) and test(r)), None)


def stop(process: subprocess.Popen | None) -> int | None:
    if process is None:
        return None
    for sig, wait_s in ((signal.SIGTERM, 90), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the DHT helper and p2pd, if any outlived the peer
    except ProcessLookupError:
        pass
    return process.returncode


def join(venv: Path, checkout: Path, work: Path, timeout_s: float, rows: list) -> dict:
    lowcomm = str(venv / "bin" / "lowcomm")
    env = dict(os.environ, LOWCOMM_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1")
    coordinator = peer = None
    try:
        t0 = time.monotonic()
        coordinator_log = work / "coordinator.log"
        coordinator = start([lowcomm, "coordinator", "start", "--run-dir", str(work / "coordinator"),
                             "--host", "127.0.0.1"], coordinator_log, env)
        printed = wait_for("the coordinator's join command", lambda: join_command(coordinator_log), coordinator,
                           coordinator_log, timeout_s)
        rows.append(("coordinator up (the run owner's, not the volunteer's)", time.monotonic() - t0,
                     "lowcomm coordinator start --host 127.0.0.1"))
        peer_dir, peer_log = work / "peer", work / "peer.log"
        command = [lowcomm, *printed[1:], "--config", str(checkout / "peers" / "cpu.toml"), "--host", "127.0.0.1",
                   "--port", "0", "--dht-port", "0", "--run-dir", str(peer_dir),
                   "--key-file", str(peer_dir / "peer.key")]
        started_wall, started = time.time(), time.monotonic()
        peer = start(command, peer_log, env)
        joined = wait_for("the peer's start event", lambda: first("start", records(peer_dir)), peer, peer_log,
                          timeout_s)
        me = joined["peer"]
        contributed = wait_for("the peer's first contribution", lambda: first(
            "round", records(peer_dir), lambda r: r.get("peer") == me and me in r.get("contributors", [])),
            peer, peer_log, timeout_s)
        elapsed = time.monotonic() - started
        compute = first("compute", records(peer_dir), lambda r: r.get("first_step_t"))
        shown = " ".join(["lowcomm", *printed[1:3], "... --config peers/cpu.toml"])
        rows.append(("peer join -> joined (start event)", joined["t"] - started_wall, shown))
        if compute is not None:
            rows.append(("peer join -> first inner step", compute["first_step_t"] - started_wall, ""))
        rows.append(("peer join -> first contribution (round record)", elapsed, f"round {contributed['round']}"))
        print(f"first contribution after {elapsed:.1f} s", file=sys.stderr, flush=True)
        return {"peer": me, "round": contributed["round"], "peer_command": command}
    finally:
        codes = {"peer": stop(peer), "coordinator": stop(coordinator)}
        print(f"stopped: {codes}", file=sys.stderr)


def table(rows: list, meta: dict) -> str:
    lines = [f"Volunteer path on this machine ({meta['cores']} cores, {meta['python']}); "
             f"venv {meta.get('venv_mb', '-')} MB after the install, pip downloaded "
             f"{meta.get('downloaded_mb', '-')} MB{' (--registry)' if meta.get('registry') else ''}.", "",
             "| phase | seconds | command |", "| --- | ---: | --- |"]
    lines += [f"| {label} | {seconds:.1f} | `{command}` |" if command else f"| {label} | {seconds:.1f} | |"
              for label, seconds, command in rows]
    install_s = sum(s for label, s, _ in rows if label.startswith(("venv", "pip")))
    if install_s:
        lines.append(f"| install in all | {install_s:.1f} | |")
    return "\n".join(lines) + "\n"


def du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path, default=REPO,
                        help="the lowcomm checkout to install (default: this one)")
    parser.add_argument("--workdir", type=Path, help="work folder (default: a new one under /tmp)")
    parser.add_argument("--python", default=getattr(sys, "_base_executable", sys.executable),
                        help="the interpreter the fresh venv is made from (default: the one under this venv)")
    parser.add_argument("--venv", type=Path, help="an existing venv with lowcomm: skip the install, time the join")
    parser.add_argument("--registry", action="store_true", help="install lowcomm's dependencies from the "
                        "registry alone (`pip --isolated`: no wheel folder or local index pip is set up with)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (venv, logs, records)")
    parser.add_argument("--timeout-s", type=float, default=900, help="bound on each phase")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "out" / "volunteer_path")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lowcomm-volunteer-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list = []
    meta = {"cores": os.cpu_count(), "python": sys.version.split()[0], "checkout": str(checkout),
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        venv = args.venv or work / "venv"
        if args.venv is None:
            meta["downloaded_mb"] = round(install(args.python, venv, checkout, work, args.timeout_s, rows,
                                                  args.registry))
            meta["registry"] = args.registry
        meta["venv_mb"] = round(du_mb(venv))
        meta.update(join(venv, checkout, work, args.timeout_s, rows))
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    shown = {str(venv): "VENV", str(checkout): "CHECKOUT", args.python: "python3"}
    for i, (label, seconds, command) in enumerate(rows):
        for path, name in shown.items():
            command = command.replace(path, name)
        rows[i] = (label, seconds, command)
    text = table(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    (args.out / "result.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
