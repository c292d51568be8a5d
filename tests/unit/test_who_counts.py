"""Who counts (docs/round-protocol.md, Decision 25): a manifest only from a member of the previous one,
φ votes only from the last round's contributors, downloaded state only if its φ is the agreed one.

Outsiders are fresh keys with the lowest ids: pre-published manifests naming themselves the only
owner, sybil φ votes, a "training" record serving a state of their own. Everything runs in this
process over an in-memory control plane; the reduce runs over real gRPC on loopback
(test_sharded_reduce's nodes).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load as st_load

from lowcomm.algorithms.base import ReplicaSpec
from lowcomm.algorithms.registry import algorithm
from lowcomm.algorithms.state import tensors_hash
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import Manifest, ManifestAgreement
from lowcomm.config import RunConfig
from lowcomm.models.factory import build_model
from lowcomm.runtime.coordinator import Coordinator
from lowcomm.runtime.progress import Progress
from lowcomm.runtime import round_anchor
from lowcomm.runtime.round_anchor import Anchor, RoundFollower, publish_anchor, read_anchor
from lowcomm.runtime.state_sync import StateSync
from lowcomm.runtime.state_transfer import StateError, encode_state, state_phi_hash
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.wakeups import Wakes
from unit.test_sharded_reduce import KEY, WAIT_S, Board, nodes, payload  # noqa: F401 (nodes: the fixture)

OUTSIDER = "0000000000"  # a fresh key's id below every peer's
SYBILS = [f"000000000{i}" for i in range(1, 5)]
SYNC = SyncConfig(announce_s=0.5, manifest_s=0.3)
NEVER_S = 3600.0  # a turn that never comes within the test


class MemoryControl:
    """The control plane's records in one dict shared by every writer (the DHT), each under its writer."""

    def __init__(self, me: str, store: dict, live: dict[str, PeerRecord], run: str = "run"):
        self.run, self.store, self.live = run, store, live
        self.identity = SimpleNamespace(peer_id=me)

    def _put(self, key, value):
        self.store.setdefault(key, {})[self.identity.peer_id] = value

    def record(self, info):
        return {"peer_id": self.identity.peer_id, **info}

    def manifest_record(self, manifest):
        return manifest

    def announce(self, group, round_, info, ttl):
        self._put(("announce", group, round_), dict(info))

    def announcers(self, group, round_):
        return {p: dict(v) for p, v in self.store.get(("announce", group, round_), {}).items() if not v.get("gone")}

    def live_peers(self):
        return dict(self.live)

    def publish_manifest(self, group, round_, manifest, ttl):
        self._put(("manifest", group, round_), manifest)

    def manifests(self, group, round_):
        return dict(self.store.get(("manifest", group, round_), {}))

    def publish_phi_hash(self, group, round_, phi_hash, ttl):
        self._put(("phi", group, round_), phi_hash)

    def phi_hashes(self, group, round_):
        return dict(self.store.get(("phi", group, round_), {}))

    def publish_anchor(self, group, round_, anchor, ttl):
        self._put(("anchor", group, round_), {"peer_id": self.identity.peer_id, **anchor})

    def anchors(self, group, round_):
        return dict(self.store.get(("anchor", group, round_), {}))


def outsider_manifest(group: str, round_: int, members: list[str]) -> dict:
    """A stranger's manifest for ``round_``: the peers as members, itself the only owner (unreachable)."""
    members = sorted({OUTSIDER, *members})
    endpoints = {p: "127.0.0.1:1" if p == OUTSIDER else f"{p}:1" for p in members}
    return Manifest("run", group, round_, 1, OUTSIDER, members, endpoints, [OUTSIDER], "fp32").to_dict()


def followed(agreement: ManifestAgreement, group: str, round_: int, members: list[str]) -> None:
    """As if ``agreement`` had followed the manifest of ``round_`` with these members."""
    agreement.learn(group, round_, members)


