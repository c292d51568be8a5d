"""Peer options: defaults < the profile's [peer] table < the flags the user gave; bad keys are refused."""

from pathlib import Path

import pytest

from lowcomm.cli import build_parser, main, peer_options_of
from lowcomm.config import ConfigError
from lowcomm.runtime.options import PeerOptions, read_profile
from lowcomm.transport.shaper import LinkSpec

JOIN = ["peer", "join", "--coordinator", "/ip4/127.0.0.1/tcp/1/p2p/x", "--run-key", "key"]


def profile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


def options(*argv: str) -> PeerOptions:
    return peer_options_of(build_parser().parse_args(list(argv)))


def test_no_profile_gives_the_old_defaults():
    o = options(*JOIN)
    assert o == PeerOptions(coordinator=["/ip4/127.0.0.1/tcp/1/p2p/x"], run_key="key")
    assert (o.run_name, o.host, o.port, o.device, o.client_mode, o.num_shards, o.slowdown, o.link) == \
        ("lowcomm-default", "0.0.0.0", 0, "auto", None, 64, 1.0, None)


def test_the_profile_sets_what_no_flag_gives(tmp_path):
    path = profile(tmp_path, '[peer]\ndevice = "cpu"\nport = 31400\nclient_mode = true\nlink = "20mbit:80ms"\n'
                             'run_dir = "runs/me"\nrun_name = "big-run"\nslowdown = 2\n')
    o = options(*JOIN, "--config", str(path))
    assert (o.device, o.port, o.client_mode, o.run_dir, o.run_name, o.slowdown) == \
        ("cpu", 31400, True, Path("runs/me"), "big-run", 2.0)
    assert o.link == LinkSpec(20e6, 0.08)


def test_only_the_flags_given_override_the_profile(tmp_path):
    path = profile(tmp_path, '[peer]\ndevice = "cpu"\nport = 31400\nclient_mode = true\nhost = "10.0.0.2"\n')
    o = options(*JOIN, "--config", str(path), "--port", "31500", "--no-client-mode", "--run", "other")
    assert (o.port, o.client_mode, o.run_name) == (31500, False, "other")  # given
    assert (o.device, o.host) == ("cpu", "10.0.0.2")  # not given: the profile's


def test_coordinator_and_run_key_may_come_from_the_profile(tmp_path):
    path = profile(tmp_path, '[peer]\ncoordinator = ["/ip4/10.0.0.1/tcp/31337/p2p/a"]\nrun_key = "k"\n')
    o = options("peer", "join", "--config", str(path))
    assert (o.coordinator, o.run_key) == (["/ip4/10.0.0.1/tcp/31337/p2p/a"], "k")
    assert options("peer", "join", "--config", str(path), "--coordinator", "/ip4/b").coordinator == ["/ip4/b"]


@pytest.mark.parametrize("text, message", [
    ('[peer]\ndevise = "cpu"\n', "peer.devise: unknown key"),
    ('[peer]\nport = "31400"\n', "peer.port = '31400': expected an integer"),
    ('[peer]\nclient_mode = 1\n', "peer.client_mode = 1: expected true or false"),
    ('[peer]\nslowdown = true\n', "peer.slowdown = True: expected a number"),
    ('[peer]\ncoordinator = "/ip4/x"\n', "peer.coordinator = '/ip4/x': expected a non-empty list of strings"),
    ('[peer]\nlink = "fast"\n', "peer.link = 'fast': expected a link"),
    ('device = "cpu"\n', "unknown table or key 'device'; a peer profile holds one [peer] table"),
    ('[run]\nsteps = 3\n', "unknown table or key 'run'"),
    ('[peer\n', "is not valid TOML"),
])
def test_a_bad_profile_is_refused_in_one_line_naming_the_key(tmp_path, text, message):
    path = profile(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        read_profile(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("flags, message", [
    (["--device", "gpu"], "device = 'gpu': must be auto, cpu, cuda or cuda:N"),
    (["--port", "70000"], "port = 70000"),
    (["--link", "fast"], "--link = 'fast': expected a link"),
    (["--data-shard", "64"], "data_shard = 64: must be in [0, num_shards = 64)"),
])
def test_bad_flags_are_refused_naming_them(flags, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        options(*JOIN, *flags)


def test_the_cli_exits_2_on_a_bad_profile_before_starting_anything(tmp_path, capsys):
    path = profile(tmp_path, '[peer]\nbogus = 1\n')
    assert main([*JOIN, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "peer.bogus: unknown key" in err and len(err.strip().splitlines()) == 1
    assert main(["peer", "join", "--run-key", "k"]) == 2
    assert "needs --coordinator" in capsys.readouterr().err
    assert main([*JOIN, "--config", str(tmp_path / "missing.toml")]) == 2


def test_peer_options_is_still_importable_from_peer():
    from lowcomm.runtime.peer import PeerOptions as FromPeer

    assert FromPeer is PeerOptions
