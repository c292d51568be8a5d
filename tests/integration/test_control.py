"""The DHT control plane: configs and records only their signer's key can write."""

import pytest

from lowcomm.config import default_config
from lowcomm.runtime.run_config import fetch_run_config, publish_run_config
from lowcomm.transport.control import ConfigRejected, ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity, owner_marker_from_text


@pytest.fixture(scope="module")
def swarm():
    coordinator_id, attacker_id = Identity.generate(), Identity.generate()
    coordinator = ControlPlane.start(coordinator_id, "run-x")
    attacker = ControlPlane.start(attacker_id, "run-x", initial_peers=coordinator.visible_maddrs())
    reader = ControlPlane.start(Identity.generate(), "run-x", initial_peers=coordinator.visible_maddrs())
    yield coordinator, attacker, reader
    for node in (coordinator, attacker, reader):
        node.shutdown()


def test_config_signed_by_the_coordinator_is_accepted_and_others_refused(swarm):
    coordinator, attacker, reader = swarm
    real = default_config()
    publish_run_config(coordinator, real, version=1, ttl=60)
    publish_run_config(attacker, real.override({"diloco.outer_lr": 5.0}), version=2, ttl=60)  # its own key's subkey
    config, version = fetch_run_config(reader, coordinator.identity.owner_marker, timeout=10)
    assert config == real and version == 1
    with pytest.raises(ConfigRejected, match="signed by the coordinator key"):
        fetch_run_config(reader, owner_marker_from_text(Identity.generate().public_key_text), timeout=2)


def test_forged_record_under_the_coordinators_key_is_dropped(swarm):
    coordinator, attacker, reader = swarm
    publish_run_config(coordinator, default_config(), version=1, ttl=60)
    forged = {"peer_id": coordinator.identity.peer_id, "version": 9, "config": "{}", "hash": "x"}
    # the attacker writes under the coordinator's owner marker without its private key
    attacker.dht.store("run-x.config", forged, 10**10, subkey=coordinator.identity.owner_marker)
    config, version = fetch_run_config(reader, coordinator.identity.owner_marker, timeout=10)
    assert version == 1 and config == default_config()


def test_peer_record_naming_another_peer_is_dropped(swarm):
    coordinator, attacker, reader = swarm
    attacker.publish_peer(PeerRecord(attacker.identity.peer_id, "127.0.0.1:1", "training"), ttl=30)
    spoof = PeerRecord("not-my-id", "127.0.0.1:2", "training").__dict__
    attacker.dht.store("run-x.peers", spoof, 10**10, subkey=attacker.identity.owner_marker + b"x")
    peers = reader.live_peers()
    assert attacker.identity.peer_id in peers and "not-my-id" not in peers


def test_status_shows_each_peers_loss_and_lists_the_runs_when_the_named_one_has_none(swarm, capsys):
    from lowcomm.cli import main

    coordinator, attacker, reader = swarm
    coordinator.publish_run_name(ttl=60)
    trainer = PeerRecord(attacker.identity.peer_id, "127.0.0.1:1", "training", round=3, step=90,
                         loss=1.8765, loss_kind="held-out")
    attacker.publish_peer(trainer, ttl=30)
    maddr = coordinator.visible_maddrs()[0]
    assert reader.runs_seen() == ["run-x"]

    assert main(["status", "--coordinator", maddr, "--run", "run-x"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith(attacker.identity.peer_id))
    assert "1.8765" in line and "training" in line

    assert main(["status", "--coordinator", maddr, "--run", "run-typo"]) == 1
    out = capsys.readouterr().out
    assert "runs this DHT holds: run-x" in out and "--run" in out


def test_a_leaving_peers_record_is_gone_at_once_and_stays_gone(swarm):
    """The tombstone outlives the record: a 0.5 s overwrite lost to the record's later expiration."""
    coordinator, attacker, reader = swarm
    leaver = ControlPlane.start(Identity.generate(), "run-x", initial_peers=coordinator.visible_maddrs())
    try:
        leaver.publish_peer(PeerRecord(leaver.identity.peer_id, "127.0.0.1:3", "training"), ttl=60)
        assert leaver.identity.peer_id in reader.live_peers()
        leaver.expire_peer(ttl=60)
        assert leaver.identity.peer_id not in reader.live_peers()
        assert leaver.identity.peer_id not in coordinator.live_peers()
    finally:
        leaver.shutdown()