def test_an_outsiders_manifest_for_a_future_round_is_refused_and_a_member_leads():
    store = {}
    ids = ["a", "b", "c"]
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ids}
    events = []
    agreements = [ManifestAgreement(MemoryControl(p, store, live), SYNC, f"{p}:1",
                                    on_event=lambda kind, **f: events.append((kind, f))) for p in ids]
    for agreement in agreements:
        followed(agreement, "0-0", 4, ids)
    MemoryControl(OUTSIDER, store, live).publish_manifest("0-0", 5, outsider_manifest("0-0", 5, ids), 60)
    results = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, agreements[i].agree("0-0", 5, 1, "fp32")))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert all(m is not None and m.leader == "a" and m.owners == ids for m in results)
    assert any(kind == "reject" and f["sender"] == OUTSIDER for kind, f in events)
    assert all(a.refused_writers >= 1 for a in agreements)
    assert agreements[1].read("0-0", 5).leader == "a"  # a reader that knows round 4 agrees


def test_a_newcomer_leads_only_once_every_previous_member_had_its_turn():
    store = {}
    live = {"b": PeerRecord("b", "b:1", state="training", round=5)}
    b = ManifestAgreement(MemoryControl("b", store, live), SYNC, "b:1")
    followed(b, "0-0", 4, ["a", "c"])  # b joined since: every previous member is gone
    manifest = b.agree("0-0", 5, 1, "fp32")  # nobody trusted announced: b's own turn comes at once
    assert manifest.leader == "b" and manifest.members == ["b"]
    assert b.trusted("0-0", 6) == frozenset({"b"})


def test_a_peer_without_a_previous_manifest_follows_the_one_that_has_one():
    """A stage's replica that missed the stage's first round (its stage-mate took it alone) knows no
    previous manifest, and its id is the lower. Once both announced, it leaves the round's manifest to
    its stage-mate, which refuses any writer outside its previous round, and follows it (Decision 46).
    Its own turn comes only after an hour: the stage-mate agrees once it has written or waits."""
    store = {}
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=3) for p in ("a", "b")}
    events, decided, result = [], threading.Event(), []
    b = ManifestAgreement(MemoryControl("b", store, live), SYNC, "b:1",
                          on_event=lambda kind, **f: events.append((kind, f)))
    followed(b, "0-0", 2, ["b"])  # b took round 2 alone; a had no stage yet
    b.announce("0-0", 3)
    control_a = MemoryControl("a", store, live)
    control_a.publish_manifest = lambda *args, write=control_a.publish_manifest: (decided.set(), write(*args))
    a = ManifestAgreement(control_a, SyncConfig(announce_s=0.5, manifest_s=NEVER_S), "a:1",
                          wakes=Wakes.polling(0.01), on_event=lambda kind, **f: events.append((kind, f)))
    a.wakes.wait = lambda *args, wait=a.wakes.wait: (decided.set(), wait(*args))  # not writing: waits for b's
    thread = threading.Thread(target=lambda: result.append(a.agree("0-0", 3, 1, "fp32")), daemon=True)
    thread.start()
    assert decided.wait(WAIT_S)
    mine = b.agree("0-0", 3, 1, "fp32")
    thread.join(WAIT_S)
    assert [(m.leader, m.members) for m in result + [mine]] == [("b", ["a", "b"])] * 2
    assert not any(kind == "reject" for kind, _ in events)
    assert a.trusted("0-0", 4) == b.trusted("0-0", 4) == frozenset({"a", "b"})


def test_a_strangers_claim_to_know_a_previous_manifest_never_counts_toward_the_quorum():
    """The run's first round, with the quorum rule: a stranger announces that it knows a previous
    manifest, so it has the first turn, then withdraws. The peer still writes the round's manifest:
    the claim orders the leaders of that round and nothing else (Decision 46)."""
    store = {}
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=0) for p in ("a", OUTSIDER)}
    stranger = MemoryControl(OUTSIDER, store, live)
    stranger.announce("0-0", 0, {"endpoint": f"{OUTSIDER}:1", "anchored": True}, 60)
    a = ManifestAgreement(MemoryControl("a", store, live), SyncConfig(announce_s=0.5, manifest_s=0.3, record_ttl_s=1.0),
                          "a:1", quorum=True, wakes=Wakes.polling(0.01))
    withdraw = lambda: stranger.announce("0-0", 0, {"endpoint": None, "gone": True}, 60)
    a.wakes.wait = lambda *args, wait=a.wakes.wait: (withdraw(), wait(*args))  # waiting on the stranger's turn
    manifest = a.agree("0-0", 0, 1, "fp32")
    assert (manifest.leader, manifest.members) == ("a", ["a"])


