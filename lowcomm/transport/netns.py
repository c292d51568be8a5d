"""Network namespaces for `lowcomm simulate --netns`: every process of a node on its own capped link.

This module holds the lab (NetnsLab, Node) and its command line; netns_commands the `ip`/`tc`
commands, subnets and htb classes; netns_cleanup the markers, the reaper and stale-lab removal.

A NetnsLab owns what it creates on the host and nothing else: one Linux bridge in the root
namespace, one network namespace per node joined to the bridge by a veth pair, `tc` htb caps on
both ends of each pair, and a marker file RUN_DIR/<tag>. Everything is named after the lab's tag
(`lcn` + 4 hex digits), so leftovers can be found and removed (BENCHMARKS.md, "How to emulate the
internet on one machine"). Because the kernel shapes and counts the packets, this works for any
program run through `node.wrap(cmd)`, lowcomm or not.

- **Addresses.** A lab takes two private /24s that overlap no IPv4 address or route on the host: a
  data subnet and a control subnet. Node i (from 0) has .(i+2) of both on its `eth0`: `address` for
  gRPC and everything that is not lowcomm's control plane, `control_address` for the DHT (give it to
  p2pd's host and announce multiaddrs). The bridge holds .1 of both and is the nodes' default route;
  the host does not forward (the lab leaves ip_forward alone), so nothing leaves the machine. IPv6
  is off on the lab's links, so router solicitations and the like do not add to the counters.
- **Neighbours.** The kernel's ARP table is one for the whole host, its limits too: a lab of n nodes
  can hold about 2n² entries (1024 by default: past about 22 nodes connections can fail), so `add_node`
  raises gc_thresh2 and gc_thresh3 to fit (`fit_neighbour_table`), and never lowers them.
- **Caps.** The same htb tree on the node's `eth0` (its egress is the node's upload) and on the
  host-side veth (its egress toward the node is the node's download): a root class at the link
  rate and two leaves, data (1:10) and control (1:20), each guaranteed half and allowed all of it.
  A u32 filter sends packets with a control-subnet source or destination to the control leaf; the
  rest (ARP included) is data. So both planes share one cap, and `tc -s class show` counts each.
  Burst is BURST_S (10 ms, as the application shaper's bucket) of the rate, at least two full
  frames. htb needs burst >= rate/HZ only where its clock ticks at HZ; on high-resolution timers
  (/proc/net/psched reports 1 GHz) 10 ms is far above any such bound. Each leaf queues at most
  BUFFER_S (100 ms) of its link (16 to 1000 frames), so a download fed faster than it drains drops
  packets as an access link does instead of queueing seconds of delay. There is no latency here:
  the `netem` qdisc is not available, so latency stays in the application shaper.
- **Refusing connections.** `refuse_inbound(node)` drops the TCP SYN-ACKs the node sends, so no
  connection to it completes while its own outbound ones do: a peer behind NAT or a firewall.
- **Counting.** GSO is off on the lab's veths (gso_max_segs 1), so every packet the qdisc sees is
  one wire frame: the veth counters and the htb class counters count the same frames, Ethernet
  header included, for every program alike. `counters()` reads the host-side veth, whose rx is the
  node's tx. A lab's counters are snapshotted when it closes and still readable afterwards.
- **Cleanup.** `close()` (also `__exit__` and atexit) SIGKILLs every process still inside the
  lab's namespaces, then deletes its veths, namespaces, bridge and marker. A reaper process in its
  own session holds the read end of a pipe from the owner; when the owner dies, even by SIGKILL,
  the pipe closes and the reaper removes the lab. `cleanup_stale()` removes labs whose owner is
  gone (and lab objects with no marker), for the case where the reaper died too.
"""
from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# the lab's parts, importable from here as from one module
from lowcomm.transport.netns_cleanup import (_kill_inside, _locked, _marker_path, _pids_inside,  # noqa: F401
                                             _process_start, _read_marker, _reap, cleanup_stale, lab_objects,
                                             remove_lab)
from lowcomm.transport.netns_commands import (BURST_S, FRAME_BYTES, MAX_NODES, NODE_NAME, RUN_DIR,  # noqa: F401
                                              TAG_PATTERN, TAG_PREFIX, UNCAPPED_BITS, HtbParams, NetnsError,
                                              NetnsUnavailable, _class_bytes, _disable_ipv6, _htb_commands,
                                              _ip_batch, _list_links, _list_netns, _refusal_commands, _run,
                                              _tc_batch, choose_subnets, fit_neighbour_table, host_networks,
                                              unavailable_reason)

logger = logging.getLogger(__name__)


