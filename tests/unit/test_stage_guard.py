"""Stage calls from anyone but a peer of the run are refused before they touch the stage.

The issue's attack: `StageBackward` from a stranger (a bogus run id, sender "nobody") ran 100 AdamW
steps on the attacker's objective. A real stage replica served over gRPC behind the runtime's guard;
a driver of the run trains through it, strangers' calls are refused with `reject` events.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from lowcomm.pipeline.activations import pack_tokens
from lowcomm.pipeline import driver as driver_module
from lowcomm.pipeline.driver import Driver, StageEntry, StageUnavailable
from lowcomm.pipeline.routing import StageRouter
from lowcomm.pipeline.server import StageServer
from lowcomm.pipeline.stages import initial_stage
from lowcomm.proto import wire_pb2
from lowcomm.runtime import stage_guard
from lowcomm.runtime.stage_guard import StageCallGuard, UnknownSender
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer, sign_message
from lowcomm.transport.wire import Channels, Traffic, start_server
from unit.test_pipeline_driver import CONFIG, batch

REJECTED = wire_pb2.StageReply.REJECTED


def test_only_signed_calls_of_the_runs_peers_reach_the_stage():
    member, stranger = Signer.generate(), Signer.generate()
    server = StageServer(CONFIG, initial_stage(CONFIG.model, 0, 0, 1, False), 0)
    server.ready = True
    events, reads = [], []

    def members():
        reads.append(1)
        return {member.peer_id}

    service = PeerService("replica", Traffic(), Channels(1 << 20))
    service.stage_handler = server
    service.stage_guard = StageCallGuard("run", members, refresh_s=60.0,
                                         on_event=lambda kind, **f: events.append((kind, f)))
    grpc_server, port = start_server(service, "127.0.0.1", 0, 1 << 20, max_workers=4)
    endpoint = f"127.0.0.1:{port}"
    try:
        stub = Channels(1 << 20).stub(endpoint)
        x, y = batch()

        def backward(signer, sender=None, run="run", sign=True):
            call = wire_pb2.StageCall(run_id=run, stage=0, microbatch=1, embed=True, head=True, input=pack_tokens(x),
                                      targets=pack_tokens(y), sender=sender or signer.peer_id)
            if sign:
                sign_message(signer, "StageBackward", call)
            return stub.StageBackward(call, timeout=30)

        refused = {
            "stranger": backward(stranger),
            "forged member": backward(stranger, sender=member.peer_id),
            "unsigned": backward(member, sign=False),
            "other run": backward(member, run="bogus"),
        }
        assert refused.pop("stranger").status == wire_pb2.StageReply.RETRY  # not known (yet): ask again
        for what, reply in refused.items():
            assert reply.status == REJECTED, what
        assert server.step == 0  # no step on anyone's objective
        assert [kind for kind, _ in events] == ["reject"] * 4
        assert len(reads) <= 2  # unknown senders do not make a DHT read each

        relabelled = wire_pb2.StageCall(run_id="run", stage=0, microbatch=1, embed=True, head=True,
                                        input=pack_tokens(x), targets=pack_tokens(y), sender=member.peer_id)
        sign_message(member, "StageForward", relabelled)  # a member's forward call replayed as a backward
        assert stub.StageBackward(relabelled, timeout=30).status == REJECTED

        now = time.monotonic()
        driver = Driver("run", member, 1, False, StageRouter(random.Random(0)), Channels(1 << 20), Traffic(),
                        lambda: {0: {"replica": StageEntry(endpoint, 1.0, now + 60)}}, lambda: None,
                        hop_timeout_s=30.0, stage_wait_s=30.0, refresh_s=0.2, on_event=lambda kind, **f: None,
                        stop=threading.Event())
        assert driver.train(2, x, y) > 0 and server.step == 1  # the run's own driver is served
        assert len(events) == 5
    finally:
        grpc_server.stop(0)


def test_a_sender_that_joined_since_the_last_read_is_found_by_one_more_read(monkeypatch):
    monkeypatch.setattr(stage_guard, "MISS_REFRESH_S", 0.0)
    joiner, known, reads = Signer.generate(), set(), []
    guard = StageCallGuard("run", lambda: reads.append(1) or set(known), refresh_s=3600.0,
                           on_event=lambda kind, **f: None)
    call = wire_pb2.StageCall(run_id="run", sender=joiner.peer_id)
    sign_message(joiner, "StageForward", call)
    with pytest.raises(UnknownSender, match="not a peer of run"):
        guard("StageForward", call)
    known.add(joiner.peer_id)  # it joined: the next call from it reads the peers again
    guard("StageForward", call)
    assert len(reads) == 2


def guarded_replica(members, events):
    """A stage replica served over gRPC behind a guard that reads the run's peers from ``members()``."""
    server = StageServer(CONFIG, initial_stage(CONFIG.model, 0, 0, 1, False), 0)
    server.ready = True
    service = PeerService("replica", Traffic(), Channels(1 << 20))
    service.on_error = lambda method, error: events.append(("reject", {"method": method}))
    service.stage_handler = server
    service.stage_guard = StageCallGuard("run", members, refresh_s=3600.0,
                                         on_event=lambda kind, **f: events.append((kind, f)))
    grpc_server, port = start_server(service, "127.0.0.1", 0, 1 << 20, max_workers=4)
    return server, grpc_server, f"127.0.0.1:{port}"


