"""The link shaper: spec parsing, the bucket's schedule (exact, on a fake clock), real-time lower
bounds (never upper bounds on rates: the machine is shared), pipelined latency, and a shaped
transfer over real gRPC on localhost, in this process (the shaped simulation of real peers is in
tests/integration/test_shaper_e2e.py)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowcomm.config import ConfigError, default_config, load_config
from lowcomm.proto import wire_pb2
from lowcomm.runtime.report import build_report
from lowcomm.runtime.state_transfer import download_state
from lowcomm.transport.service import PeerService
from lowcomm.transport.shaper import BURST_S, LinkShaper, LinkSpec, parse_link, parse_link_option
from lowcomm.transport.wire import GRPC_FRAME_BYTES, Channels, Traffic, assemble, slices, start_server

MBIT = 1e6


# ---- parsing -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, rate_bits, latency_s", [
    ("100mbit:40ms", 100e6, 0.040), ("20mbit", 20e6, 0.0), ("1gbit:5ms", 1e9, 0.005), ("500kbit", 500e3, 0.0),
    ("10MB", 80e6, 0.0), ("10MB:0.1s", 80e6, 0.1), ("2KiB", 2 * 1024 * 8, 0.0), ("100Mbit/s:250us", 100e6, 250e-6),
    (" 1.5mbit : 40ms ", 1.5e6, 0.040), ("64bit", 64, 0.0)])
def test_link_specs_parse_bits_and_bytes(text, rate_bits, latency_s):
    spec = parse_link(text)
    assert spec.rate_bits == pytest.approx(rate_bits) and spec.latency_s == pytest.approx(latency_s)
    assert parse_link(str(spec)) == spec  # the canonical form reads back the same


@pytest.mark.parametrize("text, hint", [("100mbps", "ambiguous"), ("10mb", "ambiguous"), ("fast", "rate"),
                                         ("10mbit:40", "latency"), ("0mbit", "positive"), (":40ms", "rate"),
                                         ("10furlongs", "unit"), ("10mbit:40min", "latency")])
def test_bad_link_specs_name_the_accepted_forms(text, hint):
    with pytest.raises(ValueError, match=hint) as info:
        parse_link(text)
    assert "RATE[:LATENCY]" in str(info.value) and "mbit" in str(info.value)


def test_unlimited_rate_adds_latency_only():
    spec = parse_link("unlimited:40ms")
    assert spec.latency_s == pytest.approx(0.040) and spec.rate_bits == float("inf") and str(spec) == "unlimited:40ms"
    assert parse_link(str(spec)) == spec and str(parse_link("Unlimited")) == "unlimited"
    shaper, clock = fake_shaper("unlimited:40ms", now=10.0)
    flow = shaper.sender()
    assert flow.schedule(10 << 20, 10.0) == pytest.approx(10.040)  # a flow's first message: latency only
    assert flow.schedule(10 << 20, 10.0) == pytest.approx(10.0)  # the next ones back to back, however large
    assert shaper.receiver().schedule(10 << 20, 10.0) == pytest.approx(10.0)


def test_none_means_unshaped():
    assert parse_link_option(None) is None and parse_link_option("none") is None and parse_link_option("") is None
    assert parse_link_option("20mbit") == LinkSpec(20e6)


# ---- the schedule, on a fake clock -----------------------------------------------------------

def fake_shaper(spec: str, now: float = 0.0):
    clock = [now]
    return LinkShaper(parse_link(spec), clock=lambda: clock[0]), clock


def test_bucket_holds_at_most_10ms_of_traffic():
    shaper, _ = fake_shaper("8mbit")  # 1 MB/s: 10 ms = 10 kB
    burst = int(shaper.spec.bytes_per_s * BURST_S)
    t = 1000.0  # long idle: the credit is still only 10 ms
    assert shaper.sender().schedule(burst, t) == pytest.approx(t)  # passes at once
    # the bucket is empty now: the next 10 kB pays in full
    assert shaper.sender().schedule(burst, t) == pytest.approx(t + BURST_S)
    # a message much bigger than the bucket passes only at the rate
    later = t + 100
    assert shaper.sender().schedule(50 * burst, later) == pytest.approx(later + 49 * BURST_S)


def test_senders_share_one_bucket_in_order():
    shaper, _ = fake_shaper("8mbit")
    ends = [shaper.sender().schedule(100_000, 5.0) for _ in range(4)]  # four threads at the same instant
    assert ends == pytest.approx([5.0 - BURST_S + 0.1 * k for k in range(1, 5)])


def test_latency_is_paid_once_per_flow_and_overlaps_across_flows():
    shaper, _ = fake_shaper("80mbit:200ms")  # 10 MB/s
    flow = shaper.sender()
    times = [flow.schedule(100_000, 0.0)]
    for _ in range(9):  # the stream's next chunk is ready when the previous one was handed on
        times.append(flow.schedule(100_000, times[-1]))
    assert times[0] == pytest.approx(0.2 - BURST_S + 0.01)
    assert times[-1] == pytest.approx(0.2 - BURST_S + 0.1)  # 1 MB at 10 MB/s plus one latency, not ten
    other, _ = fake_shaper("80mbit:200ms")
    ends = [other.sender().schedule(100, 0.0) for _ in range(8)]  # concurrent unary messages
    assert max(ends) < 0.2 + 0.001


def test_download_overlaps_an_upstream_hop_but_not_a_fast_burst():
    shaper, clock = fake_shaper("8mbit")  # 1 MB/s
    clock[0] = 0.0
    flow = shaper.receiver()  # starts waiting at t=0
    # a 100 kB message that took its sender's (equally slow) uplink 0.1 s arrives at t=0.1: handed on at once
    assert flow.schedule(100_000, 0.1) == pytest.approx(0.1)
    # the next arrives immediately after: it pays its own transfer time
    assert flow.schedule(100_000, 0.1) == pytest.approx(0.2)
    # a flow that started waiting just now cannot credit bytes to the past
    clock[0] = 10.0
    assert shaper.receiver().schedule(1_000_000, 10.0) == pytest.approx(11.0 - BURST_S)


def replay(flows, messages):
    """Runs each flow's (size, think time) messages in real-time order; returns (flow, ready, size, out)."""
    queues = {f: [m for g, *m in messages if g == f] for f in range(len(flows))}
    free, out = [0.0] * len(flows), []
    while any(queues.values()):
        f = min((f for f in queues if queues[f]), key=lambda f: free[f] + queues[f][0][1])
        size, think = queues[f].pop(0)
        ready = free[f] + think  # a flow's thread is busy until its previous message was handed on
        free[f] = flows[f].schedule(size, ready)
        out.append((f, ready, size, free[f]))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 200_000), st.floats(0, 0.3)), min_size=1, max_size=30),
       st.sampled_from(["sender", "receiver"]))
