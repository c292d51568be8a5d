"""Wakes (transport.wakeups) are hints: kept only for a round somebody watches, each ends one wait,
and a flood of them ends waits no more often than MIN_READ_S; a WakeSender reaches live peers and
only counts a dead one as failed, sends one call at a time to a peer, and does not call a peer again
for a while after a call to it timed out."""

from __future__ import annotations

import contextlib
import threading
import time

from children import wait_until
from lowcomm.proto.wire_pb2 import WakeReply, WakeRequest
from lowcomm.transport import wakeups as wakeups_module
from lowcomm.transport.service import PeerService
from lowcomm.transport.wakeups import MIN_READ_S, Wakes, WakeSender, Wakeups
from lowcomm.transport.wire import Channels, Traffic, start_server

WAIT_S = 60.0  # a bound only a lost wake reaches; never asserted as a duration


def test_a_wake_for_an_unwatched_round_is_dropped():
    wakeups = Wakeups()
    assert not wakeups.notify("g", 1)
    with wakeups.watching("g", 1):
        assert wakeups.notify("g", 1)
        assert wakeups.wait("g", 1, WAIT_S)
        assert not wakeups.wait("g", 1, 0.0)  # one wake ends one wait
    assert not wakeups.notify("g", 1) and wakeups._waiting == {} and wakeups._woken == set()


def test_a_wake_ends_a_wait_in_another_thread():
    wakeups, woken = Wakeups(), []
    with wakeups.watching("g", 3):
        waiter = threading.Thread(target=lambda: woken.append(wakeups.wait("g", 3, WAIT_S)))
        waiter.start()
        wakeups.notify("g", 2)  # not this round
        wakeups.notify("g", 3)
        waiter.join(WAIT_S + 5)
    assert woken == [True]


