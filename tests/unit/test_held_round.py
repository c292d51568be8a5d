"""A holder says which round it serves (runtime.state_transfer.held_round) over real gRPC on localhost:
a joiner asks its source, whose peer record's round may be half a record's life old (Decision 58)."""

from __future__ import annotations

import socket

import pytest
import torch

from lowcomm.proto import wire_pb2
from lowcomm.runtime.state_transfer import StateHolder, download_state, encode_state, held_round
from lowcomm.transport.service import PeerService
from lowcomm.transport.wire import Channels, Traffic, start_server


@pytest.fixture
def served():
    traffic, channels = Traffic(), Channels(1 << 20)
    service = PeerService("holder", traffic, channels)
    server, port = start_server(service, "127.0.0.1", 0, 1 << 20, max_workers=4)
    yield service, f"127.0.0.1:{port}", channels
    server.stop(grace=None)
    channels.close()


@pytest.fixture
def holder(served):
    service, endpoint, channels = served
    holder = StateHolder("r", 1 << 20)
    service.state_handler = holder.serve
    return holder, endpoint, channels


def snapshot(round_: int):
    return encode_state({"phi.w": torch.ones(4)}, round_, 100 * round_, "cfg", "hash")


def test_a_holder_says_the_round_it_serves_and_still_serves_that_state(holder):
    state, endpoint, channels = holder
    traffic = Traffic()
    assert held_round(channels, traffic, endpoint, "r", "joiner", timeout=5.0) == 0  # nothing held yet
    held = snapshot(7)
    state.publish(held)
    assert held_round(channels, traffic, endpoint, "r", "joiner", timeout=5.0) == 7
    served = download_state(channels, traffic, endpoint, "r", "joiner", 7, wait_s=0, timeout=10, max_bytes=1 << 20)
    assert served.round == 7 and served.data == held.blob
    assert traffic.received > 0 and traffic.sent > 0  # the question and its answer are counted


def test_a_holder_of_another_run_or_none_at_all_says_nothing(holder):
    _, endpoint, channels = holder
    assert held_round(channels, Traffic(), endpoint, "another run", "joiner", timeout=5.0) is None
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    assert held_round(channels, Traffic(), dead, "r", "joiner", timeout=2.0) is None


def test_a_round_no_run_reaches_is_refused(served):
    service, endpoint, channels = served
    service.state_handler = lambda request, context: iter([wire_pb2.StateChunk(error="state at round ...",
                                                                               round=2 ** 64 - 1)])
    assert held_round(channels, Traffic(), endpoint, "r", "joiner", timeout=5.0) is None