def test_no_window_of_deliveries_beats_the_rate(messages, side):
    shaper, _ = fake_shaper("8mbit:50ms")  # 1 MB/s
    flows = [getattr(shaper, side)() for _ in range(4)]
    out = replay(flows, messages)
    rate, latency, biggest = shaper.spec.bytes_per_s, shaper.spec.latency_s, max(m[1] for m in messages)
    firsts = {}
    for f, ready, size, handed in out:
        assert handed >= ready - 1e-9
        firsts.setdefault(f, (ready, handed))
    if side == "sender":  # every flow's first message waits out the whole latency
        assert all(handed >= ready + latency - 1e-9 for ready, handed in firsts.values())
    times = sorted((handed, size) for _, _, size, handed in out)
    for i, (a, _) in enumerate(times):
        for b, _ in times[i:]:
            moved = sum(size for t, size in times if a <= t <= b)
            # within one message (cut-through, or a slot straddling the window) and the 10 ms bucket
            assert moved <= rate * (b - a + BURST_S) + biggest + 1e-6


# ---- real time: lower bounds only -------------------------------------------------------------

def burst_bytes(shaper: LinkShaper) -> float:
    return shaper.spec.bytes_per_s * shaper.burst_s


@pytest.mark.parametrize("direction", ["send", "receive"])
def test_one_big_message_takes_its_size_over_the_rate(direction):
    shaper = LinkShaper(parse_link("8mbit"))
    size = 500_000
    t0 = time.monotonic()
    assert (shaper.sender().send(size) if direction == "send" else shaper.receiver().receive(size))
    assert time.monotonic() - t0 >= (size - burst_bytes(shaper)) / shaper.spec.bytes_per_s


