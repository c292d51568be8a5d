"""The address each plane announces (transport.addresses): never the wildcard, --announce-addr first,
the primary address's fallbacks, the DHT's announce multiaddrs; and the flags that set them."""

from __future__ import annotations

import logging
import socket

import pytest

from lowcomm.cli import main
from lowcomm.transport import addresses
from lowcomm.transport.addresses import (announce_host, dht_maddrs, grpc_endpoint, is_host, is_wildcard,
                                         join_host_port, maddr, primary_ipv4, split_announce, split_endpoint)
from lowcomm.transport.identity import Identity

MADDR = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.fixture
def machine(monkeypatch):
    """A machine whose route and interfaces the test sets: {"route": ..., "interfaces": [...]}."""
    found = {"route": "198.51.100.7", "interfaces": ["10.0.0.5", "192.168.1.9"]}
    monkeypatch.setattr(addresses, "route_source", lambda: found["route"])
    monkeypatch.setattr(addresses, "interface_addresses", lambda: list(found["interfaces"]))
    primary_ipv4.cache_clear()
    yield found
    primary_ipv4.cache_clear()


def test_wildcards():
    assert all(is_wildcard(h) for h in (None, "", "0.0.0.0", "::", "[::]"))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "10.0.0.1", "example.org"))


@pytest.mark.parametrize("text, parsed", [
    ("203.0.113.7", ("203.0.113.7", None)), ("203.0.113.7:31400", ("203.0.113.7", 31400)),
    ("peer.example.org:5", ("peer.example.org", 5)), ("[2001:db8::1]:31400", ("2001:db8::1", 31400)),
    ("[2001:db8::1]", ("2001:db8::1", None)), ("2001:db8::1", ("2001:db8::1", None))])
def test_announce_addresses_that_parse(text, parsed):
    assert split_announce(text) == parsed


@pytest.mark.parametrize("text", ["", "0.0.0.0", "0.0.0.0:31400", "host:0", "host:70000", "host:port", ":31400",
                                  "[::1]x", "http://host", "unix:/tmp/x", "my host:5", "host/path:5", "[not-ip]:5"])
def test_announce_addresses_refused(text):
    with pytest.raises(ValueError, match="HOST or HOST:PORT"):
        split_announce(text)


@pytest.mark.parametrize("host, ok", [
    ("10.0.0.1", True), ("0.0.0.0", True), ("::", True), ("[::]", True), ("2001:db8::1", True), ("localhost", True),
    ("peer.example.org", True), ("peer.example.org.", True), ("", False), ("http://host", False),
    ("host:5", False), ("my host", False), ("host/path", False), ("-host", False), ("unix:/tmp/x", False)])
def test_hosts(host, ok):
    assert is_host(host) is ok


def test_endpoints_are_host_and_port_exactly():
    assert split_endpoint("10.0.0.1:5") == ("10.0.0.1", 5)
    assert split_endpoint("[2001:db8::1]:5") == ("2001:db8::1", 5)
    for text in ("10.0.0.1", "2001:db8::1:5", "unix:/tmp/x", "dns:///10.0.0.1:5", "ipv4:10.0.0.1:5", " 10.0.0.1:5"):
        with pytest.raises(ValueError):
            split_endpoint(text)


def test_ipv6_hosts_keep_their_brackets_before_a_port(machine):
    assert join_host_port("::1", 7) == "[::1]:7" and join_host_port("[::1]", 7) == "[::1]:7"
    assert grpc_endpoint("0.0.0.0", 5, "[::1]:7") == "[::1]:7"
    assert grpc_endpoint("0.0.0.0", 5, "2001:db8::1") == "[2001:db8::1]:5"
    assert grpc_endpoint("::1", 5) == "[::1]:5"
    assert split_endpoint(grpc_endpoint("0.0.0.0", 5, "[::1]:7")) == ("::1", 7)


def test_the_primary_address_is_the_internet_routes_source(machine):
    assert primary_ipv4() == "198.51.100.7"


def test_without_a_route_the_first_interface_address(machine):
    machine["route"] = None
    assert primary_ipv4() == "10.0.0.5"


def test_loopback_only_as_a_last_resort_with_a_warning(machine, caplog):
    machine["route"], machine["interfaces"] = None, []
    with caplog.at_level(logging.WARNING, logger=addresses.__name__):
        assert primary_ipv4() == "127.0.0.1"
    assert "--announce-addr" in caplog.text


def test_this_machines_route_source_is_never_a_wildcard_or_loopback():
    source = addresses.route_source()
    assert source is None or not (is_wildcard(source) or source.startswith("127."))
    assert all(not a.startswith("127.") for a in addresses.interface_addresses())


