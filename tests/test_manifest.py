"""The round agreement's DHT reads: it waits for every due peer, and its polls back off."""

from __future__ import annotations

import time
from types import SimpleNamespace

from lowcomm.collectives.manifest import LIVE_PEERS_EVERY_S, POLL_MAX_S, POLL_S, ManifestAgreement
from lowcomm.config import SyncConfig
from lowcomm.transport.control import PeerRecord

PEERS = ["a", "b", "c"]


class CountingControl:
    """A control plane in memory: b and c announce only once ``late_reads`` announcer reads went by."""

    run = "run"

    def __init__(self, late_reads: int):
        self.identity = SimpleNamespace(peer_id="a")
        self.late_reads = late_reads
        self.announcer_reads: list[float] = []
        self.peer_reads = 0
        self.manifest_reads = 0
        self.stored: dict[str, dict] = {}

    def announce(self, group, round_, info, ttl):
        pass

    def announcers(self, group, round_):
        self.announcer_reads.append(time.monotonic())
        present = PEERS if len(self.announcer_reads) > self.late_reads else ["a"]
        return {p: {"endpoint": f"{p}:1"} for p in present}

    def live_peers(self):
        self.peer_reads += 1
        return {p: PeerRecord(peer_id=p, endpoint=f"{p}:1", state="training") for p in PEERS}

    def publish_manifest(self, group, round_, manifest, ttl):
        self.stored[manifest["leader"]] = manifest

    def manifests(self, group, round_):
        self.manifest_reads += 1
        return dict(self.stored)


def test_agreement_waits_for_the_due_peers_with_backed_off_polls():
    control = CountingControl(late_reads=8)
    agreement = ManifestAgreement(control, SyncConfig(announce_s=30.0, manifest_s=30.0), "a:1")
    t0 = time.monotonic()
    manifest = agreement.agree("g", 0, epoch_rounds=1, codec="fp32")
    elapsed = time.monotonic() - t0
    assert manifest.members == PEERS and manifest.leader == "a"  # nobody was left out
    reads = control.announcer_reads[:control.late_reads + 1]  # the wait (the leader reads once more to publish)
    assert len(reads) == control.late_reads + 1
    # each gap is at least the poll's delay (a sleep is never shorter): 50 ms, growing 1.5x to the cap
    delay = POLL_S
    for earlier, later in zip(reads, reads[1:]):
        assert later - earlier >= delay * 0.999
        delay = min(POLL_MAX_S, delay * 1.5)
    assert reads[-1] - reads[-2] >= POLL_MAX_S * 0.999
    # who is due is read once, then at most every LIVE_PEERS_EVERY_S
    assert 1 <= control.peer_reads <= 1 + elapsed / LIVE_PEERS_EVERY_S