@pytest.mark.parametrize("direction", ["send", "receive"])
def test_many_small_messages_take_their_total_over_the_rate(direction):
    shaper = LinkShaper(parse_link("8mbit"))
    flow = shaper.sender() if direction == "send" else shaper.receiver()
    step = flow.send if direction == "send" else flow.receive
    t0 = time.monotonic()
    for _ in range(500):
        step(1000)
    assert time.monotonic() - t0 >= (500 * 1000 - burst_bytes(shaper)) / shaper.spec.bytes_per_s


def test_concurrent_senders_share_the_peers_rate():
    shaper = LinkShaper(parse_link("8mbit"))
    start = threading.Barrier(4)

    def push():
        start.wait(timeout=10)
        flow = shaper.sender()
        for _ in range(25):
            flow.send(5000)

    threads = [threading.Thread(target=push) for _ in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - t0 >= (4 * 25 * 5000 - burst_bytes(shaper)) / shaper.spec.bytes_per_s


def test_latency_is_pipelined_across_concurrent_messages():
    latency, n = 0.3, 8
    shaper = LinkShaper(parse_link("1gbit:300ms"))
    start = threading.Barrier(n)
    spans = [None] * n

    def send(i):
        start.wait(timeout=10)
        t = time.monotonic()
        shaper.sender().send(100)
        spans[i] = (t, time.monotonic())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert all(span is not None for span in spans)
    assert all(end - begin >= latency for begin, end in spans)
    # every message was in flight while every other one was: they overlapped, not queued
    assert max(begin for begin, _ in spans) < min(end for _, end in spans)
    assert max(end for _, end in spans) - min(begin for begin, _ in spans) < 3 * latency  # serial: 8 x 0.3 s


def test_a_stream_pays_latency_once_not_per_chunk():
    shaper = LinkShaper(parse_link("80mbit:200ms"))  # 10 MB/s
    flow = shaper.sender()
    t0 = time.monotonic()
    for _ in range(20):
        flow.send(10_000)  # 200 kB: 20 ms of transfer
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.2 + (200_000 - burst_bytes(shaper)) / shaper.spec.bytes_per_s
    assert elapsed < 3 * (0.2 + 0.02)  # per chunk it would be 20 x 0.2 s


def test_waits_end_at_the_deadline_and_on_close():
    shaper = LinkShaper(parse_link("8kbit"))  # 1 kB/s
    t0 = time.monotonic()
    assert not shaper.sender().send(100_000, deadline=t0 + 0.05)  # 100 s of traffic, 50 ms allowed
    assert time.monotonic() - t0 < 10
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (shaper.receiver().receive(1_000_000), done.set()))
    waiter.start()
    shaper.close()
    waiter.join(timeout=10)
    assert done.is_set()


def test_unshaped_traffic_counts_as_before():
    traffic = Traffic()
    message = wire_pb2.PingRequest(sender="x" * 100)
    traffic.count_sent(message)
    list(traffic.sending([message, message]))
    list(traffic.receiving([message]))
    size = message.ByteSize() + GRPC_FRAME_BYTES
    assert traffic.link is None and traffic.sent == 3 * size and traffic.received == size


# ---- end to end over gRPC on localhost -----------------------------------------------------------