def guarded_driver(signer, endpoint, events, stage_wait_s=30.0):
    now = time.monotonic()
    return Driver("run", signer, 1, False, StageRouter(random.Random(0)), Channels(1 << 20), Traffic(),
                  lambda: {0: {"replica": StageEntry(endpoint, 1.0, now + 60)}}, lambda: None,
                  hop_timeout_s=30.0, stage_wait_s=stage_wait_s, refresh_s=0.2,
                  on_event=lambda kind, **f: events.append((kind, f)), stop=threading.Event())


def test_a_driver_the_replica_does_not_know_yet_retries_the_same_replica_and_is_served(monkeypatch):
    monkeypatch.setattr(stage_guard, "MISS_REFRESH_S", 0.0)
    monkeypatch.setattr(driver_module, "RETRY_PAUSE_S", 0.0)
    joiner, reads, events = Signer.generate(), [], []

    def members():  # the joiner's record is in the DHT from the replica's second read on
        reads.append(1)
        return {joiner.peer_id} if len(reads) > 1 else set()

    server, grpc_server, endpoint = guarded_replica(members, events)
    try:
        driver = guarded_driver(joiner, endpoint, events)
        assert driver.train(0, *batch()) > 0 and server.step == 1
        kinds = [kind for kind, _ in events]
        assert kinds == ["reject", "hop_retry"]  # refused once (one event), asked again, served
        assert not driver.router.banned("replica") and "ban" not in kinds
    finally:
        grpc_server.stop(0)


def test_a_sender_never_known_is_retried_within_the_hops_wait_and_never_banned(monkeypatch):
    monkeypatch.setattr(stage_guard, "MISS_REFRESH_S", 0.0)
    monkeypatch.setattr(driver_module, "RETRY_PAUSE_S", 0.0)
    events = []
    server, grpc_server, endpoint = guarded_replica(lambda: set(), events)
    try:
        driver = guarded_driver(Signer.generate(), endpoint, events, stage_wait_s=0.5)
        with pytest.raises(StageUnavailable, match="stage 0"):
            driver.train(0, *batch())
        kinds = [kind for kind, _ in events]
        assert "ban" not in kinds and not driver.router.banned("replica") and server.step == 0
        assert kinds.count("hop_retry") == kinds.count("reject") > driver_module.SAME_REPLICA_RETRIES
    finally:
        grpc_server.stop(0)
