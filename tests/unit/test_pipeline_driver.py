"""The driver's retries over real gRPC: a dead replica is banned until its record's expiry, a slow one
is skipped for another replica after the hop timeout, and a stage with no replica gives up after
pipeline.stage_wait_s."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from lowcomm.config import default_config
from lowcomm.pipeline.driver import Driver, StageEntry, StageUnavailable
from lowcomm.pipeline.routing import StageRouter
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import initial_stage
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer
from lowcomm.transport.wire import Channels, Traffic, start_server

CONFIG = default_config().override({"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 2,
                                    "model.context": 16, "inner.batch_size": 4})


class Stalling:
    """A stage handler that answers nothing before the caller's deadline."""

    def __init__(self):
        self.release = threading.Event()

    def forward(self, call):
        self.release.wait(10)
        raise RuntimeError("too late")

    backward = forward


@pytest.fixture()
def replicas():
    """A live replica served over gRPC, a stalling one, and a dead endpoint, all of stage 0 of 1."""
    server = StageServer(CONFIG, initial_stage(CONFIG.model, 0, 0, 1, False), 0)
    server.ready = True
    started = []
    for handler in (server, Stalling()):
        service = PeerService("x", Traffic(), Channels(1 << 20))
        service.stage_handler = handler
        grpc_server, port = start_server(service, "127.0.0.1", 0, 1 << 20, max_workers=4)
        started.append((grpc_server, f"127.0.0.1:{port}", handler))
    yield {"live": started[0][1], "slow": started[1][1], "dead": "127.0.0.1:1", "server": server}
    started[1][2].release.set()
    for grpc_server, _, _ in started:
        grpc_server.stop(0)


def make_driver(directory, events, stage_wait_s=30.0):
    now = time.monotonic()
    entries = {p: StageEntry(endpoint, throughput, now + 5.0) for p, (endpoint, throughput) in directory.items()}
    return Driver("run", Signer.generate(), 1, False, StageRouter(random.Random(0)), Channels(1 << 20), Traffic(),
                  lambda: {0: entries}, lambda: None, hop_timeout_s=0.5, stage_wait_s=stage_wait_s, refresh_s=0.2,
                  on_event=lambda kind, **f: events.append((kind, f)), stop=threading.Event())


def batch():
    return torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))


def test_a_dead_replica_is_banned_and_the_hop_served_by_another(replicas):
    events = []
    driver = make_driver({"dead": (replicas["dead"], 1.0), "live": (replicas["live"], 1.0)}, events)
    losses = [driver.train(i, *batch()) for i in range(3)]  # the heap reaches the dead one by the second
    assert all(loss > 0 for loss in losses) and replicas["server"].step == 3
    bans = [f for kind, f in events if kind == "ban"]
    assert [b["target"] for b in bans] == ["dead"] and bans[0]["reason"] == "UNAVAILABLE"
    assert driver.router.banned("dead") and not driver.router.banned("live")
    assert 4.0 < bans[0]["seconds"] <= 5.0  # until the expiry its record had


def test_a_replica_that_times_out_is_skipped_not_banned(replicas):
    events = []
    driver = make_driver({"slow": (replicas["slow"], 1.0), "live": (replicas["live"], 1.0)}, events)
    for i in range(2):  # the heap reaches the slow one by the second microbatch
        driver.train(i, *batch())
    assert [f["target"] for kind, f in events if kind == "hop_timeout"] == ["slow"]
    assert not driver.router.banned("slow")
    assert replicas["server"].step == 2


def test_a_stage_with_no_replica_gives_up_after_the_wait(replicas):
    events = []
    driver = make_driver({"dead": (replicas["dead"], 1.0)}, events, stage_wait_s=1.0)
    with pytest.raises(StageUnavailable, match="stage 0"):
        driver.train(0, *batch())