def test_outsider_manifests_leave_the_reduce_and_phi_unchanged(nodes):
    store, members = {}, nodes[:3]
    ids = [n.id for n in members]
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=7) for p in ids}
    board = Board(KEY.run, set(ids))
    reduces = []
    for node in members:
        reduce = node.reduce(board)
        reduce.agreement = ManifestAgreement(MemoryControl(node.id, store, live, KEY.run), SYNC, node.endpoint)
        followed(reduce.agreement, KEY.group, 6, ids)
        reduces.append(reduce)
    for round_ in (7, 8):  # pre-published for the rounds ahead
        MemoryControl(OUTSIDER, store, live).publish_manifest(KEY.group, round_, outsider_manifest(KEY.group, round_, ids),
                                                              60)
    payloads = [payload(i) for i in range(3)]
    expected = sum(payloads) / 3
    for round_ in (7, 8):
        results = [h.result(WAIT_S) for h in [r.start(KEY, round_, p, 1.0) for r, p in zip(reduces, payloads)]]
        for result in results:
            assert result.contributors == ids and result.info["leader"] == ids[0]
            assert result.info["lost_shards"] == []
            torch.testing.assert_close(result.aggregate, expected, rtol=1e-6, atol=1e-6)


# ---- φ votes ---------------------------------------------------------------------------------


class FakeReplica:
    """One global tensor φ = ``phi.w`` (4 floats), as a DiLoCo replica holds it."""

    shared_phi, per_step = True, False

    def __init__(self, value: float = 0.0):
        self.w = torch.full((4,), value)
        self.names = ["w"]
        self.key = SimpleNamespace(group="0-0")
        self.round = 5
        self.collective = SimpleNamespace(end_epoch=lambda key: None)

    def phi_hash(self):
        return tensors_hash([self.w])

    def state_tensors(self):
        return {"phi.w": self.w.clone(), "momentum.w": torch.zeros(4)}

    def expected_shapes(self):
        return {"phi.w": (4,), "momentum.w": (4,)}

    def load_state_tensors(self, tensors):
        self.w = tensors["phi.w"].clone()

    def enter(self, round_, wait_s=0.0):
        self.round = round_
        return True


def state_sync(me: str, store: dict, live: dict, replica=None, agreement=None):
    events = []
    config = RunConfig()
    config.sync.announce_s = 0.5
    ctx = SimpleNamespace(me=me, control=MemoryControl(me, store, live), stop=threading.Event(), config=config,
                          log=SimpleNamespace(event=lambda kind, **f: events.append((kind, f))),
                          service=SimpleNamespace(checkpointer="coord"), options=SimpleNamespace(run_name="run"),
                          channels=None, traffic=None, holder=SimpleNamespace(publish=lambda snapshot: None))
    membership = SimpleNamespace(set=lambda **fields: None)
    return StateSync(ctx, membership, replica or FakeReplica(), Progress(), agreement), events


def test_sybil_votes_from_fresh_keys_trigger_no_resync():
    store, live = {}, {}
    sync, _ = state_sync("me", store, live)
    sync.progress.last_members = sync.progress.last_contributors = frozenset({"a", "b", "me"})
    for peer in ("a", "b", "me"):
        MemoryControl(peer, store, live).publish_phi_hash("0-0", 6, "honest", 60)
    for sybil in SYBILS:
        MemoryControl(sybil, store, live).publish_phi_hash("0-0", 6, "attacker", 60)
    resyncs = []
    sync.resync = lambda reason, sources=None: resyncs.append(sources)
    assert sync.drift_check(6) is False and resyncs == []
    MemoryControl("me", store, live).publish_phi_hash("0-0", 7, "drifted", 60)  # a real drift still resyncs
    for peer in ("a", "b"):
        MemoryControl(peer, store, live).publish_phi_hash("0-0", 7, "honest", 60)
    MemoryControl("c", store, live).publish_phi_hash("0-0", 7, "honest", 60)
    sync.progress.last_contributors = frozenset({"a", "b", "c", "me"})
    assert sync.drift_check(7) is True and resyncs == [["a", "b", "c"]]


