"""Checks a command runs before it joins the DHT or writes anything, so a mistake costs a second, not a minute.

Each check raises ConfigError with one line that names the option and says what to do.
"""

from __future__ import annotations

import socket

from hivemind.utils.multiaddr import Multiaddr

from lowcomm.config import ConfigError
from lowcomm.runtime.checkpoint import CheckpointError, load_checkpoint
from lowcomm.runtime.options import PeerOptions
from lowcomm.runtime.trainer import resolve_device
from lowcomm.transport.addresses import is_host, split_announce
from lowcomm.transport.identity import public_key_from_text


def check_multiaddrs(addresses: list[str], flag: str = "--coordinator") -> None:
    for text in addresses:
        try:
            maddr = Multiaddr(text)
        except Exception as e:  # the parser raises several of its own types
            raise ConfigError(f"{flag} {text!r} is not a multiaddr ({e}); copy it from the coordinator's "
                              "join command, e.g. /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...") from None
        if "/p2p/" not in str(maddr):
            raise ConfigError(f"{flag} {text!r} names no peer (/p2p/...); copy the whole multiaddr from the "
                              "coordinator's join command")


def check_run_key(text: str) -> None:
    try:
        public_key_from_text(text)
    except ValueError:
        raise ConfigError("--run-key is not the coordinator's public key; copy it (AAAA...) from the "
                          "coordinator's join command") from None


def check_device(device: str) -> None:
    """The device the peer will train on exists here (runtime.trainer.resolve_device says how it is picked)."""
    resolve_device(device)


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """A fixed TCP port another process already listens on is refused (0: a free one is picked later)."""
    if port == 0:
        return
    if not 0 < port < 65536:
        raise ConfigError(f"{flag} {port} is not a TCP port (1-65535, or 0 for any free one)")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the servers bind: a port left in TIME_WAIT by the last run's connections is free, a listener is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"{flag} {port} on {host} is not free ({e.strerror}); stop what uses it or "
                              "pick another port") from None


def check_host(text: str | None, flag: str = "--host") -> None:
    if text is not None and not is_host(text):
        raise ConfigError(f"{flag} {text!r} is not an IP address or a hostname; give one without a scheme, "
                          "a port or spaces")


def check_announce(text: str | None) -> None:
    if text is None:
        return
    try:
        split_announce(text)
    except ValueError as e:
        raise ConfigError(f"--announce-addr {e}") from None


def check_ports(host: str, port: int, dht_host: str | None, dht_port: int) -> None:
    """The data plane's and the DHT's fixed ports: free, and not the same one."""
    check_port_free(host, port)
    check_port_free(dht_host or host, dht_port, "--dht-port")
    if port and port == dht_port:
        raise ConfigError(f"--port and --dht-port are both {port}; give the DHT another port")


def check_peer(options: PeerOptions) -> None:
    check_multiaddrs(options.coordinator)
    check_run_key(options.run_key)
    check_device(options.device)  # options.check has checked --announce-addr
    check_ports(options.host, options.port, options.dht_host, options.dht_port)
    if options.metrics_port is not None:
        check_port_free(options.metrics_host, options.metrics_port, "--metrics-port")


def check_dashboard(args) -> None:
    """--dashboard-host and --dashboard-port of coordinator start, observe and simulate, before anything starts."""
    if args.dashboard_port is not None:
        check_host(args.dashboard_host, "--dashboard-host")
        check_port_free(args.dashboard_host, args.dashboard_port, "--dashboard-port")


def check_coordinator(args) -> None:
    """`coordinator start`'s arguments: the addresses and ports, and the --resume folder."""
    check_host(args.host)
    check_host(args.dht_host, "--dht-host")
    check_announce(args.announce_addr)
    check_ports(args.host, args.port, args.dht_host, args.dht_port)
    check_dashboard(args)
    if args.resume is not None:
        try:
            load_checkpoint(args.resume)
        except CheckpointError as e:
            raise ConfigError(f"--resume: {e}") from None
