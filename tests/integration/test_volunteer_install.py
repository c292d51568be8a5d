"""The volunteer's install runs: the Docker image's entry command and the systemd unit's ExecStart,
each run here as a plain process against a real coordinator on localhost, join and train, and leave
cleanly on SIGTERM as `docker stop` sends it (to the container's first process: the peer) and as
`systemctl stop` does with KillMode=control-group (to every process of the unit: the peer's group).

The command is the one the file holds, parsed as Docker (ENTRYPOINT, exec form) and systemd
(ExecStart) read it: `lowcomm` is this venv's, the profile is the repository's copy that the image
COPYs (for the unit, peers/cpu.toml filled in as its install steps say), the run-dir volume or state
directory is a temporary folder, and the environment is the image's ENV or the unit's Environment=,
rewritten the same way. The image gets the flags a volunteer appends after `docker run IMAGE`; both
listen on loopback and on free ports instead of the profile's fixed ones, so that the test does not
depend on 31400 and 31401 being free. Where a Docker engine answers, the CPU image is also built and
run; elsewhere that test is skipped and the plain-process tests stand for it."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from children import events, wait_until
from volunteer import PEERS, REPO, Dockerfile, read_unit, rewrite, unit_environment

from lowcomm.config import default_config
from lowcomm.runtime.processes import child_env
from lowcomm.runtime.runlog import read_records
from lowcomm.runtime.sim import Simulation

JOIN_S = 240.0  # joining and a first round take seconds; only a hang reaches these bounds
LEAVE_S = 90.0
CPU_DOCKERFILE = PEERS / "Dockerfile"


def short_rounds():
    """Rounds of 10 steps of the default model, as in test_stop_signals: the peer is signalled just after
    its first round, so the signal lands in the next round's inner steps. (A peer signalled as a whole
    group while it waits on the DHT waits out the DHT's call deadline, 30 s, before it leaves: the DHT's
    process dies first and the call never returns.)"""
    return default_config().override({"run.steps": 100000, "diloco.inner_steps": 10, "data.eval_every_tokens": 10 ** 9,
                                       "checkpoint.every_rounds": 0})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_lowcomm() -> str:
    found = Path(sys.executable).with_name("lowcomm")
    return str(found) if found.exists() else shutil.which("lowcomm")


def docker_command(state: Path) -> tuple[list[str], dict[str, str], Path]:
    """The CPU image's ENTRYPOINT with the paths inside the image moved here, and its ENV."""
    image = Dockerfile.read(CPU_DOCKERFILE)
    command = image.entrypoint
    profile = command[command.index("--config") + 1]
    mapping = {profile: image.profile_source(profile), **{volume: state for volume in image.volumes}}
    env = {name: rewrite([value], mapping)[0] for name, value in image.env.items()}
    return [local_lowcomm(), *rewrite(command[1:], mapping)], env, state


def systemd_command(state: Path, coordinator: dict, ports: tuple[int, int]) -> tuple[list[str], dict[str, str], Path]:
    """The unit's ExecStart with /etc/lowcomm/peer.toml made as its install steps say (a profile from
    peers/ with coordinator, run_key and run_name set) and its state directory moved here."""
    service = read_unit()["Service"]
    command = shlex.split(service["ExecStart"])
    profile = command[command.index("--config") + 1]
    filled = state.parent / "peer.toml"
    text = re.sub(r"(?m)^port = \d+", f"port = {ports[0]}", (PEERS / "cpu.toml").read_text())
    text = re.sub(r"(?m)^dht_port = \d+", f"dht_port = {ports[1]}", text)
    filled.write_text(text + f'host = "127.0.0.1"\ncoordinator = {json.dumps(coordinator["maddrs"][:1])}\n'
                      f'run_key = {json.dumps(coordinator["run_key"])}\nrun_name = {json.dumps(coordinator["run"])}\n')
    mapping = {profile: filled, f"/var/lib/{service['StateDirectory']}": state}
    env = {name: rewrite([value], mapping)[0] for name, value in unit_environment(service).items()}
    (cwd,) = rewrite([service["WorkingDirectory"]], mapping)
    return [local_lowcomm(), *rewrite(command[1:], mapping)], env, Path(cwd)


