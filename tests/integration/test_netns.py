"""The namespace lab: addresses and htb parameters (anywhere), then, as root with iproute2, real
namespaces: teardown on every exit path (normal, error, a SIGKILLed child, a SIGKILLed owner),
TCP between namespaces only over the lab's addresses, htb caps in both directions (lower bounds on
time only: the machine is shared), and veth counters and the data/control class split against the
bytes sent. Processes report readiness on stdout; nothing waits on a sleep."""

from __future__ import annotations

import ipaddress
import json
import os
import selectors
import signal
import subprocess
import sys

import pytest
from children import default_sigint, wait_until

from lowcomm.transport import netns
from lowcomm.transport.netns import NetnsLab, NetnsUnavailable, cleanup_stale, lab_objects, unavailable_reason

MBIT = 1e6
HEADROOM = 1.06  # TCP/IP/Ethernet headers per 1448-byte segment are 66 bytes (4.6%)
SLACK = 20_000  # handshakes, ACKs, ARP
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

needs_netns = pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"namespace tests need root and iproute2: {unavailable_reason()}")

SERVER = r"""
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(8)
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    received = 0
    while chunk := conn.recv(1 << 16):
        received += len(chunk)
    conn.sendall(f"{received}\n".encode())
    conn.close()
"""

CLIENT = r"""
import json, socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
connect_s = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
started = time.monotonic()
try:
    conn = socket.create_connection((host, port), timeout=connect_s)
except OSError as error:
    print(json.dumps({"error": error.__class__.__name__}))
    sys.exit(0)
block = b"x" * (1 << 16)
left = nbytes
while left:
    left -= conn.send(block[:min(left, len(block))])
conn.shutdown(socket.SHUT_WR)
echo = conn.makefile().readline()
ended = time.monotonic()  # one clock for all namespaces
print(json.dumps({"elapsed": ended - started, "started": started, "ended": ended, "echo": int(echo)}))
"""




# ---- helpers ----------------------------------------------------------------------------

def outside_state() -> tuple[set[str], set[str]]:
    """Namespaces and links that belong to no lab (other labs may come and go while tests run)."""
    return ({ns for ns in netns._list_netns() if not netns.TAG_PATTERN.match(ns)},
            {link for link in netns._list_links() if not netns.TAG_PATTERN.match(link)})


def assert_gone(tag: str, before: tuple[set[str], set[str]]) -> None:
    assert lab_objects(tag) == {"netns": [], "links": []}
    assert not (netns.RUN_DIR / tag).exists()
    assert outside_state() == before


def read_line(process: subprocess.Popen, timeout: float = 60) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        raise AssertionError(f"no output from {process.args} in {timeout}s")
    line = process.stdout.readline()
    assert line, f"{process.args} exited ({process.poll()}) before it printed anything"
    return line.strip()




