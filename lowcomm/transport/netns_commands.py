"""The commands a netns lab is made of: `ip` and `tc` runs, subnets, htb classes and their byte counters.

Part of transport.netns (the lab); see its docstring for the whole.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RUN_DIR = Path("/run/lowcomm-netns")  # markers and the lock; /run is emptied at boot, as namespaces are
NETNS_DIR = Path("/run/netns")  # where `ip netns add` mounts namespaces
TAG_PREFIX = "lcn"
TAG_PATTERN = re.compile(r"lcn[0-9a-f]{4}")
NODE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
MAX_NODES = 253  # .2 to .254 of a /24
BURST_S = 0.010
BUFFER_S = 0.100
FRAME_BYTES = 1514  # a full Ethernet frame: 1500 bytes of MTU and a 14-byte header
UNCAPPED_BITS = 10e9  # "no cap": htb still classifies and counts
COMMAND_TIMEOUT_S = 30.0
KILL_TIMEOUT_S = 10.0
LOCK_TIMEOUT_S = 60.0
WHAT_TO_DO = "run as root (sudo) or drop --netns to use the application shaper (--link)"
DATA_CLASS, CONTROL_CLASS, REFUSED_CLASS = "1:10", "1:20", "1:30"


class NetnsError(RuntimeError):
    """A command that builds or removes a lab failed; the message has the command and its output."""


class NetnsUnavailable(NetnsError):
    """Namespaces cannot be made here (not root, no iproute2, no htb); the message says what to do."""


def unavailable_reason() -> str | None:
    """Why NetnsLab cannot run here, as a sentence that says what to do; None where it can (probably)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform}): drop --netns to use the application " \
               f"shaper (--link)"
    if os.geteuid() != 0:
        return f"network namespaces and tc need root (this process runs as uid {os.geteuid()}): {WHAT_TO_DO}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found on PATH: install iproute2, or drop --netns to use the " \
               f"application shaper (--link)"
    return None


# ---- commands --------------------------------------------------------------------------------

NEIGH_SYSCTL = Path("/proc/sys/net/ipv4/neigh/default")


def neighbour_entries(nodes: int) -> int:
    """The IPv4 neighbour entries a lab of `nodes` can hold at once: in each node one per other node on
    each plane, and the bridge's two addresses; in the root namespace the bridge's one per node and plane."""
    return nodes * (2 * (nodes - 1) + 2) + 2 * nodes


def fit_neighbour_table(nodes: int) -> None:
    """Raises the kernel's ARP table limits to hold a lab of `nodes`, if they are lower; never lowers them.

    The table and its gc_thresh limits are one for the whole host, every namespace's entries counted
    together (only the root namespace can set them). Past gc_thresh3 (1024 by default: a lab of 22
    nodes) the kernel logs "neighbor table overflow" and drops the packets of a connection it cannot
    resolve, so at 32 nodes connections failed with "No route to host" or timed out."""
    need = neighbour_entries(nodes)
    for name, level in (("gc_thresh2", need), ("gc_thresh3", need * 2)):
        path = NEIGH_SYSCTL / name
        try:
            if int(path.read_text()) < level:
                path.write_text(f"{level}\n")
                logger.info("raised net.ipv4.neigh.default.%s to %d for a lab of %d nodes", name, level, nodes)
        except (OSError, ValueError) as error:
            raise NetnsError(f"cannot raise {path} to {level} for a lab of {nodes} nodes ({error}): run "
                             f"`sysctl -w net.ipv4.neigh.default.{name}={level}` as root, or simulate fewer "
                             f"peers") from None