@dataclass
class Node:
    """One namespace on the lab's bridge; run anything in it with `wrap`."""

    lab: "NetnsLab" = field(repr=False)
    name: str
    index: int
    ns: str
    address: str  # data subnet
    control_address: str  # control subnet: the DHT / p2pd
    host_veth: str  # the veth's end in the root namespace, on the bridge
    rate_bits: float | None = None  # None: uncapped
    refuses_inbound: bool = False  # NetnsLab.refuse_inbound: nobody can open a connection to it
    final: dict | None = field(default=None, repr=False)  # counters and class bytes when the lab closed

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside this node's namespace (`ip netns exec` keeps the pid: it execs the command)."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.ns, *cmd]

    def pids(self) -> list[int]:
        """The processes inside this node's namespace now (zombies excluded)."""
        return _pids_inside(self.ns)

    def counters(self) -> dict[str, int]:
        """Bytes this node sent (tx) and received (rx), Ethernet frames whole, from the host-side veth."""
        if self.final is not None:
            return dict(self.final["counters"])
        stats = Path("/sys/class/net") / self.host_veth / "statistics"
        # the host side receives what the node sends
        return {"tx": int((stats / "rx_bytes").read_text()), "rx": int((stats / "tx_bytes").read_text())}

    def class_bytes(self) -> dict[str, dict[str, int]]:
        """{"data": {"tx", "rx"}, "control": {"tx", "rx"}}: the same frames as counters(), split by plane."""
        if self.final is not None:
            return {plane: dict(split) for plane, split in self.final["class_bytes"].items()}
        sent = _class_bytes("eth0", self.ns)
        received = _class_bytes(self.host_veth)
        return {plane: {"tx": sent[plane], "rx": received[plane]} for plane in ("data", "control")}