def run_and_stop(command: list[str], env: dict[str, str], cwd: Path, state: Path, log: Path,
                 whole_group: bool) -> tuple[int, list[dict]]:
    """Starts `command` in its own process group, waits for its first contribution, sends SIGTERM to the
    group (systemd's KillMode=control-group) or to the peer alone (`docker stop`: the container's first
    process); its exit code and records. The group is SIGKILLed on every way out."""
    cwd.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        peer = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                env={**child_env(), **env}, start_new_session=True)

    def contributed():
        assert peer.poll() is None, f"the peer exited with {peer.returncode}:\n{log.read_text()[-3000:]}"
        records = read_records(state / "peers")
        me = {r["peer"] for r in events(records, "start")}
        return any(r["type"] == "round" and me & set(r["contributors"]) for r in records)

    try:
        wait_until(contributed, JOIN_S, "the peer's first contribution")
        if whole_group:
            os.killpg(peer.pid, signal.SIGTERM)
        else:
            peer.send_signal(signal.SIGTERM)
        code = peer.wait(timeout=LEAVE_S)
        wait_until(lambda: not group_alive(peer.pid), 30, "the peer's process group (DHT child, p2pd) to end")
    finally:
        try:
            os.killpg(peer.pid, signal.SIGKILL)  # whatever of the group is left (p2pd outlives a killed peer)
        except ProcessLookupError:
            pass
        peer.wait(timeout=30)
    return code, read_records(state / "peers")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(600)
@pytest.mark.parametrize("entry", ["docker", "systemd"])
def test_the_install_runs_a_peer_that_joins_trains_and_leaves_on_sigterm(tmp_path, entry):
    sim = Simulation(short_rounds(), 1, tmp_path / "coordinator", progress=False)
    state = tmp_path / "state"
    try:
        coordinator = sim.start_coordinator()
        ports = (free_port(), free_port())
        if entry == "docker":
            command, env, cwd = docker_command(state)
            command += ["--coordinator", coordinator["maddrs"][0], "--run-key", coordinator["run_key"], "--run",
                        coordinator["run"], "--host", "127.0.0.1", "--port", str(ports[0]), "--dht-port", str(ports[1])]
        else:
            command, env, cwd = systemd_command(state, coordinator, ports)
        code, records = run_and_stop(command, env, cwd, state, tmp_path / "peer.log", whole_group=entry == "systemd")
    finally:
        leftovers = sim.stop_all()
    assert leftovers == []
    assert code == 0, (tmp_path / "peer.log").read_text()[-3000:]
    (start,) = events(records, "start")
    assert start["endpoint"].endswith(f":{ports[0]}") and start["device"] == "cpu"  # flags and profile applied
    assert [e["signal"] for e in events(records, "leave")] == ["SIGTERM"]
    assert events(records, "stopped") and len(events(records, "exit")) == 1
    assert (state / "peer.key").exists()  # --key-file: the id stays across restarts
    assert any(p.name.startswith("corpus-") for p in (state / "cache").iterdir())  # LOWCOMM_CACHE in the volume


def docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.timeout(3600)
@pytest.mark.skipif(not docker_engine(), reason="no Docker engine answers `docker info` here: the image is not "
                    "built; its entry command runs as a plain process in the test above")
def test_the_cpu_image_builds_joins_and_stops_cleanly(tmp_path):
    tag = f"lowcomm-peer-test:{uuid.uuid4().hex[:8]}"
    name = tag.replace(":", "-")
    subprocess.run(["docker", "build", "-f", str(CPU_DOCKERFILE), "-t", tag, str(REPO)], check=True, timeout=3000)
    volume = tmp_path / "volume"
    volume.mkdir()
    volume.chmod(0o777)  # the image's user (not root) writes its key and records there
    sim = Simulation(short_rounds(), 1, tmp_path / "coordinator", progress=False)
    try:
        coordinator = sim.start_coordinator()
        subprocess.run(["docker", "run", "-d", "--name", name, "--network", "host", "--stop-timeout", "90",
                        "-v", f"{volume}:/var/lib/lowcomm", tag, "--coordinator", coordinator["maddrs"][0],
                        "--run-key", coordinator["run_key"], "--run", coordinator["run"], "--host", "127.0.0.1",
                        "--port", str(free_port()), "--dht-port", str(free_port())], check=True, timeout=60)
        wait_until(lambda: any(r["type"] == "round" for r in read_records(volume / "peers")), JOIN_S,
                   "the container's first round")
        subprocess.run(["docker", "stop", name], check=True, timeout=120)
        code = subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", name], capture_output=True,
                              text=True, check=True).stdout.strip()
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)
        leftovers = sim.stop_all()
    assert code == "0" and leftovers == []
    assert [e["signal"] for e in events(read_records(volume / "peers"), "leave")] == ["SIGTERM"]