def test_the_follower_anchors_the_members_hash_whatever_outsiders_publish():
    store = {}
    ids = ["a", "b", "c"]
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=2) for p in ids}
    coordinator = MemoryControl("coord", store, live)
    follower = RoundFollower(coordinator, ManifestAgreement(coordinator, SYNC, ""), "0-0", settle_s=5.0, ttl=60)
    honest = Manifest("run", "0-0", 0, 1, "a", ids, {p: f"{p}:1" for p in ids}, ids, "fp32").to_dict()
    MemoryControl("a", store, live).publish_manifest("0-0", 0, honest, 60)
    MemoryControl(OUTSIDER, store, live).publish_manifest("0-0", 1, outsider_manifest("0-0", 1, SYBILS), 60)
    MemoryControl("b", store, live).publish_manifest("0-0", 1, {**honest, "round": 1, "leader": "b"}, 60)
    for round_ in (1, 2):
        for peer in ids:
            MemoryControl(peer, store, live).publish_phi_hash("0-0", round_, f"honest-{round_}", 60)
        for sybil in SYBILS:
            MemoryControl(sybil, store, live).publish_phi_hash("0-0", round_, "attacker", 60)
    anchors = follower.tick(2)
    assert [(a.round, a.phi_hash, a.members) for a in anchors] == [(1, "honest-1", tuple(ids)),
                                                                   (2, "honest-2", tuple(ids))]
    assert follower.agreement.refused_writers == 1  # the outsider's manifest of round 1


def test_the_follower_stores_each_anchor_and_the_newest_again_while_a_peer_joins(monkeypatch):
    store = {}
    ids = ["a", "b"]
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=7) for p in ids}
    coordinator = MemoryControl("coord", store, live)
    follower = RoundFollower(coordinator, ManifestAgreement(coordinator, SYNC, ""), "0-0", settle_s=5.0, ttl=60)
    manifest = Manifest("run", "0-0", 0, 1, "a", ids, {p: f"{p}:1" for p in ids}, ids, "fp32").to_dict()
    for round_ in range(7):
        MemoryControl("a", store, live).publish_manifest("0-0", round_, {**manifest, "round": round_}, 60)
    for round_ in range(1, 7):
        for peer in ids:
            MemoryControl(peer, store, live).publish_phi_hash("0-0", round_, f"h{round_}", 60)
    assert [a.round for a in follower.tick(7, set(ids))] == [1, 2, 3, 4, 5, 6]
    assert sorted(key[2] for key in store if key[0] == "anchor") == [1, 2, 3, 4, 5, 6]  # each once settled
    del store[("anchor", "0-0", 6)]  # as if it expired: stored again for a joiner once half its life passed
    follower.tick(7, set(ids), joiners=True)
    assert ("anchor", "0-0", 6) not in store
    later = time.monotonic() + follower.ttl / 2
    monkeypatch.setattr(round_anchor.time, "monotonic", lambda: later)
    follower.tick(7, set(ids), joiners=False)  # nobody joining: nothing stored again
    assert ("anchor", "0-0", 6) not in store
    follower.tick(7, set(ids), joiners=True)
    assert read_anchor(coordinator, "coord", "0-0", 6).phi_hash == "h6"


# ---- downloaded state --------------------------------------------------------------------------


def served(value: float, round_: int, config: RunConfig):
    """A GetState reply (StateChunk's fields) holding φ = ``value``, labelled with an honest φ hash."""
    replica = FakeReplica(value)
    snapshot = encode_state(replica.state_tensors(), round_, 0, config.config_hash(), "claimed")
    return SimpleNamespace(round=round_, tokens=0, config_hash=config.config_hash(), phi_hash="claimed",
                           data=snapshot.blob)


def downloads_by(monkeypatch, download, held=None, **settings) -> None:
    """``fetch`` downloads through ``download`` and probes a source's round as ``held`` (None: no answer, the
    records are current); ``settings``: state_sync's module constants to set."""
    monkeypatch.setattr("lowcomm.runtime.state_sync.held_round", lambda *a, **kw: held)
    monkeypatch.setattr("lowcomm.runtime.state_sync.FETCH_DEADLINE_S", 30.0)
    monkeypatch.setattr("lowcomm.runtime.state_sync.download_state", download)
    for name, value in settings.items():
        monkeypatch.setattr(f"lowcomm.runtime.state_sync.{name}", value)


