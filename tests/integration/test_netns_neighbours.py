"""A lab of 34 nodes: every node reaches every other on both planes. The host's ARP table is one for
all namespaces, and 34 nodes that all talk need more entries than its default limit (1024), which
the lab raises (transport.netns, "Neighbours"); past it connections failed with "No route to host"
or timed out. The limits are only ever raised, and a host that refuses says what to run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from children import default_sigint
from integration.test_netns import lab, needs_netns, processes, read_line  # noqa: F401  (fixtures)

from lowcomm.transport import netns_commands

MESH = r"""
import json, socket, sys, threading
server = socket.socket()
server.bind(("0.0.0.0", 0))
server.listen(256)
print(server.getsockname()[1], flush=True)
def serve():
    while True:
        conn, _ = server.accept()
        conn.sendall(b"k")
        conn.close()
threading.Thread(target=serve, daemon=True).start()
others = json.loads(sys.stdin.readline())
failed = []
for host, port in others:
    try:
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.settimeout(10)
            assert conn.recv(1) == b"k"
    except (OSError, AssertionError) as error:
        failed.append([host, str(error)])
print(json.dumps(failed), flush=True)
sys.stdin.read()  # serve until the test closes stdin
"""


@needs_netns
@pytest.mark.timeout(240)
def test_every_node_of_a_34_node_lab_reaches_every_other_on_both_planes(lab, processes):
    nodes = [lab.add_node(f"n{i}") for i in range(34)]
    assert int((netns_commands.NEIGH_SYSCTL / "gc_thresh3").read_text()) >= netns_commands.neighbour_entries(34)
    meshes = []
    for node in nodes:
        process = subprocess.Popen(node.wrap([sys.executable, "-I", "-c", MESH]), stdout=subprocess.PIPE,
                                   stdin=subprocess.PIPE, text=True, start_new_session=True,
                                   preexec_fn=default_sigint)
        processes.started.append(process)
        meshes.append(process)
    ports = [int(read_line(process)) for process in meshes]
    for i, process in enumerate(meshes):
        others = [[address, ports[j]] for j, other in enumerate(nodes) if j != i
                  for address in (other.address, other.control_address)]
        process.stdin.write(json.dumps(others) + "\n")
        process.stdin.flush()
    failures = {node.name: json.loads(read_line(process, timeout=180)) for node, process in zip(nodes, meshes)}
    for process in meshes:
        process.stdin.close()
    assert {name: failed for name, failed in failures.items() if failed} == {}


def read_only(*args, **kwargs):
    raise PermissionError("read-only file system")


def test_the_limits_are_raised_to_fit_never_lowered_and_a_refusal_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(netns_commands, "NEIGH_SYSCTL", tmp_path)
    (tmp_path / "gc_thresh2").write_text("512\n")
    (tmp_path / "gc_thresh3").write_text("100000\n")
    netns_commands.fit_neighbour_table(4)  # 40 entries: both limits already fit
    assert (tmp_path / "gc_thresh2").read_text() == "512\n" and (tmp_path / "gc_thresh3").read_text() == "100000\n"
    netns_commands.fit_neighbour_table(34)
    need = netns_commands.neighbour_entries(34)
    assert int((tmp_path / "gc_thresh2").read_text()) == need and need > 2000
    assert (tmp_path / "gc_thresh3").read_text() == "100000\n"  # higher already: left as it was
    (tmp_path / "gc_thresh2").write_text("512\n")
    monkeypatch.setattr(netns_commands.Path, "write_text", read_only)  # as /proc/sys in an unprivileged container
    with pytest.raises(netns_commands.NetnsError, match=r"sysctl -w net\.ipv4\.neigh\.default\.gc_thresh2="):
        netns_commands.fit_neighbour_table(34)