class NetnsLab:
    """A bridge and one network namespace per node, with htb caps; removed on every exit path.

    with NetnsLab() as lab:
        a = lab.add_node("peer-0", rate=20e6)
        subprocess.Popen(a.wrap(["python", "-m", "lowcomm.cli", ...]), start_new_session=True)
    """

    def __init__(self, *, reaper: bool = True, clean_stale: bool = True):
        self.use_reaper = reaper
        self.clean_stale = clean_stale
        self.tag: str | None = None
        self.nodes: list[Node] = []
        self.closed = False
        self._reaper: subprocess.Popen | None = None
        self._reaper_pipe: int | None = None

    # -- lifecycle --

    def __enter__(self) -> "NetnsLab":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.close()
        except NetnsError:
            if exc_type is None:
                raise
            logger.exception("while leaving a lab after %s", exc_type.__name__)
        return False

    def open(self) -> "NetnsLab":
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        if self.clean_stale:
            cleanup_stale()
        try:
            with _locked():
                self.tag = self._new_tag()
                self.data_net, self.control_net = choose_subnets(host_networks() + self._other_labs_subnets())
                _marker_path(self.tag).write_text(json.dumps({
                    "pid": os.getpid(), "start": _process_start(os.getpid()), "created": time.time(),
                    "data_net": str(self.data_net), "control_net": str(self.control_net)}))
                atexit.register(self.close)
                if self.use_reaper:
                    self._start_reaper()
                self._add_bridge()
        except BaseException:
            with contextlib.suppress(NetnsError):
                self.close()
            raise
        logger.info("lab %s: data %s, control %s", self.tag, self.data_net, self.control_net)
        return self

    def close(self) -> None:
        """Kills what runs inside, snapshots the counters, removes everything; NetnsError lists what is left."""
        if self.closed or self.tag is None:
            return
        _kill_inside([node.ns for node in self.nodes])
        for node in self.nodes:
            with contextlib.suppress(OSError, NetnsError):
                snapshot = {"counters": node.counters(), "class_bytes": node.class_bytes()}
                node.final = snapshot
        left = remove_lab(self.tag)
        self.closed = True
        atexit.unregister(self.close)
        self._stop_reaper()
        if left["netns"] or left["links"]:
            raise NetnsError(f"lab {self.tag} left {left}; remove them with `python -m lowcomm.transport.netns "
                             f"cleanup` (as root) once whatever holds them has exited")

    # -- nodes --

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def bridge_address(self) -> str:
        return str(self.data_net.network_address + 1)

    def add_node(self, name: str, rate: float | None = None) -> Node:
        """A namespace `<tag>-<name>` with `eth0` on the bridge, capped at `rate` bits/s each way (None: uncapped)."""
        if self.tag is None or self.closed:
            raise NetnsError("add_node needs an open lab (use `with NetnsLab() as lab:`)")
        if not NODE_NAME.fullmatch(name) or any(node.name == name for node in self.nodes):
            raise ValueError(f"node name {name!r} must be new and match {NODE_NAME.pattern}")
        index = len(self.nodes)
        if index >= MAX_NODES:
            raise NetnsError(f"a lab holds at most {MAX_NODES} nodes")
        node = Node(self, name, index, ns=f"{self.tag}-{name}",
                    address=str(self.data_net.network_address + 2 + index),
                    control_address=str(self.control_net.network_address + 2 + index),
                    host_veth=f"{self.tag}h{index}", rate_bits=rate)
        self.nodes.append(node)  # before anything exists, so close() always looks for it
        fit_neighbour_table(len(self.nodes))
        _run(["ip", "netns", "add", node.ns])
        # in the new namespace, before its eth0 exists, so eth0 is born without IPv6 (no sysctl: IPv6 stays on)
        _run(["ip", "netns", "exec", node.ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"], check=False)
        _ip_batch([f"link add {node.host_veth} type veth peer name eth0 netns {node.ns}"])
        _disable_ipv6(node.host_veth)
        _ip_batch([f"link set {node.host_veth} master {self.bridge} gso_max_segs 1",
                   f"link set {node.host_veth} up"])
        prefix = self.data_net.prefixlen
        _ip_batch(["link set lo up", "link set eth0 gso_max_segs 1", "link set eth0 up",
                   f"addr add {node.address}/{prefix} dev eth0",
                   f"addr add {node.control_address}/{self.control_net.prefixlen} dev eth0",
                   f"route add default via {self.bridge_address}"], netns=node.ns)
        params = HtbParams.for_rate(rate or UNCAPPED_BITS)
        _tc_batch(_htb_commands("eth0", params, self.control_net, new=True), netns=node.ns)
        _tc_batch(_htb_commands(node.host_veth, params, self.control_net, new=True))
        return node

    def set_rate(self, node: Node, rate_bits: float | None) -> None:
        """Caps the node's upload (its eth0) and download (the host-side veth) at rate_bits each; None uncaps."""
        params = HtbParams.for_rate(rate_bits or UNCAPPED_BITS)
        _tc_batch(_htb_commands("eth0", params, self.control_net, new=False), netns=node.ns)
        _tc_batch(_htb_commands(node.host_veth, params, self.control_net, new=False))
        node.rate_bits = rate_bits

    def set_link(self, node: Node, up: bool) -> None:
        """Takes the host end of the node's veth down (the node's eth0 loses its carrier, as with a cable
        pulled: nothing goes in or out, its addresses, routes and caps stay) or up again."""
        _ip_batch([f"link set {node.host_veth} {'up' if up else 'down'}"])

    def refuse_inbound(self, node: Node) -> None:
        """After this call nobody can open a TCP connection to `node` (its SYN-ACKs are dropped), on either
        plane; the connections it opens work as before. It stands for a peer behind NAT or a firewall."""
        _tc_batch(_refusal_commands("eth0"), netns=node.ns)
        node.refuses_inbound = True

    def sent_bytes(self) -> dict[str, int]:
        """What all nodes put on their links, per plane, and in all (for a report's bytes and control_bytes)."""
        totals = {"data": 0, "control": 0}
        for node in self.nodes:
            for plane, split in node.class_bytes().items():
                totals[plane] += split["tx"]
        return {**totals, "total": totals["data"] + totals["control"]}

    # -- internals --

    def _new_tag(self) -> str:
        taken = {name[:7] for name in [*_list_netns(), *_list_links(), *(p.name for p in RUN_DIR.iterdir())]}
        while True:
            tag = f"{TAG_PREFIX}{random.getrandbits(16):04x}"
            if tag not in taken:
                return tag

    def _other_labs_subnets(self) -> list[ipaddress.IPv4Network]:
        nets = []
        for path in RUN_DIR.iterdir():
            marker = _read_marker(path.name) if TAG_PATTERN.fullmatch(path.name) else None
            for key in ("data_net", "control_net"):
                if marker and key in marker:
                    nets.append(ipaddress.ip_network(marker[key]))
        return nets

    def _add_bridge(self) -> None:
        _ip_batch([f"link add {self.bridge} type bridge"])
        _disable_ipv6(self.bridge)
        _ip_batch([f"addr add {self.bridge_address}/{self.data_net.prefixlen} dev {self.bridge}",
                   f"addr add {self.control_net.network_address + 1}/{self.control_net.prefixlen} dev {self.bridge}",
                   f"link set {self.bridge} up"])

    def _start_reaper(self) -> None:
        read_end, write_end = os.pipe()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # importable even without an install
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            self._reaper = subprocess.Popen(
                [sys.executable, "-m", "lowcomm.transport.netns", "reap", self.tag, str(read_end)],
                pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, cwd="/", env=env)
        finally:
            os.close(read_end)
        self._reaper_pipe = write_end  # not inheritable: children the owner starts do not keep the reaper waiting

    def _stop_reaper(self) -> None:
        if self._reaper_pipe is not None:
            os.close(self._reaper_pipe)  # EOF: the reaper finds no marker and exits
            self._reaper_pipe = None
        if self._reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5)  # longer only if a fork of the owner still holds the pipe
            self._reaper = None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lowcomm.transport.netns",
                                     description="Remove network namespaces left by lowcomm labs whose owner died.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cleanup", help="remove labs whose owner process is gone")
    reap = sub.add_parser("reap", help=argparse.SUPPRESS)
    reap.add_argument("tag")
    reap.add_argument("fd", type=int)
    args = parser.parse_args(argv)
    if args.command == "reap":
        _reap(args.tag, args.fd)
        return 0
    try:
        removed = cleanup_stale()
    except NetnsUnavailable as error:
        print(f"lowcomm netns: {error}", file=sys.stderr)
        return 2
    print(f"removed {len(removed)} stale lab(s){': ' + ', '.join(removed) if removed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
