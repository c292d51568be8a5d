"""Which address a node announces for each plane: what others dial, never the wildcard it listens on.

A node listens on `host` (0.0.0.0 by default: every interface). Others cannot dial 0.0.0.0, so the
gRPC endpoint and the DHT's multiaddrs carry an address of this machine instead:

- the host of `--announce-addr HOST[:PORT]` when given (a public address behind NAT with a
  forwarded port, a proxy); a PORT there is the gRPC one, the DHT keeps its own port;
- else `host` itself when it names one address;
- else this machine's primary outbound IPv4 address: the source address the kernel picks for a
  route to the internet (a UDP socket's connect sends nothing), then the first non-loopback
  interface address, and 127.0.0.1 only as a last resort, with a warning (only this machine can
  dial it).

The DHT (p2pd) announces exactly one multiaddr, /ip4/ADDRESS/tcp/PORT, so its port must be known
before it starts: `--dht-port`, or a free one picked here.

A host (of `--host`, `--announce-addr`, an endpoint) is an IP address or a hostname, nothing else:
no scheme, no path, no spaces; an IPv6 address takes brackets before a port (`[2001:db8::1]:31400`).
A port is ASCII digits only (Python's int() also reads other scripts' digits: `١` is 1).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import re
import socket
import struct

logger = logging.getLogger(__name__)
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
ROUTE_PROBE = ("8.8.8.8", 53)  # any internet address: connect() on a UDP socket only picks a route
LOOPBACK = "127.0.0.1"
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def is_wildcard(host: str | None) -> bool:
    return host is None or host.strip() in WILDCARDS


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address (IPv6 with or without brackets), None when it is not one."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(bare)
    except ValueError:
        return None


def is_host(host: str) -> bool:
    """An IP address or a hostname: no scheme, no path, no port, no spaces."""
    return ip_of(host) is not None or HOSTNAME.match(host) is not None


def split_announce(text: str) -> tuple[str, int | None]:
    """`HOST` or `HOST:PORT` (IPv6 as `[ADDR]:PORT`); ValueError with what is expected otherwise."""
    text = text.strip()
    host, port, bracketed = text, None, text.startswith("[")
    if bracketed:
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (None if not rest else "x")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    if (not host or is_wildcard(host) or not is_host(host) or (bracketed and ip_of(host) is None)
            or (port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536))):
        raise ValueError(f"{text!r} is not HOST or HOST:PORT, an IP address or hostname others can dial with a "
                         "port in 1-65535")
    return host, int(port) if port is not None else None


def split_endpoint(text: str) -> tuple[str, int]:
    """`HOST:PORT` exactly (IPv6 as `[ADDR]:PORT`): no scheme, no path, a port in 1-65535; the host
    unbracketed. ValueError otherwise."""
    host, port = split_announce(text) if text == text.strip() else ("", None)
    if port is None:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, port


def join_host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 address in brackets."""
    host = host.strip()
    bracketed = ":" in host and not host.startswith("[")
    return f"[{host}]:{port}" if bracketed else f"{host}:{port}"


def route_source() -> str | None:
    """The source address of this machine's route to the internet, or None without such a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(ROUTE_PROBE)
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback or address == "0.0.0.0" else address


def interface_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces, loopback left out (Linux: one ioctl each)."""
    found = []
    try:
        import fcntl
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        names = []
    for name in names:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            found.append(socket.inet_ntoa(packed[20:24]))
        except OSError:  # no IPv4 address on this interface
            continue
    if not found:
        try:
            found = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
        except OSError:
            pass
    return [a for a in dict.fromkeys(found) if not ipaddress.ip_address(a).is_loopback]


@functools.lru_cache(maxsize=1)
def primary_ipv4() -> str:
    """This machine's address for others to dial: the internet route's source, else the first
    interface address, else 127.0.0.1 with a warning."""
    address = route_source() or next(iter(interface_addresses()), None)
    if address is None:
        logger.warning("this machine has no IPv4 address but loopback: announcing %s, which only this machine "
                       "can dial; pass --announce-addr with an address the other machines reach", LOOPBACK)
        return LOOPBACK
    return address


def announce_host(listen_host: str, announce: str | None = None) -> str:
    """The host others dial: --announce-addr's, else `listen_host` when it names one address, else the
    primary address."""
    if announce:
        return split_announce(announce)[0]
    return primary_ipv4() if is_wildcard(listen_host) else listen_host


def grpc_endpoint(listen_host: str, port: int, announce: str | None = None) -> str:
    """`host:port` for the gRPC data plane: the announced host, and the announced port if one was given."""
    announced_port = split_announce(announce)[1] if announce else None
    return join_host_port(announce_host(listen_host, announce), announced_port or port)


def maddr(host: str, port: int) -> str:
    """A TCP multiaddr for `host` (an IPv4 or IPv6 address, or a DNS name)."""
    try:
        version = ipaddress.ip_address(host.strip("[]")).version
        return f"/ip{version}/{host.strip('[]')}/tcp/{port}"
    except ValueError:
        return f"/dns/{host}/tcp/{port}"


def free_port(host: str) -> int:
    """A TCP port nobody listens on at `host` at the time of the call (the DHT binds it right after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]") if not is_wildcard(host) else "", 0))
        return s.getsockname()[1]


def dht_maddrs(listen_host: str, port: int, announce: str | None = None) -> tuple[list[str], list[str] | None]:
    """(listen multiaddrs, announce multiaddrs) for the DHT. Listening on one named address with
    nothing to announce, p2pd announces that address itself (None); otherwise it announces the one
    address others dial, so the port is fixed first."""
    if announce is None and not is_wildcard(listen_host):
        return [maddr(listen_host, port)], None
    port = port or free_port(listen_host)
    listen = maddr("0.0.0.0" if is_wildcard(listen_host) else listen_host, port)
    return [listen], [maddr(announce_host(listen_host, announce), port)]