def test_a_source_whose_state_is_not_the_agreed_phi_is_refused_and_another_used(monkeypatch):
    store = {}
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "bad": PeerRecord("bad", "bad:1", state="training", round=5),
            "good": PeerRecord("good", "good:1", state="training", round=5)}  # both serve round 6 next
    agreement = ManifestAgreement(MemoryControl("me", store, live), SYNC, "me:1")
    sync, events = state_sync("me", store, live, agreement=agreement)
    publish_anchor(MemoryControl("coord", store, live), "0-0", Anchor(6, FakeReplica(1.0).phi_hash(), ("a", "good")),
                   60)
    values = {"bad:1": 666.0, "good:1": 1.0}
    downloads_by(monkeypatch, lambda channels, traffic, endpoint, *a, **kw: served(values[endpoint], 6, sync.config))
    assert sync.fetch(min_round=6, prefer=["bad"])
    assert torch.equal(sync.replica.w, torch.full((4,), 1.0))
    kinds = [(kind, f.get("source") or f.get("sender")) for kind, f in events]
    assert ("reject", "bad") in kinds and ("state_received", "good") in kinds
    assert ("state_received", "bad") not in kinds
    assert agreement.trusted("0-0", 6) == frozenset({"a", "good"})  # the anchor's members lead round 6


def test_a_state_whose_round_is_not_anchored_yet_is_asked_again_not_refused(monkeypatch):
    store = {}
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "only": PeerRecord("only", "only:1", state="training", round=5)}
    sync, events = state_sync("me", store, live)
    downloads = []

    def download(channels, traffic, endpoint, run, me, target, **kw):
        downloads.append(endpoint)
        if len(downloads) == 2:  # the coordinator settles round 6 between the two downloads
            publish_anchor(MemoryControl("coord", store, live), "0-0",
                           Anchor(6, FakeReplica(1.0).phi_hash(), ("only",)), 60)
        return served(1.0, 6, sync.config)

    downloads_by(monkeypatch, download, ANCHOR_SLACK_S=0.0)
    assert sync.fetch(min_round=6)
    assert downloads == ["only:1", "only:1"] and torch.equal(sync.replica.w, torch.full((4,), 1.0))
    kinds = [kind for kind, _ in events]
    assert "reject" not in kinds and kinds.count("state_error") == 1 and "state_received" in kinds


def test_a_source_that_keeps_serving_a_round_without_an_anchor_is_passed_over(monkeypatch):
    store = {}
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "ahead": PeerRecord("ahead", "ahead:1", state="training", round=90),  # claims the newest round
            "honest": PeerRecord("honest", "honest:1", state="training", round=5)}
    sync, events = state_sync("me", store, live)
    publish_anchor(MemoryControl("coord", store, live), "0-0", Anchor(6, FakeReplica(1.0).phi_hash(), ("honest",)), 60)
    downloads = []

    def download(channels, traffic, endpoint, run, me, target, **kw):
        downloads.append(endpoint)
        return served(1.0, 91 if endpoint == "ahead:1" else 6, sync.config)

    downloads_by(monkeypatch, download, ANCHOR_SLACK_S=0.0)
    assert sync.fetch(min_round=6)
    assert downloads == ["ahead:1", "ahead:1", "honest:1"] and sync.replica.round == 6
    assert "reject" not in [kind for kind, _ in events]


def test_a_source_that_served_no_state_is_passed_over_while_another_is_listed(monkeypatch):
    store = {}
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "dead": PeerRecord("dead", "dead:1", state="training", round=5),  # killed: its record lives on
            "alive": PeerRecord("alive", "alive:1", state="training", round=5)}
    sync, events = state_sync("me", store, live)
    publish_anchor(MemoryControl("coord", store, live), "0-0", Anchor(6, FakeReplica(1.0).phi_hash(), ("alive",)),
                   60)
    downloads = []

    def download(channels, traffic, endpoint, run, me, target, **kw):
        downloads.append(endpoint)
        if endpoint == "dead:1":
            raise StateError("state download from dead:1 failed: UNAVAILABLE")
        return served(1.0, 6, sync.config)

    monkeypatch.setattr("lowcomm.runtime.state_sync.random.choice", lambda seq: max(seq, key=lambda r: r.peer_id))
    downloads_by(monkeypatch, download, RETRY_S=0.0)
    assert sync.fetch(min_round=6)
    assert downloads == ["dead:1", "alive:1"] and sync.replica.round == 6  # the dead one cost one try