def test_a_flood_of_wakes_ends_a_wait_at_most_once_per_read_interval():
    wakeups, flooding = Wakeups(), threading.Event()

    def flood():
        while not flooding.is_set():
            wakeups.notify("g", 0)

    with wakeups.watching("g", 0):
        threads = [threading.Thread(target=flood) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            ends = []
            for _ in range(5):
                start = time.monotonic()
                ends.append((wakeups.wait("g", 0, WAIT_S), time.monotonic() - start >= MIN_READ_S))
        finally:
            flooding.set()
            for t in threads:
                t.join()
    assert ends == [(True, True)] * 5  # woken each time, never sooner than MIN_READ_S after the last read


def test_polling_wakes_wait_without_anyone_to_wake_them():
    wakes = Wakes.polling(0.01)
    with wakes.watching("g", 0):
        assert not wakes.wait("g", 0, WAIT_S)  # a poll interval, not WAIT_S
    wakes.wake(["127.0.0.1:1"], "g", 0)  # nobody to wake: nothing happens


def test_a_sender_wakes_a_live_peer_and_counts_a_dead_one():
    service = PeerService("woken", Traffic(), Channels(1 << 16))
    server, port = start_server(service, "127.0.0.1", 0, 1 << 16)
    channels = Channels(1 << 16)
    sender = WakeSender(channels, Traffic())
    try:
        with service.wakeups.watching("g", 5):
            sender.wake([f"127.0.0.1:{port}", None, ""], "g", 5)
            assert service.wakeups.wait("g", 5, WAIT_S)
        done = threading.Event()
        original = sender._send

        def send_and_note(*args):
            try:
                original(*args)
            finally:
                done.set()

        sender._send = send_and_note
        sender.wake(["127.0.0.1:1"], "g", 5)  # nothing listens there
        assert done.wait(WAIT_S)
        assert sender.sent == 1 and sender.failed == 1
    finally:
        sender.close()
        channels.close()
        server.stop(0)
        service.channels.close()


def test_a_post_that_misses_a_peer_runs_its_fallback_once_and_one_that_arrives_none():
    service = PeerService("woken", Traffic(), Channels(1 << 16))
    server, port = start_server(service, "127.0.0.1", 0, 1 << 16)
    channels = Channels(1 << 16)
    sender = WakeSender(channels, Traffic())
    fallbacks, ran = [], threading.Event()

    def fallback(name):
        def run():
            fallbacks.append(name)
            ran.set()
        return run

    try:
        request = WakeRequest(group="g", round=5)
        sender.send([f"127.0.0.1:{port}"], request, on_failed=fallback("arrived"))
        sender.send([f"127.0.0.1:{port}", "127.0.0.1:1", "127.0.0.1:2"], request, on_failed=fallback("missed"))
        wait_until(lambda: sender.sent + sender.failed == 4 and ran.is_set(), WAIT_S, "the four posts' outcomes")
        assert sender.sent == 2 and sender.failed == 2
        assert fallbacks == ["missed"]  # once, though two peers were missed; none for the post that arrived
    finally:
        sender.close()
        channels.close()
        server.stop(0)
        service.channels.close()


@contextlib.contextmanager
def stuck_peer():
    """A peer whose Wake handler holds every call until the test sets ``release``: (port, release, the
    rounds of the calls that reached it)."""
    release, entered = threading.Event(), []

    def hold(request, context):
        entered.append(request.round)
        release.wait(WAIT_S)
        return WakeReply()

    service = PeerService("stuck", Traffic(), Channels(1 << 16))
    service.Wake = hold  # before the server binds the handler
    server, port = start_server(service, "127.0.0.1", 0, 1 << 16)
    try:
        yield port, release, entered
    finally:
        release.set()
        server.stop(0)
        service.channels.close()


def test_a_peer_that_does_not_answer_holds_one_call_and_not_the_posts_to_the_others(monkeypatch):
    """With two threads, six posts to a peer whose handler holds every call would have taken both
    threads and kept the post to the live peer waiting until the stuck peer answered."""
    monkeypatch.setattr(wakeups_module, "WAKE_TIMEOUT_S", WAIT_S)  # the stuck calls end when the test says
    live = PeerService("live", Traffic(), Channels(1 << 16))
    server, live_port = start_server(live, "127.0.0.1", 0, 1 << 16)
    channels = Channels(1 << 16)
    sender = WakeSender(channels, Traffic(), threads=2)
    try:
        with stuck_peer() as (stuck_port, release, entered):
            for round_ in range(6):
                sender.wake([f"127.0.0.1:{stuck_port}"], "g", round_)
            with live.wakeups.watching("g", 9):
                sender.wake([f"127.0.0.1:{live_port}"], "g", 9)
                assert live.wakeups.wait("g", 9, WAIT_S), "the live peer's wake waited behind the stuck peer's"
            assert entered == [0] and sender.sent == 1  # one call in flight to the stuck peer, the rest queued
            release.set()
            wait_until(lambda: sender.sent == 7, WAIT_S, "the stuck peer's queued wakes")
            assert entered == list(range(6)) and sender.failed == sender.dropped == 0  # in order, one at a time
    finally:
        sender.close()
        channels.close()
        server.stop(0)
        live.channels.close()


def test_after_a_call_timed_out_a_peer_is_not_called_again_for_a_while_and_the_fallback_runs(monkeypatch):
    monkeypatch.setattr(wakeups_module, "WAKE_TIMEOUT_S", 0.2)
    channels = Channels(1 << 16)
    sender = WakeSender(channels, Traffic(), backoff_s=WAIT_S)
    fallbacks = []
    try:
        with stuck_peer() as (port, _, entered):
            sender.wake([f"127.0.0.1:{port}"], "g", 1)
            wait_until(lambda: sender.failed == 1, WAIT_S, "the call that timed out")
            sender.send([f"127.0.0.1:{port}"], WakeRequest(group="g", round=2), on_failed=lambda: fallbacks.append(2))
            wait_until(lambda: fallbacks == [2], WAIT_S, "the second post's fallback")
            assert entered == [1] and sender.failed == 1 and sender.dropped == 1  # no second call
    finally:
        sender.close()
        channels.close()


def test_a_refused_post_is_an_answer_and_the_next_wake_goes_through():
    service = PeerService("woken", Traffic(), Channels(1 << 16))  # takes no round posts: refuses one
    server, port = start_server(service, "127.0.0.1", 0, 1 << 16)
    channels = Channels(1 << 16)
    sender = WakeSender(channels, Traffic(), backoff_s=WAIT_S)
    refused = threading.Event()
    try:
        sender.send([f"127.0.0.1:{port}"], WakeRequest(group="g", round=5, kind="announce"),
                    on_failed=refused.set)
        assert refused.wait(WAIT_S)
        with service.wakeups.watching("g", 6):
            sender.wake([f"127.0.0.1:{port}"], "g", 6)
            assert service.wakeups.wait("g", 6, WAIT_S), "the wake after a refusal was not sent"
        assert sender.failed == 1 and sender.dropped == 0
    finally:
        sender.close()
        channels.close()
        server.stop(0)
        service.channels.close()


def test_a_fallback_without_a_thread_to_run_on_leaves_the_sender_calling(monkeypatch):
    class NoThread:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(wakeups_module, "threading", type("T", (), {"Thread": NoThread, "Lock": threading.Lock}))
    channels = Channels(1 << 16)
    sender = WakeSender(channels, Traffic())
    try:
        for round_ in range(3):  # nothing listens there; each post's fallback fails to start
            sender.send(["127.0.0.1:1"], WakeRequest(group="g", round=round_), on_failed=lambda: None)
            wait_until(lambda: sender.failed == round_ + 1, WAIT_S, f"a call for post {round_}")
    finally:
        sender.close()
        channels.close()
