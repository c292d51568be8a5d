"""The namespace lab without namespaces: addresses, htb parameters, and the messages when root or
iproute2 is missing (real namespaces: tests/integration/test_netns.py)."""

from __future__ import annotations

import ipaddress
import random

import pytest

from lowcomm.transport import netns
from lowcomm.transport.netns import (BURST_S, FRAME_BYTES, HtbParams, NetnsError, NetnsLab, NetnsUnavailable,
                                     choose_subnets, cleanup_stale)

MBIT = 1e6


# ---- without root ------------------------------------------------------------------------

def test_subnets_avoid_every_host_network():
    used = [ipaddress.ip_network("10.200.0.0/16"), ipaddress.ip_network("10.203.7.0/24"),
            ipaddress.ip_network("192.0.2.0/24")]
    for seed in range(50):
        data, control = choose_subnets(used, random.Random(seed))
        assert data.prefixlen == control.prefixlen == 24 and data != control
        assert not any(net.overlaps(other) for net in (data, control) for other in used)
        assert data.is_private and control.is_private


def test_no_free_subnet_is_an_error():
    with pytest.raises(NetnsError, match="no free pair"):
        choose_subnets([ipaddress.ip_network("10.0.0.0/8")])


def test_htb_burst_is_10ms_and_at_least_two_frames():
    fast = HtbParams.for_rate(100 * MBIT)
    assert fast.burst_bytes == int(100 * MBIT / 8 * BURST_S) and fast.queue_frames == 825
    slow = HtbParams.for_rate(64_000)
    assert slow.burst_bytes == 2 * FRAME_BYTES and slow.queue_frames == 16
    assert HtbParams.for_rate(10e9).queue_frames == 1000


def test_not_root_says_what_to_do(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    for attempt in (lambda: NetnsLab().open(), cleanup_stale):
        with pytest.raises(NetnsUnavailable) as info:
            attempt()
        assert "root (sudo)" in str(info.value) and "drop --netns" in str(info.value) and "--link" in str(info.value)


def test_missing_iproute2_says_what_to_do(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(NetnsUnavailable, match="install iproute2"):
        NetnsLab().open()