def test_a_joiner_asks_for_the_round_after_the_one_its_source_holds_not_its_older_record(monkeypatch):
    store = {}
    live = {"coord": PeerRecord("coord", "coord:1", state="coordinator"),
            "source": PeerRecord("source", "source:1", state="training", round=5)}  # stored three rounds ago
    sync, events = state_sync("me", store, live)
    publish_anchor(MemoryControl("coord", store, live), "0-0", Anchor(9, FakeReplica(1.0).phi_hash(), ("source",)),
                   60)
    asked = []

    def download(channels, traffic, endpoint, run, me, target, **kw):
        asked.append(target)
        return served(1.0, target, sync.config)  # the source holds it back until it reaches that round

    downloads_by(monkeypatch, download, held=8, ANCHOR_SLACK_S=0.0)
    assert sync.fetch()
    assert asked == [9] and sync.replica.round == 9  # the boundary after the source's round 8, not after 5


def test_the_state_hash_is_the_replicas_own_phi_hash():
    model = build_model(RunConfig().model)
    for name in ("diloco", "ddp", "demo", "sparseloco"):
        config = RunConfig()
        replica = algorithm(name).replica(ReplicaSpec(model, config, None, GroupKey("r"),
                                                      optimizer=torch.optim.AdamW(model.parameters())))
        assert state_phi_hash(replica.state_tensors(), replica.names) == replica.phi_hash(), name


def test_the_coordinator_refuses_to_checkpoint_a_state_that_is_not_the_agreed_phi(tmp_path, monkeypatch):
    config = RunConfig()
    config.checkpoint.every_rounds, config.checkpoint.every_s = 2, 0.0
    config.checkpoint.max_share = 0.0  # no cap on the downloads' share (tests/unit/test_checkpoint_budget.py)
    names = [n for n, _ in build_model(config.model).named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in build_model(config.model).named_parameters()}

    def state(value: float) -> bytes:
        tensors = {f"phi.{n}": torch.full(s, value) for n, s in shapes.items()}
        return encode_state(tensors, 4, 0, config.config_hash(), "claimed").blob

    blobs = {"bad:1": state(666.0), "good:1": state(1.0)}
    agreed = state_phi_hash(st_load(blobs["good:1"]), names)
    live = {"bad": PeerRecord("bad", "bad:1", state="training", round=5),  # the newest: asked first
            "good": PeerRecord("good", "good:1", state="training", round=4)}
    coordinator = Coordinator(config, tmp_path)
    coordinator.control = MemoryControl("coord", {}, live)
    coordinator.channels = coordinator.traffic = None
    coordinator.follower = SimpleNamespace(anchors={4: Anchor(4, agreed, ("bad", "good"))})
    asked = []

    def download(channels, traffic, endpoint, run, me, target, **kw):
        asked.append(endpoint)
        return SimpleNamespace(round=4, tokens=0, config_hash=config.config_hash(), phi_hash=agreed,
                               data=blobs[endpoint])

    monkeypatch.setattr("lowcomm.runtime.coordinator.download_state", download)
    coordinator._maybe_checkpoint()
    assert asked == ["bad:1"] and coordinator.refused_checkpoints == 1
    assert not list((tmp_path / "checkpoints").glob("round-*"))
    coordinator._maybe_checkpoint()
    assert asked == ["bad:1", "good:1"]
    saved = list((tmp_path / "checkpoints").glob("round-*"))
    assert len(saved) == 1 and state_phi_hash(st_load((saved[0] / "state.safetensors").read_bytes()), names) == agreed
    config.checkpoint.every_s = 3600.0  # the next one is due in rounds, not yet in time: nobody is asked
    live["good"].round = 9
    coordinator._maybe_checkpoint()
    assert asked == ["bad:1", "good:1"]
    coordinator.last_checkpoint_at -= 3600.0
    coordinator._maybe_checkpoint()
    assert asked[-1] == "good:1" and len(asked) == 3
