"""The volunteer's install files hold together: every Dockerfile copies only files that exist and
that .dockerignore sends to the engine, installs with the pins of constraints.txt, runs `peer join`
on a valid profile from peers/ as a user other than root, and exposes the ports that profile fixes;
the systemd unit runs the same command, restarts on failure only and gives the clean leave on SIGTERM
time to end; LICENSE is the Apache License 2.0 that pyproject names; CHANGELOG has this version."""

from __future__ import annotations

import re
import shlex
import tomllib

import pytest
from volunteer import DOCKERFILES, PEERS, REPO, Dockerfile, in_build_context, read_unit, unit_environment

from lowcomm.config import default_config
from lowcomm.runtime.options import read_profile
from lowcomm.version import __version__

PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)$")


def constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def test_there_is_a_cpu_and_a_cuda_dockerfile():
    assert {path.name for path in DOCKERFILES} >= {"Dockerfile", "Dockerfile.cuda"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_file_exists_and_is_in_the_build_context(path):
    image = Dockerfile.read(path)
    assert image.copies
    for sources, _ in image.copies:
        for source in sources:
            assert (REPO / source).exists(), f"{path.name} copies {source}, which the repository lacks"
            assert in_build_context(source), f"{path.name} copies {source}, which .dockerignore leaves out"
    for inside in ("lowcomm/cli.py", "lowcomm/configs/default.toml", "lowcomm/runtime/status_page.html"):
        assert in_build_context(inside), inside  # what `pip install .` packages
    for outside in (".venv/bin/python", ".git/HEAD", "runs/x/peers/a.jsonl", "experiments/out/x.json",
                    "lowcomm/__pycache__/cli.cpython-311.pyc"):
        assert not in_build_context(outside), outside


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_is_pinned_by_constraints_and_torch_comes_first(path):
    installs = Dockerfile.read(path).pip_installs
    assert installs, f"{path.name} installs nothing with pip"
    for words in installs:
        assert "-c" in words and words[words.index("-c") + 1] == "constraints.txt", words
        assert "-e" not in words and "--editable" not in words, words
    targets = [[w for w in words[2:] if not w.startswith("-") and w not in ("constraints.txt",)
                and not w.startswith(("http", "$"))] for words in installs]
    assert targets[0] == [f"torch=={constraints()['torch']}"], targets  # torch first, as the README says
    assert ["."] in targets[1:], targets  # then the project from the copied checkout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_entrypoint_joins_with_a_profile_from_peers_as_a_user_who_is_not_root(path):
    image = Dockerfile.read(path)
    command = image.entrypoint
    assert command[:3] == ["lowcomm", "peer", "join"] and "--config" in command
    source = image.profile_source(command[command.index("--config") + 1])
    assert source.parent == PEERS and source.suffix == ".toml"
    profile = read_profile(source)  # a valid [peer] table
    assert image.exposed == {profile[key] for key in ("port", "dht_port") if profile.get(key)}
    assert image.user not in (None, "root", "0")
    run_dir, key_file = (command[command.index(flag) + 1] for flag in ("--run-dir", "--key-file"))
    assert any(run_dir.startswith(v) and key_file.startswith(v) for v in image.volumes), image.volumes
    assert image.env["LOWCOMM_CACHE"].startswith(run_dir)  # the tokenized corpus survives a new container


def test_the_systemd_unit_runs_peer_join_restarts_on_failure_and_waits_for_the_clean_leave():
    unit = read_unit()
    service = unit["Service"]
    command = shlex.split(service["ExecStart"])
    assert command[0].startswith("/") and command[0].endswith("/bin/lowcomm")  # the venv's entry point
    assert command[1:3] == ["peer", "join"] and command[command.index("--config") + 1] == "/etc/lowcomm/peer.toml"
    state = f"/var/lib/{service['StateDirectory']}"
    assert command[command.index("--key-file") + 1].startswith(state + "/")
    assert command[command.index("--run-dir") + 1].startswith(state)
    assert unit_environment(service)["LOWCOMM_CACHE"].startswith(state)
    assert service["Restart"] == "on-failure" and service["KillMode"] == "control-group"
    assert service["KillSignal"] == "SIGTERM"
    assert service.get("User") not in (None, "root")
    sync = default_config().sync  # a round in flight ends within its deadlines; the leave after it is quick
    assert float(service["TimeoutStopSec"]) >= 2 * (sync.announce_s + sync.manifest_s + sync.reduce_timeout_s)
    assert "2" in service.get("RestartPreventExitStatus", "").split()  # exit 2: a setting to fix, not a crash
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    header = (PEERS / "lowcomm-peer.service").read_text().split("[Unit]")[0]
    assert "systemctl enable" in header and "constraints.txt" in header


def test_license_is_the_apache_license_2_0_in_full():
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for part in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
                 "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                 "APPENDIX: How to apply the Apache License to your work."):
        assert part in text, part
    assert len(text.splitlines()) == 202
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] in ({"text": "Apache-2.0"}, "Apache-2.0")


def test_the_changelog_has_this_version_and_an_unreleased_part():
    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"(?m)^## \[?([^\]\s]+)\]?", text)
    assert headings[0] == "Unreleased" and __version__ in headings, headings
