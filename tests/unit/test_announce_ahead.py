"""Announcing the next round ahead: a peer still training towards round R is a member of R's manifest,
its contribution awaited until the reduce deadline, but it owns no shard (it may be far behind, or
gone). Unit cases on ManifestAgreement over an in-memory control plane (the run of real peers is in
tests/integration/test_announce_ahead_e2e.py)."""

from __future__ import annotations


from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.transport.control import PeerRecord

GROUP, ROUND = "0-0", 4


class MemoryControl:
    """The parts of the control plane a manifest agreement reads and writes, held in one dict (the DHT)."""

    def __init__(self, me: str, store: dict, live: dict[str, str]):
        self.run, self.store, self.live = "run", store, live
        self.identity = type("Identity", (), {"peer_id": me})()
        self.polls = 0

    def record(self, info):
        return {"peer_id": self.identity.peer_id, **info}

    def manifest_record(self, manifest):
        return manifest

    def announce(self, group, round_, info, ttl):
        self.store.setdefault(("announce", group, round_), {})[self.identity.peer_id] = dict(info)

    def announcers(self, group, round_):
        self.polls += 1
        found = self.store.get(("announce", group, round_), {})
        return {p: dict(v) for p, v in found.items() if not v.get("gone")}

    def live_peers(self):
        return {p: PeerRecord(p, f"{p}:1", state=state, round=ROUND) for p, state in self.live.items()}

    def publish_manifest(self, group, round_, manifest, ttl):
        self.store.setdefault(("manifest", group, round_), {})[self.identity.peer_id] = manifest

    def manifests(self, group, round_):
        return dict(self.store.get(("manifest", group, round_), {}))


def agreement(me: str, store: dict, live: dict[str, str], announce_s: float = 0.3):
    sync = SyncConfig(announce_s=announce_s, manifest_s=0.3)
    control = MemoryControl(me, store, live)
    return ManifestAgreement(control, sync, f"{me}:1"), control


def test_a_peer_announced_only_ahead_is_a_member_without_a_shard_and_never_the_leader():
    store, live = {}, {"a": "training", "b": "training", "c": "training"}
    for peer in ("a", "c"):  # a (the smallest id) and c are still training towards the round
        agreement(peer, store, live)[0].announce(GROUP, ROUND, ahead=True)
    b, control = agreement("b", store, live)
    timeouts = []
    b.on_event = lambda kind, **fields: timeouts.append(fields)
    manifest = b.agree(GROUP, ROUND, 1, "uint8")
    assert manifest.members == ["a", "b", "c"]
    assert manifest.owners == ["b"]  # the one member that reached the round
    assert manifest.leader == "b"  # a, announced only ahead, is no candidate leader
    assert control.polls > 2  # b waited out announce_s for a and c to reach the round
    assert timeouts == []  # nobody was left out: everyone due had announced


def test_members_that_reached_the_round_own_shards_and_the_gather_ends_at_once():
    store, live = {}, {"a": "training", "b": "training", "c": "training"}
    for peer in ("a", "c"):
        ahead = agreement(peer, store, live)[0]
        ahead.announce(GROUP, ROUND, ahead=True)
        ahead.announce(GROUP, ROUND)  # ... and then reached the round: the newer announcement counts
    b, control = agreement("b", store, live, announce_s=600.0)
    b.agree(GROUP, ROUND, 1, "uint8")  # a never writes one: b, next in line, does after manifest_s
    manifest = b.read(GROUP, ROUND)
    assert manifest.members == manifest.owners == ["a", "b", "c"]
    assert control.polls <= 3  # everyone due had reached the round: no wait for announce_s (600 s)


def test_a_written_manifest_ends_the_wait_for_peers_announced_ahead():
    store, live = {}, {"a": "training", "b": "training", "c": "training"}
    a, _ = agreement("a", store, live)
    agreement("c", store, live)[0].announce(GROUP, ROUND, ahead=True)
    b, control = agreement("b", store, live, announce_s=600.0)
    b.announce(GROUP, ROUND)
    a.announce(GROUP, ROUND)
    a._publish(GROUP, ROUND, 1, "uint8", a.control.announcers(GROUP, ROUND), 60.0)
    manifest = b.agree(GROUP, ROUND, 1, "uint8")
    assert manifest.leader == "a" and manifest.members == ["a", "b", "c"] and manifest.owners == ["a", "b"]
    assert control.polls <= 3  # c still training did not hold b for announce_s (600 s)


def test_a_withdrawn_announcement_is_not_a_member():
    store, live = {}, {"a": "leaving", "b": "training", "c": "training"}
    leaver, _ = agreement("a", store, live)
    leaver.announce(GROUP, ROUND, ahead=True)
    leaver.withdraw(GROUP, ROUND)
    agreement("c", store, live)[0].announce(GROUP, ROUND)
    manifest = agreement("b", store, live)[0].agree(GROUP, ROUND, 1, "uint8")
    assert manifest.members == manifest.owners == ["b", "c"]