@pytest.fixture
def shaped_pair():
    """A server and a client endpoint, each behind its own 20 Mbit/s link with 50 ms latency."""
    link = parse_link("20mbit:50ms")
    server_traffic, client_traffic = Traffic(LinkShaper(link)), Traffic(LinkShaper(link))
    channels = Channels(1 << 20)
    service = PeerService("server", server_traffic, channels)
    server, port = start_server(service, "127.0.0.1", 0, 1 << 20, max_workers=8)
    yield link, service, f"127.0.0.1:{port}", server_traffic, client_traffic, channels
    server_traffic.link.close()
    client_traffic.link.close()
    server.stop(grace=None)
    channels.close()


def test_shaped_state_download_over_grpc_takes_bytes_over_rate(shaped_pair):
    link, service, endpoint, server_traffic, client_traffic, channels = shaped_pair
    blob = bytes(range(256)) * (3_000_000 // 256)  # ~3 MB: 1.2 s at 20 Mbit/s

    def serve(request, context):
        for i, data in enumerate(slices(blob, 256 << 10)):
            yield wire_pb2.StateChunk(run_id="r", total_bytes=len(blob), data=data) if i == 0 else \
                wire_pb2.StateChunk(data=data)

    service.state_handler = serve
    t0 = time.monotonic()
    state = download_state(channels, client_traffic, endpoint, "r", "client", 0, wait_s=0, timeout=30,
                           max_bytes=len(blob))
    elapsed = time.monotonic() - t0
    assert state.data == blob
    moved = client_traffic.received
    assert moved == server_traffic.sent > len(blob)
    # the request crossed the client's link and the reply the server's, each with its latency
    assert elapsed >= (moved - burst_bytes(server_traffic.link)) / link.bytes_per_s + 2 * link.latency_s


def test_shaped_upload_stream_over_grpc_takes_bytes_over_rate(shaped_pair):
    link, service, endpoint, server_traffic, client_traffic, channels = shaped_pair
    blob = b"\x07" * 2_500_000  # 1 s at 20 Mbit/s

    def reduce(requests, context):
        first = next(requests)
        data = assemble(first.total_bytes, [first.data] + [r.data for r in requests], len(blob))
        yield wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.OK, total_bytes=len(data))

    service.reduce_handler = reduce

    def chunks():
        for i, data in enumerate(slices(blob, 256 << 10)):
            yield wire_pb2.ReduceChunk(total_bytes=len(blob), data=data) if i == 0 else wire_pb2.ReduceChunk(data=data)

    t0 = time.monotonic()
    deadline = t0 + 30
    replies = channels.stub(endpoint).Reduce(client_traffic.sending(chunks(), deadline), timeout=30)
    reply = list(client_traffic.receiving(replies, deadline))
    elapsed = time.monotonic() - t0
    assert reply[0].status == wire_pb2.ReduceReply.OK and reply[0].total_bytes == len(blob)
    moved = client_traffic.sent
    assert moved == server_traffic.received > len(blob)
    assert elapsed >= (moved - burst_bytes(client_traffic.link)) / link.bytes_per_s + 2 * link.latency_s


# ---- config and report ---------------------------------------------------------------------------

def test_link_section_with_per_peer_exceptions(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[link]\ndefault = "100mbit:40ms"\n[link.peers]\n1 = "20mbit:80ms"\n')
    config = load_config(path)
    assert [config.link.spec_for(i) for i in range(3)] == ["100mbit:40ms", "20mbit:80ms", "100mbit:40ms"]
    assert config.config_hash() == default_config().config_hash()  # the network is not part of the run
    flagged = config.override({"link.default": "none"})
    assert [flagged.link.spec_for(i) for i in range(3)] == ["", "20mbit:80ms", ""]


@pytest.mark.parametrize("text, field", [('[link]\ndefault = "100mbps"\n', "link.default"),
                                          ('[link.peers]\n0 = "fast"\n', "link.peers.0"),
                                          ('[link.peers]\nslow = "20mbit"\n', "peer indices"),
                                          ('[link]\npeers = "20mbit"\n', "link.peers")])
def test_bad_link_config_names_the_key(tmp_path, text, field):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field):
        load_config(path)


