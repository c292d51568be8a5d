"""The ready peer profiles in peers/ parse into PeerOptions and set what each one is about."""

import re
from pathlib import Path

import pytest

from lowcomm.cli import build_parser, peer_options_of
from lowcomm.runtime.options import read_profile

PEERS = Path(__file__).resolve().parents[2] / "peers"
JOIN = ["peer", "join", "--coordinator", "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWtest", "--run-key", "AAAAkey"]


def options_of(name: str, *flags: str):
    return peer_options_of(build_parser().parse_args([*JOIN, "--config", str(PEERS / name), *flags]))


def test_the_four_profiles_are_there():
    assert sorted(p.name for p in PEERS.glob("*.toml")) == ["consumer-gpu.toml", "cpu.toml", "datacenter-gpu.toml",
                                                            "nat.toml"]


def test_cpu_profile_trains_on_the_cpu_and_keeps_the_reachability_check():
    o = options_of("cpu.toml")
    assert o.device == "cpu" and o.port == 31400 and o.client_mode is None


def test_consumer_gpu_profile_uses_the_gpu():
    o = options_of("consumer-gpu.toml")
    assert o.device == "cuda" and o.port == 31400 and o.client_mode is None


def test_datacenter_gpu_profile_pins_one_gpu_and_serves():
    o = options_of("datacenter-gpu.toml")
    assert o.device == "cuda:0" and o.port == 31400 and o.client_mode is False


def test_nat_profile_runs_in_client_mode():
    o = options_of("nat.toml")
    assert o.client_mode is True and o.device == "auto" and o.announce_addr is None


@pytest.mark.parametrize("name", ["cpu.toml", "consumer-gpu.toml", "datacenter-gpu.toml", "nat.toml"])
def test_every_setting_is_commented_and_the_fill_ins_parse_once_uncommented(name, tmp_path):
    text = (PEERS / name).read_text()
    for line in text.splitlines():
        if re.match(r"^[a-z_]+ *=", line):
            assert "#" in line, f"{name}: {line!r} has no comment saying what it does"
    assert "FILL IN" in text and "--coordinator" in text and "--run-key" in text
    # the commented-out fill-ins are valid keys with values of the right type
    uncommented = re.sub(r"^# ([a-z_]+ *=)", r"\1", text, flags=re.M)
    path = tmp_path / name
    path.write_text(uncommented)
    table = read_profile(path)
    assert {"coordinator", "run_key", "run_name"} <= set(table)
    o = peer_options_of(build_parser().parse_args(["peer", "join", "--config", str(path)]))
    assert o.coordinator == table["coordinator"] and o.run_key == table["run_key"]