def _run(args: list[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError as error:
        raise NetnsUnavailable(f"{args[0]} not found: install iproute2, or {WHAT_TO_DO}") from error
    except subprocess.TimeoutExpired as error:
        raise NetnsError(f"`{' '.join(args)}` did not finish in {COMMAND_TIMEOUT_S:.0f}s") from error
    if check and done.returncode != 0:
        output = (done.stderr.strip() or done.stdout.strip()).replace("\n", "; ")
        text = f"`{' '.join(args)}` failed with code {done.returncode}: {output}"
        if stdin:
            text += f" (commands: {stdin.strip()!r})"
        if "Operation not permitted" in output:
            raise NetnsUnavailable(f"{text}; this process may not create network devices: {WHAT_TO_DO}")
        if "qdisc kind is unknown" in output or "Unknown qdisc" in output:
            raise NetnsUnavailable(f"{text}; the kernel has no htb qdisc (sch_htb): load it (modprobe sch_htb) "
                                   f"or drop --netns to use the application shaper (--link)")
        raise NetnsError(text)
    return done


def _ip_batch(lines: list[str], netns: str | None = None) -> None:
    _run(["ip", *(["-n", netns] if netns else []), "-batch", "-"], stdin="\n".join(lines) + "\n")


def _tc_batch(lines: list[str], netns: str | None = None) -> None:
    _run(["tc", *(["-n", netns] if netns else []), "-batch", "-"], stdin="\n".join(lines) + "\n")


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _list_links() -> list[str]:
    return [link["ifname"] for link in json.loads(_run(["ip", "-j", "link", "show"]).stdout or "[]")]


def _disable_ipv6(interface: str) -> None:
    """Before the link goes up, so it sends no router solicitations or MLD reports (absent IPv6: nothing to do)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{interface}/disable_ipv6").write_text("1")


# ---- addresses -------------------------------------------------------------------------------

def host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has an address in or a route to (any table), default routes aside."""
    networks = []
    for link in json.loads(_run(["ip", "-4", "-j", "addr", "show"]).stdout or "[]"):
        for info in link.get("addr_info", []):
            networks.append(ipaddress.ip_interface(f"{info['local']}/{info['prefixlen']}").network)
    for route in json.loads(_run(["ip", "-4", "-j", "route", "show", "table", "all"]).stdout or "[]"):
        with contextlib.suppress(ValueError):
            if route.get("dst", "default") != "default":
                networks.append(ipaddress.ip_network(route["dst"], strict=False))
    return networks


def choose_subnets(used: list[ipaddress.IPv4Network],
                   rng: random.Random | None = None) -> tuple[ipaddress.IPv4Network, ipaddress.IPv4Network]:
    """A free (data, control) pair of /24s: 10.{2j+200}.k.0/24 and 10.{2j+201}.k.0/24, picked at random."""
    candidates = list(range(28 * 256))
    (rng or random.Random()).shuffle(candidates)
    for candidate in candidates:
        j, k = divmod(candidate, 256)
        pair = ipaddress.ip_network(f"10.{200 + 2 * j}.{k}.0/24"), ipaddress.ip_network(f"10.{201 + 2 * j}.{k}.0/24")
        if not any(net.overlaps(other) for net in pair for other in used):
            return pair
    raise NetnsError("no free pair of /24s in 10.200.0.0-10.255.255.255 for a lab: the host's addresses and "
                     "routes cover them all")


# ---- the htb tree --------------------------------------------------------------------------

@dataclass(frozen=True)
class HtbParams:
    rate_bits: int
    burst_bytes: int  # for the rate and the ceil
    queue_frames: int  # each leaf's pfifo limit

    @classmethod
    def for_rate(cls, rate_bits: float) -> "HtbParams":
        burst = max(int(rate_bits / 8 * BURST_S), 2 * FRAME_BYTES)
        queue = min(max(int(rate_bits / 8 * BUFFER_S / FRAME_BYTES), 16), 1000)
        return cls(int(rate_bits), burst, queue)


def _htb_commands(device: str, params: HtbParams, control_net: ipaddress.IPv4Network, new: bool) -> list[str]:
    verb = "add" if new else "change"
    r, half, b = params.rate_bits, max(params.rate_bits // 2, 1), params.burst_bytes
    lines = [f"qdisc add dev {device} root handle 1: htb default 10"] if new else []
    lines += [f"class {verb} dev {device} parent 1: classid 1:1 htb rate {r}bit ceil {r}bit burst {b} cburst {b}"]
    for leaf in (DATA_CLASS, CONTROL_CLASS):
        # quantum: one full frame per DRR turn, so the leaves interleave frame by frame when both borrow
        lines.append(f"class {verb} dev {device} parent 1:1 classid {leaf} htb rate {half}bit ceil {r}bit "
                     f"burst {b} cburst {b} quantum {FRAME_BYTES}")
        handle = leaf.split(":")[1]
        lines.append(f"qdisc {'add' if new else 'change'} dev {device} parent {leaf} handle {handle}: pfifo "
                     f"limit {params.queue_frames}")
    if new:
        for field_name in ("src", "dst"):
            # prio 2: a node's refusal of inbound connections (prio 1) is matched first
            lines.append(f"filter add dev {device} parent 1: protocol ip prio 2 u32 match ip {field_name} "
                         f"{control_net} flowid {CONTROL_CLASS}")
    return lines


def _refusal_commands(device: str) -> list[str]:
    """Drops every TCP SYN-ACK `device` sends: nobody completes a connection to the node, while the
    connections it opens itself (it sends the SYN, receives the SYN-ACK) work. A stateless firewall
    with no open port, or a NAT without forwarding, as others see it; tc alone, since the kernel here
    may have no netfilter and no tc actions. Matches IPv4 headers without options (20 bytes), so the
    TCP flags are at byte 33; the class's pfifo holds 0 packets, so all it gets is dropped."""
    return [f"class add dev {device} parent 1:1 classid {REFUSED_CLASS} htb rate 8kbit ceil 8kbit",
            f"qdisc add dev {device} parent {REFUSED_CLASS} handle 30: pfifo limit 0",
            f"filter add dev {device} parent 1: protocol ip prio 1 u32 match u8 0x45 0xff at 0 "
            f"match ip protocol 6 0xff match u8 0x12 0x12 at 33 flowid {REFUSED_CLASS}"]


_CLASS_STATS = re.compile(r"^class htb (\d+:\d+) [^\n]*\n\s*Sent (\d+) bytes (\d+) pkt", re.M)


def _class_bytes(device: str, netns: str | None = None) -> dict[str, int]:
    # `tc -j` prints no JSON for htb classes in iproute2 6.1, so the text is read
    text = _run(["tc", *(["-n", netns] if netns else []), "-s", "class", "show", "dev", device]).stdout
    sent = {handle: int(nbytes) for handle, nbytes, _ in _CLASS_STATS.findall(text)}
    return {"data": sent.get(DATA_CLASS, 0), "control": sent.get(CONTROL_CLASS, 0)}