def test_the_host_others_dial(machine):
    assert announce_host("0.0.0.0") == "198.51.100.7"  # never the wildcard
    assert announce_host("10.0.0.5") == "10.0.0.5"  # one named address: itself
    assert announce_host("0.0.0.0", "203.0.113.7:31400") == "203.0.113.7"  # --announce-addr first
    assert announce_host("10.0.0.5", "203.0.113.7") == "203.0.113.7"


def test_the_grpc_endpoint(machine):
    assert grpc_endpoint("0.0.0.0", 31400) == "198.51.100.7:31400"
    assert grpc_endpoint("127.0.0.1", 5000) == "127.0.0.1:5000"
    assert grpc_endpoint("0.0.0.0", 31400, "203.0.113.7") == "203.0.113.7:31400"  # the listening port
    assert grpc_endpoint("0.0.0.0", 31400, "203.0.113.7:41400") == "203.0.113.7:41400"  # a forwarded one


def test_multiaddrs():
    assert maddr("10.0.0.1", 5) == "/ip4/10.0.0.1/tcp/5"
    assert maddr("2001:db8::1", 5) == "/ip6/2001:db8::1/tcp/5"
    assert maddr("peer.example.org", 5) == "/dns/peer.example.org/tcp/5"


def test_one_named_address_announces_itself():
    assert dht_maddrs("127.0.0.1", 0) == (["/ip4/127.0.0.1/tcp/0"], None)
    assert dht_maddrs("10.0.0.5", 31401) == (["/ip4/10.0.0.5/tcp/31401"], None)


def test_the_wildcard_announces_the_primary_address_on_a_fixed_port(machine):
    assert dht_maddrs("0.0.0.0", 31401) == (["/ip4/0.0.0.0/tcp/31401"], ["/ip4/198.51.100.7/tcp/31401"])
    listen, announce = dht_maddrs("0.0.0.0", 0)
    port = int(listen[0].rsplit("/", 1)[1])
    assert 0 < port < 65536 and announce == [f"/ip4/198.51.100.7/tcp/{port}"]  # p2pd refuses port 0 there


def test_announce_addr_sets_the_dht_host_not_its_port(machine):
    assert dht_maddrs("0.0.0.0", 31401, "203.0.113.7:31400") == (["/ip4/0.0.0.0/tcp/31401"],
                                                                  ["/ip4/203.0.113.7/tcp/31401"])
    assert dht_maddrs("10.0.0.5", 31401, "203.0.113.7") == (["/ip4/10.0.0.5/tcp/31401"],
                                                             ["/ip4/203.0.113.7/tcp/31401"])


# ---- the command line --------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_key() -> str:
    return Identity.generate().public_key_text


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_an_announce_addr_nobody_can_dial_is_refused(capsys, run_key, tmp_path):
    assert main(["peer", "join", "--coordinator", MADDR, "--run-key", run_key, "--announce-addr", "0.0.0.0"]) == 2
    assert "announce_addr = '0.0.0.0': must be HOST or HOST:PORT" in one_line_error(capsys)
    run_dir = tmp_path / "coordinator"
    assert main(["coordinator", "start", "--run-dir", str(run_dir), "--announce-addr", "host:0"]) == 2
    assert one_line_error(capsys).startswith("lowcomm: --announce-addr 'host:0' is not HOST or HOST:PORT")
    assert not run_dir.exists()


def test_a_host_that_is_no_address_is_refused(capsys, run_key, tmp_path):
    assert main(["peer", "join", "--coordinator", MADDR, "--run-key", run_key, "--host", "http://10.0.0.1"]) == 2
    assert "host = 'http://10.0.0.1': must be an IP address or a hostname" in one_line_error(capsys)
    assert main(["peer", "join", "--coordinator", MADDR, "--run-key", run_key, "--dht-host", "a b"]) == 2
    assert "dht_host = 'a b': must be an IP address or a hostname" in one_line_error(capsys)
    run_dir = tmp_path / "coordinator"
    assert main(["coordinator", "start", "--run-dir", str(run_dir), "--host", "10.0.0.1:5"]) == 2
    assert one_line_error(capsys).startswith("lowcomm: --host '10.0.0.1:5' is not an IP address or a hostname")
    assert main(["coordinator", "start", "--run-dir", str(run_dir), "--announce-addr", "http://x"]) == 2
    assert one_line_error(capsys).startswith("lowcomm: --announce-addr 'http://x' is not HOST or HOST:PORT")
    assert not run_dir.exists()


def test_a_dht_port_in_use_or_shared_with_the_data_plane_is_refused(capsys, run_key, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["peer", "join", "--coordinator", MADDR, "--run-key", run_key, "--dht-port", str(port)]) == 2
        assert f"--dht-port {port} on 0.0.0.0 is not free" in one_line_error(capsys)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    run_dir = tmp_path / "coordinator"
    assert main(["coordinator", "start", "--run-dir", str(run_dir), "--port", str(free), "--dht-port", str(free)]) == 2
    assert "--port and --dht-port are both" in one_line_error(capsys)
    assert not run_dir.exists()