class Processes:
    def __init__(self):
        self.started: list[subprocess.Popen] = []

    def start(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                   start_new_session=True, preexec_fn=default_sigint, **kwargs)
        self.started.append(process)
        return process

    def server(self, node, host: str = "0.0.0.0") -> tuple[subprocess.Popen, int]:
        process = self.start(node.wrap([sys.executable, "-I", "-c", SERVER, host]))
        return process, int(read_line(process))

    def push(self, node, host: str, port: int, nbytes: int, connect_s: float = 60.0) -> dict:
        return self.finish(self.start_push(node, host, port, nbytes, connect_s))

    def start_push(self, node, host: str, port: int, nbytes: int, connect_s: float = 60.0) -> subprocess.Popen:
        return self.start(node.wrap([sys.executable, "-I", "-c", CLIENT, host, str(port), str(nbytes),
                                     str(connect_s)]))

    @staticmethod
    def finish(process: subprocess.Popen) -> dict:
        out, _ = process.communicate(timeout=90)
        assert process.returncode == 0, out
        return json.loads(out)

    def reap(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            process.stdout.close()


@pytest.fixture
def processes():
    started = Processes()
    yield started
    started.reap()


@pytest.fixture
def lab(processes):
    before = outside_state()
    try:
        opened = NetnsLab().open()
    except NetnsUnavailable as error:
        pytest.skip(str(error))
    try:
        yield opened
    finally:
        opened.close()
        processes.reap()
        assert_gone(opened.tag, before)


# ---- teardown on every exit path ---------------------------------------------------------

@needs_netns
@pytest.mark.timeout(60)
def test_setup_builds_named_links_and_teardown_leaves_nothing():
    before = outside_state()
    with NetnsLab() as lab:
        nodes = [lab.add_node(f"peer-{i}", rate=20 * MBIT) for i in range(3)] + [lab.add_node("coordinator")]
        objects = lab_objects(lab.tag)
        assert sorted(objects["netns"]) == sorted(node.ns for node in nodes)
        assert sorted(objects["links"]) == sorted([lab.bridge] + [node.host_veth for node in nodes])
        assert all(len(name) <= 15 for name in objects["links"])
        assert json.loads((netns.RUN_DIR / lab.tag).read_text())["pid"] == os.getpid()
        addresses = [ipaddress.ip_address(node.address) for node in nodes]
        assert all(address in lab.data_net for address in addresses) and len(set(addresses)) == 4
        assert all(ipaddress.ip_address(node.control_address) in lab.control_net for node in nodes)
        with pytest.raises(ValueError):
            lab.add_node("peer-0")
    assert_gone(lab.tag, before)
    assert nodes[0].counters()["tx"] >= 0  # the snapshot taken at close


@needs_netns
@pytest.mark.timeout(60)
def test_teardown_when_the_body_raises():
    before = outside_state()
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsLab() as lab:
            lab.add_node("a", rate=8 * MBIT)
            raise RuntimeError("boom")
    assert_gone(lab.tag, before)


@needs_netns
@pytest.mark.timeout(60)
def test_teardown_after_a_killed_child_kills_the_living_ones(processes):
    before = outside_state()
    with NetnsLab() as lab:
        a, b = lab.add_node("a"), lab.add_node("b", rate=8 * MBIT)
        killed, _ = processes.server(a)
        living, _ = processes.server(b)
        os.killpg(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=10) == -signal.SIGKILL
    assert living.wait(timeout=10) == -signal.SIGKILL  # close() killed it so the namespace was not busy
    assert_gone(lab.tag, before)


OWNER = r"""
import signal, subprocess, sys
from lowcomm.transport.netns import NetnsLab
with NetnsLab(reaper=sys.argv[1] == "reaper") as lab:
    node = lab.add_node("a", rate=8e6)
    child = subprocess.Popen(node.wrap([sys.executable, "-c", "import signal; signal.pause()"]),
                             start_new_session=True)
    print(lab.tag, child.pid, flush=True)
    signal.pause()
"""


def start_owner(processes: Processes, mode: str, sig: int = signal.SIGKILL) -> tuple[subprocess.Popen, str, int]:
    owner = processes.start([sys.executable, "-c", OWNER, mode], cwd=REPO)
    tag, child = read_line(owner).split()
    assert lab_objects(tag)["netns"] == [f"{tag}-a"]
    os.killpg(owner.pid, sig)  # the owner's group: its child inside lives in a group of its own
    owner.wait(timeout=30)
    return owner, tag, int(child)


@needs_netns
@pytest.mark.timeout(90)
def test_ctrl_c_in_the_owner_removes_the_lab(processes):
    before = outside_state()
    owner, tag, child = start_owner(processes, "no-reaper", signal.SIGINT)
    assert owner.returncode != 0  # KeyboardInterrupt went through __exit__
    assert netns._process_start(child) is None
    assert_gone(tag, before)


@needs_netns
@pytest.mark.timeout(90)
def test_cleanup_stale_removes_the_lab_of_a_killed_owner(processes):
    before = outside_state()
    _, tag, child = start_owner(processes, "no-reaper")
    assert lab_objects(tag)["netns"] and netns._process_start(child) is not None  # left behind
    assert tag in cleanup_stale()
    assert netns._process_start(child) is None  # killed with its namespace
    assert_gone(tag, before)


@needs_netns
@pytest.mark.timeout(90)
def test_reaper_removes_the_lab_when_its_owner_is_killed(processes):
    before = outside_state()
    _, tag, child = start_owner(processes, "reaper")
    wait_until(lambda: not (netns.RUN_DIR / tag).exists(), 60, "the reaper's cleanup", poll_s=0.05)
    assert netns._process_start(child) is None
    assert_gone(tag, before)


@needs_netns
@pytest.mark.timeout(60)
def test_a_live_owners_lab_is_not_stale(lab):
    lab.add_node("a")
    assert lab.tag not in cleanup_stale() and lab_objects(lab.tag)["netns"]


# ---- traffic -----------------------------------------------------------------------------

@needs_netns
@pytest.mark.timeout(90)
def test_tcp_between_namespaces_only_over_the_labs_addresses(lab, processes):
    a, b = lab.add_node("a"), lab.add_node("b")
    _, port = processes.server(a)
    assert processes.push(b, a.address, port, 1000)["echo"] == 1000
    assert processes.push(b, a.control_address, port, 1000)["echo"] == 1000
    assert processes.push(b, "127.0.0.1", port, 1000) == {"error": "ConnectionRefusedError"}  # b's own loopback
    shown = subprocess.run(b.wrap(["ip", "-4", "-o", "addr", "show"]), capture_output=True, text=True, timeout=30)
    assert sorted(line.split()[3] for line in shown.stdout.splitlines()) == sorted(
        ["127.0.0.1/8", f"{b.address}/24", f"{b.control_address}/24"])
    routes = subprocess.run(b.wrap(["ip", "-4", "-j", "route", "show"]), capture_output=True, text=True, timeout=30)
    assert {route["dst"] for route in json.loads(routes.stdout)} == {"default", str(lab.data_net),
                                                                     str(lab.control_net)}


@needs_netns
@pytest.mark.timeout(90)
def test_a_node_that_refuses_inbound_connections_still_dials_out(lab, processes):
    a, b = lab.add_node("a"), lab.add_node("b")
    lab.refuse_inbound(a)
    _, a_port = processes.server(a)
    _, b_port = processes.server(b)
    assert processes.push(a, b.address, b_port, 1000)["echo"] == 1000  # out: as before
    for address in (a.address, a.control_address):  # in: no connection completes, on either plane
        assert processes.push(b, address, a_port, 1000, connect_s=3) == {"error": "TimeoutError"}
    assert processes.push(a, b.control_address, b_port, 1000)["echo"] == 1000
    assert a.refuses_inbound and not b.refuses_inbound


def delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


def settled(*nodes, within_s: float = 10.0) -> list[dict]:
    """The nodes' counters once two reads 50 ms apart agree: the last frames of a connection (its ACKs
    and FINs) still cross the bridge after the client returns, and a busy host reads one node's
    counters well after the other's."""
    last: list = [None]

    def unchanged():
        now, before = [n.counters() for n in nodes], last[0]
        last[0] = now
        return now if now == before else None

    return wait_until(unchanged, within_s, "counters that stop moving", poll_s=0.05)


@needs_netns
@pytest.mark.timeout(120)
def test_upload_cap_holds_and_counters_account_for_the_bytes(lab, processes):
    a, b = lab.add_node("a", rate=8 * MBIT), lab.add_node("b")
    _, port = processes.server(b)
    sent_before, received_before = settled(a, b)
    nbytes = 2_000_000
    result = processes.push(a, b.address, port, nbytes)
    assert result["echo"] == nbytes
    assert result["elapsed"] >= nbytes * 8 / (8 * MBIT) * 0.9
    sent_after, received_after = settled(a, b)
    sent, received = delta(sent_after, sent_before), delta(received_after, received_before)
    assert nbytes <= sent["tx"] <= nbytes * HEADROOM + SLACK
    assert nbytes <= received["rx"] <= nbytes * HEADROOM + SLACK
    assert abs(received["rx"] - sent["tx"]) <= 2_000  # what a sent over the bridge is what b got
    classes = a.class_bytes()
    assert classes["control"]["tx"] == 0
    assert abs(classes["data"]["tx"] - a.counters()["tx"]) <= 1_000  # the same frames, counted by htb


@needs_netns
@pytest.mark.timeout(120)
def test_download_cap_holds_after_set_rate(lab, processes):
    a, b = lab.add_node("a"), lab.add_node("b")  # both uncapped: b sends to a as fast as it can
    lab.set_rate(a, 8 * MBIT)
    shown = subprocess.run(["tc", "class", "show", "dev", a.host_veth], capture_output=True, text=True, timeout=30)
    assert "rate 8Mbit ceil 8Mbit" in shown.stdout
    _, port = processes.server(a)
    nbytes = 2_000_000
    result = processes.push(b, a.address, port, nbytes)
    assert result["echo"] == nbytes
    assert result["elapsed"] >= nbytes * 8 / (8 * MBIT) * 0.9
    assert nbytes <= a.class_bytes()["data"]["rx"] <= nbytes * HEADROOM + SLACK


@needs_netns
@pytest.mark.timeout(120)
def test_data_and_control_bytes_are_counted_apart(lab, processes):
    a, b = lab.add_node("a"), lab.add_node("b")
    _, port = processes.server(b)
    data_bytes, control_bytes = 600_000, 250_000
    assert processes.push(a, b.address, port, data_bytes)["echo"] == data_bytes
    assert processes.push(a, b.control_address, port, control_bytes)["echo"] == control_bytes
    sent, received = a.class_bytes(), b.class_bytes()
    assert data_bytes <= sent["data"]["tx"] <= data_bytes * HEADROOM + SLACK
    assert control_bytes <= sent["control"]["tx"] <= control_bytes * HEADROOM + SLACK
    assert data_bytes <= received["data"]["rx"] <= data_bytes * HEADROOM + SLACK
    assert control_bytes <= received["control"]["rx"] <= control_bytes * HEADROOM + SLACK
    assert abs(sent["data"]["tx"] + sent["control"]["tx"] - a.counters()["tx"]) <= 1_000
    totals = lab.sent_bytes()
    assert totals["total"] == totals["data"] + totals["control"] >= data_bytes + control_bytes
    lab.close()  # the counters stay readable from the snapshot taken at close
    assert a.class_bytes()["control"]["tx"] == sent["control"]["tx"]


@needs_netns
@pytest.mark.timeout(120)
def test_data_and_control_share_one_cap(lab, processes):
    a, b = lab.add_node("a", rate=8 * MBIT), lab.add_node("b")
    _, port = processes.server(b)
    each = 1_000_000
    pushes = [processes.start_push(a, host, port, each) for host in (b.address, b.control_address)]
    results = [processes.finish(push) for push in pushes]
    assert [result["echo"] for result in results] == [each, each]
    span = max(r["ended"] for r in results) - min(r["started"] for r in results)
    assert span >= 2 * each * 8 / (8 * MBIT) * 0.9  # two caps of 8 Mbit/s would take half as long
    classes = a.class_bytes()
    assert each <= classes["data"]["tx"] and each <= classes["control"]["tx"]
