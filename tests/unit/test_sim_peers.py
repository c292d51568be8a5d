"""The command lines simulate starts its peers with: which peers start from φ_0 without looking for a
state source (``--initial``), and which fetch the run's state as any joiner does."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lowcomm.cli import build_parser, peer_options_of
from lowcomm.config import default_config
from lowcomm.runtime import sim as sim_module
from lowcomm.runtime.sim import Simulation


@pytest.fixture
def started(monkeypatch):
    """name -> the arguments of every process the simulation spawned (nothing is run)."""
    spawned = {}

    def spawn(name, args, run_dir, node):
        spawned[name] = args
        return SimpleNamespace()

    monkeypatch.setattr(sim_module, "spawn", spawn)
    return spawned


def simulation(tmp_path: Path, peers: int = 3, **config) -> Simulation:
    sim = Simulation(default_config().override(config), peers, tmp_path / "run", progress=False)
    sim.info = {"maddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmCoordinator"], "run_key": "key", "run": "lowcomm-default"}
    return sim


def test_the_first_peers_start_from_phi_0_and_joiners_fetch(tmp_path, started):
    sim = simulation(tmp_path)
    for index in range(3):
        sim.start_peer(index)
    sim.start_peer(3)  # a joiner beyond the run's first peers, at the shared barrier
    assert ["--initial" in started[f"peer-{i}"] for i in range(4)] == [True, True, True, False]
    sim.start_peer(1, start_file=tmp_path / "join")  # released on its own, later
    assert "--initial" not in started["peer-1"]
    sim.start_peer(0, park=False)  # not held at the start barrier: it may start any time
    assert "--initial" not in started["peer-0"]


def test_a_resumed_run_s_peers_all_fetch_its_state(tmp_path, started, monkeypatch):
    sim = simulation(tmp_path)
    monkeypatch.setattr(sim_module, "wait_for_file", lambda *args, **kwargs: sim.info)
    sim.start_coordinator(resume=tmp_path / "checkpoints")
    assert "--resume" in started["coordinator"]
    sim.start_peer(0)
    assert "--initial" not in started["peer-0"]


def test_pipelined_peers_are_placed_by_stage_instead(tmp_path, started):
    sim = simulation(tmp_path, **{"pipeline.stages": 2, "model.n_layers": 2})
    sim.start_peer(1)
    args = started["peer-1"]
    assert "--initial" not in args and args[args.index("--stage") + 1] == "1"


def test_the_flag_reaches_the_peer_s_options():
    common = ["peer", "join", "--coordinator", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--run-key", "k"]
    assert peer_options_of(build_parser().parse_args(common + ["--initial"])).initial is True
    assert peer_options_of(build_parser().parse_args(common)).initial is False
