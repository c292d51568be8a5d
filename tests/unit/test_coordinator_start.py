"""A coordinator whose start fails after its DHT came up (runtime.coordinator) stops the DHT and its
gRPC server before the error propagates: no p2pd is left running. The DHT and the server are stand-ins."""

from __future__ import annotations

import pytest

from lowcomm.config import load_config
from lowcomm.runtime import coordinator as coordinator_module
from lowcomm.runtime.coordinator import Coordinator


class FakeControl:
    def __init__(self, maddrs):
        self.maddrs, self.stopped, self.published = maddrs, False, []

    def publish_peer(self, record, ttl):
        self.published.append(record)

    def visible_maddrs(self):
        if isinstance(self.maddrs, Exception):
            raise self.maddrs
        return list(self.maddrs)

    def shutdown(self):
        self.stopped = True


class FakeServer:
    stopped = False

    def stop(self, grace):
        self.stopped = True

        class Done:
            def wait(self, timeout):
                return True
        return Done()


@pytest.fixture
def world(monkeypatch):
    made = {"control": FakeControl(["/ip4/10.0.0.1/tcp/5/p2p/Qm"]), "server": FakeServer(), "server_error": None}

    def start_server(*args, **kwargs):
        if made["server_error"] is not None:
            raise made["server_error"]
        return made["server"], 31336
    monkeypatch.setattr(coordinator_module.ControlPlane, "start", staticmethod(lambda *a, **k: made["control"]))
    monkeypatch.setattr(coordinator_module, "publish_run_config", lambda *a, **k: None)
    monkeypatch.setattr(coordinator_module, "start_server", start_server)
    return made


def coordinator(tmp_path) -> Coordinator:
    return Coordinator(load_config(None), tmp_path / "coordinator", host="127.0.0.1")


def test_a_start_that_succeeds_leaves_everything_running(world, tmp_path):
    info = coordinator(tmp_path).start()
    assert info["join_command"].startswith("lowcomm peer join --coordinator /ip4/10.0.0.1/tcp/5/p2p/Qm ")
    assert info["endpoint"] == "127.0.0.1:31336"
    assert not world["control"].stopped and not world["server"].stopped


def test_a_server_that_cannot_bind_stops_the_dht(world, tmp_path):
    world["server_error"] = OSError("could not bind the gRPC server to 127.0.0.1:1; pick another --port")
    with pytest.raises(OSError, match="pick another --port"):
        coordinator(tmp_path).start()
    assert world["control"].stopped


@pytest.mark.parametrize("maddrs", [[], ValueError("no visible maddrs")])
def test_a_dht_with_no_address_to_announce_stops_the_dht_and_the_server(world, tmp_path, maddrs):
    world["control"].maddrs = maddrs
    with pytest.raises(RuntimeError, match="pass --announce-addr") as error:
        coordinator(tmp_path).start()
    assert "\n" not in str(error.value)
    assert world["control"].stopped and world["server"].stopped