def test_simulate_accepts_link_and_refuses_a_bad_one_before_starting(capsys):
    from lowcomm.cli import build_parser, main

    assert build_parser().parse_args(["simulate", "--link", "50mbit:20ms"]).link == "50mbit:20ms"
    assert build_parser().parse_args(["peer", "join", "--coordinator", "x", "--run-key", "k",
                                      "--link", "20mbit"]).link == "20mbit"
    assert build_parser().parse_args(["simulate", "--netns"]).netns is True  # tests/integration/test_netns_sim.py runs it
    assert main(["simulate", "--stages", "3"]) == 2  # 4 blocks do not cut into 3 equal stages: refused at once
    assert main(["simulate", "--link", "100mbps"]) == 2  # a config error, before anything starts
    assert "ambiguous" in capsys.readouterr().err


def test_report_lists_links_and_the_rounds_link_bound():
    records = [{"type": "event", "kind": "start", "peer": "a", "t": 0.0, "link": "8mbit:10ms"},
               {"type": "event", "kind": "start", "peer": "b", "t": 0.0, "link": None},
               {"type": "compute", "peer": "a", "first_step_t": 1.0, "last_step_t": 5.0, "steps": 2, "tokens": 10},
               {"type": "round", "peer": "a", "round": 0, "t0": 2.0, "sync_s": 0.6, "bytes": 500_000,
                "participants": ["a", "b"], "contributors": ["a", "b"], "phi_hash": "h", "tokens": 10,
                "leader": "a"},
               {"type": "round", "peer": "b", "round": 0, "t0": 2.0, "sync_s": 0.5, "bytes": 900_000,
                "participants": ["a", "b"], "contributors": ["a", "b"], "phi_hash": "h", "tokens": 10,
                "leader": "a"}]
    report = build_report(records, algo="diloco", peers=2, seed=0, model_params=1, started_at=0.0)
    assert report["links"] == {"a": "8mbit:10ms", "b": None}
    assert report["rounds"][0]["link_bound_s"] == pytest.approx(0.5)  # only a is shaped: 500 kB at 1 MB/s
    assert report["netns"] is False and report["wire_bytes"] is None and report["control_bytes"] is None
    # a latency-only link bounds nothing; under --netns the caller passes the caps (simulate's kernel links)
    latency_only = [{**r, "link": "unlimited:10ms"} if r.get("kind") == "start" else r for r in records]
    assert build_report(latency_only, algo="diloco", peers=2, seed=0, model_params=1,
                        started_at=0.0)["rounds"][0]["link_bound_s"] is None
    capped = build_report(latency_only, algo="diloco", peers=2, seed=0, model_params=1, started_at=0.0,
                          links_override={"a": "8mbit:10ms", "b": "4mbit:10ms"})
    assert capped["links"] == {"a": "8mbit:10ms", "b": "4mbit:10ms"}
    assert capped["rounds"][0]["link_bound_s"] == pytest.approx(1.8)  # b: 900 kB at 0.5 MB/s


def test_report_splits_the_training_loops_time():
    compute = [{"type": "compute", "peer": p, "first_step_t": 0.0, "last_step_t": 10.0, "steps": 4, "tokens": 8,
                "compute_s": 6.0, "sync_wait_s": wait, "eval_s": ev} for p, wait, ev in (("a", 3.0, 1.0),
                                                                                        ("b", 1.0, 0.0))]
    report = build_report(compute, algo="diloco", peers=2, seed=0, model_params=1, started_at=0.0)
    assert (report["sync_wait_s"], report["eval_s"]) == (4.0, 1.0)
    assert (report["compute_utilization"], report["sync_wait_share"], report["eval_share"]) == (0.6, 0.2, 0.05)
    older = [{k: v for k, v in r.items() if k not in ("sync_wait_s", "eval_s")} for r in compute]
    report = build_report(older, algo="diloco", peers=2, seed=0, model_params=1, started_at=0.0)
    assert report["sync_wait_s"] is None and report["eval_share"] is None  # not measured is not zero
