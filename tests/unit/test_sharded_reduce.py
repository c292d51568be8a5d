"""ShardedReduce in one process: real gRPC servers on loopback, the manifest from an in-memory agreement.

Dense fp32 and uint8 reduces, a member that never sends (left out by the deadline), an owner that
crashes before sending (its shard is lost, the others say so), a late peer catching up on the
bytes the members applied, and SparseLoCo's forwarded bundles (equal to the in-process collective's
result, bit for bit). Assertions are on values and contributor lists, never on durations.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lowcomm.algorithms import sparseloco
from lowcomm.algorithms.sparseloco import SparseLoCoConfig, SparseLoCoState, compress_all
from lowcomm.collectives import held_shards, shard_fetch
from lowcomm.collectives.base import CollectiveError, GroupKey, NotInRound
from lowcomm.collectives.combiners import SparseBundle
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.local import LocalGroup
from lowcomm.collectives.manifest import Manifest
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer
from lowcomm.transport.wire import Channels, Traffic, start_server

KEY = GroupKey("sharded-test")
SYNC = SyncConfig(announce_s=1.0, manifest_s=0.5, reduce_timeout_s=1.5, chunk_bytes=4096)  # several chunks a part
NUMEL = 5003
WAIT_S = 30


class Board:
    """What the DHT holds for these tests: announcements and manifests by (group, round)."""

    def __init__(self, run: str, due: set[str]):
        self.run, self.due = run, due  # due: the live peers a round waits for
        self.announced: dict[tuple[str, int], dict[str, dict]] = {}
        self.manifests: dict[tuple[str, int], Manifest] = {}
        self.cond = threading.Condition()


class MemoryAgreement:
    """The part of ManifestAgreement that ShardedReduce uses (agree / announce / withdraw / read), in memory.

    As the DHT's: a round's members are its announcers once every due peer reached it (or
    ``announce_s`` passed); those announced only ahead, or in client mode, own no shard; a peer that
    finds a manifest without itself gets NotInRound carrying that manifest.
    """

    def __init__(self, board: Board, me: str, endpoint: str, client_mode: bool = False):
        self.board, self.me, self.endpoint, self.client_mode = board, me, endpoint, client_mode

    def announce(self, group: str, round_: int, ahead: bool = False) -> None:
        with self.board.cond:
            self.board.announced.setdefault((group, round_), {})[self.me] = {
                "endpoint": self.endpoint, "client_mode": self.client_mode, "ahead": ahead}
            self.board.cond.notify_all()

    def withdraw(self, group: str, round_: int) -> None:
        with self.board.cond:
            self.board.announced.get((group, round_), {}).pop(self.me, None)

    def read(self, group: str, round_: int) -> Manifest | None:
        with self.board.cond:
            return self.board.manifests.get((group, round_))

    def agree(self, group: str, round_: int, epoch_rounds: int, codec: str, suspects=frozenset()) -> Manifest:
        self.announce(group, round_)
        key, board = (group, round_), self.board

        def settled() -> bool:
            present = {p for p, info in board.announced[key].items() if not info["ahead"]}
            return key in board.manifests or board.due - suspects <= present

        with board.cond:
            board.cond.wait_for(settled, SYNC.announce_s)
            if key not in board.manifests:
                announcers = board.announced[key]
                members = sorted(announcers)
                owners = [p for p in members if not announcers[p]["client_mode"] and not announcers[p]["ahead"]]
                board.manifests[key] = Manifest(board.run, group, round_, epoch_rounds, self.me, members,
                                                {p: announcers[p]["endpoint"] for p in members}, owners, codec)
                board.cond.notify_all()
            manifest = board.manifests[key]
        if self.me not in manifest.members:
            raise NotInRound(f"round {round_}: not in the manifest", manifest)
        return manifest


# Keys made once for the module's nodes, in the order of their ids: nodes[0] has the lowest id.
SIGNERS = sorted((Signer.generate() for _ in range(5)), key=lambda signer: signer.peer_id)


class Node:
    """One peer's transport, as runtime.peer builds it: key, traffic, channels, service, server."""

    def __init__(self, signer: Signer | None = None):
        self.signer = signer or Signer.generate()
        self.id = self.signer.peer_id
        self.traffic = Traffic(None)
        self.channels = Channels(SYNC.chunk_bytes)
        self.service = PeerService(self.id, self.traffic, self.channels)
        self.server, port = start_server(self.service, "127.0.0.1", 0, SYNC.chunk_bytes)
        self.endpoint = f"127.0.0.1:{port}"
        self.events = []

    def reduce(self, board: Board, codec: str = "fp32", combiner=None) -> ShardedReduce:
        return ShardedReduce(self.signer, self.service, self.channels, self.traffic,
                             MemoryAgreement(board, self.id, self.endpoint), SYNC, codec, combiner=combiner,
                             on_event=lambda kind, **fields: self.events.append({"kind": kind, **fields}))

    def close(self) -> None:
        self.server.stop(0)
        self.channels.close()


@pytest.fixture
def nodes():
    nodes = [Node(SIGNERS[i]) for i in range(4)]
    yield nodes
    for node in nodes:
        node.close()


def payload(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * (seed + 1)


def weighted_mean(payloads, weights) -> torch.Tensor:
    return sum(p * w for p, w in zip(payloads, weights)) / sum(weights)


@pytest.mark.parametrize("codec, mean_error", [("fp32", 1e-6), ("uint8", 0.05)])
def test_every_member_applies_the_same_weighted_mean(nodes, codec, mean_error):
    members = nodes[:3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board, codec) for n in members]
    payloads, weights = [payload(i) for i in range(3)], [100.0, 200.0, 300.0]
    handles = [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, payloads, weights)]
    results = [h.result(WAIT_S) for h in handles]
    ids = [n.id for n in members]
    for result in results:
        assert result.contributors == ids and result.participants == ids and result.info["lost_shards"] == []
        assert sorted(result.info["record"]["owners"]) == ids  # the manifest's owners go into the round record
        assert torch.equal(result.aggregate, results[0].aggregate)
    error = (results[0].aggregate - weighted_mean(payloads, weights)).abs().mean()
    assert error < mean_error, f"{codec}: mean error {error}"  # uint8 clips beyond 3σ: a mean, not a max
    local = LocalGroup(ids, codec=codec)  # the in-process collective runs the same combiner calls
    local_results = [local.member(i).start(KEY, 0, p, w) for i, (p, w) in enumerate(zip(payloads, weights))]
    torch.testing.assert_close(local_results[0].result(WAIT_S).aggregate, results[0].aggregate, rtol=1e-6, atol=1e-6)
    assert all(n.traffic.sent > 0 and n.traffic.received > 0 for n in members)  # it went over the wire


def test_a_member_that_never_sends_is_left_out_by_the_deadline(nodes):
    a, b, c = nodes[:3]
    board = Board(KEY.run, {a.id, b.id, c.id})
    reduces = {n.id: n.reduce(board) for n in (a, b, c)}
    reduces[c.id].announce_ahead(KEY, 0)  # a member of the round (without a shard) that never starts it
    with board.cond:
        assert board.cond.wait_for(lambda: c.id in board.announced.get((KEY.group, 0), {}), WAIT_S)
    payloads = {a.id: payload(0), b.id: payload(1)}
    handles = {p: reduces[p].start(KEY, 0, payloads[p], 1.0 + i) for i, p in enumerate((a.id, b.id))}
    results = [h.result(WAIT_S) for h in handles.values()]
    for result in results:
        assert result.participants == [a.id, b.id, c.id]
        assert result.contributors == [a.id, b.id]
        assert result.info["lost_shards"] == []
        torch.testing.assert_close(result.aggregate, weighted_mean([payloads[a.id], payloads[b.id]], [1.0, 2.0]),
                                   rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0].aggregate, results[1].aggregate)


def test_an_owner_that_crashes_before_sending_loses_its_shard_and_everyone_says_so(nodes):
    a, b, c = nodes[:3]
    board = Board(KEY.run, {a.id, b.id, c.id})
    reduces = [n.reduce(board) for n in (a, b, c)]

    def crash(round_):
        raise RuntimeError(f"injected crash in round {round_}")

    reduces[2].before_send = crash
    payloads = [payload(i) for i in range(3)]
    handles = [r.start(KEY, 4, p, 1.0) for r, p in zip(reduces, payloads)]
    with pytest.raises(RuntimeError, match="injected crash in round 4"):
        handles[2].result(WAIT_S)
    results = [h.result(WAIT_S) for h in handles[:2]]
    bounds = reduces[0].combiner.shard_bounds(3, NUMEL)
    lost = slice(*bounds[2])
    for result in results:
        assert result.contributors == [a.id, b.id] and result.info["lost_shards"] == [2]
        assert torch.equal(result.aggregate[lost], torch.zeros(bounds[2][1] - bounds[2][0]))
        kept = slice(0, bounds[2][0])
        mean = (payloads[0] + payloads[1]) / 2
        torch.testing.assert_close(result.aggregate[kept], mean[kept], rtol=1e-6, atol=1e-6)
    assert torch.equal(results[0].aggregate, results[1].aggregate)


def test_a_late_peer_catches_up_on_the_bytes_the_members_applied(nodes):
    members, late = nodes[:3], nodes[3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board, "uint8") for n in members]
    handles = [r.start(KEY, 2, payload(i), 1.0) for i, r in enumerate(reduces)]
    results = [h.result(WAIT_S) for h in handles]
    latecomer = late.reduce(board, "uint8")
    with pytest.raises(NotInRound) as left_out:
        latecomer.start(KEY, 2, payload(3), 1.0).result(WAIT_S)
    assert left_out.value.manifest.members == [n.id for n in members]
    caught = latecomer.catch_up(KEY, 2, NUMEL, left_out.value.manifest)
    assert caught.info["caught_up"] and caught.contributors == results[0].contributors
    assert caught.info["record"]["owners"] == results[0].info["record"]["owners"]
    assert torch.equal(caught.aggregate, results[0].aggregate)


@pytest.mark.parametrize("bound", ["HOLD_S", "HOLD_BYTES"])
def test_catching_up_a_round_every_member_forgot_fails_at_once(nodes, monkeypatch, bound):
    """The members keep a round's shards while they run the next two (held_shards.KEEP_ROUNDS), and
    older ones only within HOLD_S after they landed and HOLD_BYTES; a peer that asks for a round past
    either bound hears EXPIRED from each member and gives up without waiting for its deadline."""
    monkeypatch.setattr(held_shards, bound, 0)
    members, late = nodes[:3], nodes[3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    for round_ in range(4):
        last = [h.result(WAIT_S) for h in [r.start(KEY, round_, payload(i), 1.0) for i, r in enumerate(reduces)]]
    latecomer = late.reduce(board)
    with pytest.raises(CollectiveError, match="every member forgot the round"):
        latecomer.catch_up(KEY, 0, NUMEL, board.manifests[(KEY.group, 0)])
    caught = latecomer.catch_up(KEY, 3, NUMEL, board.manifests[(KEY.group, 3)])  # the newest round is held
    assert torch.equal(caught.aggregate, last[0].aggregate)


@pytest.mark.parametrize("codec", ["fp32", "uint8"])
def test_a_round_past_keep_rounds_is_caught_up_within_hold_s_up_to_max_held_rounds(nodes, monkeypatch, codec):
    """A joiner slower than the members catches up a round they ran past (it landed under HOLD_S ago),
    but never one more than MAX_HELD_ROUNDS back: that one is EXPIRED at once. The rounds below the
    newest are served from their spool files; a lossless codec's newest round too, as values copied
    there before its aggregate went to the caller, who may change it (here: zeroes it)."""
    monkeypatch.setattr(held_shards, "MAX_HELD_ROUNDS", 4)
    monkeypatch.setattr(held_shards, "SPOOL_MIN_BYTES", 1)
    members, late = nodes[:3], nodes[3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board, codec) for n in members]
    landed = {}
    for round_ in range(6):
        results = [h.result(WAIT_S) for h in [r.start(KEY, round_, payload(i + round_), 1.0)
                                              for i, r in enumerate(reduces)]]
        landed[round_] = results[0].aggregate.clone(), results[0].contributors
        for result in results:
            result.aggregate.zero_()
    for r in reduces:  # lossless: every round in spool files; else the newest round's pieces in memory
        resident = r.slots.held_resident_bytes()
        assert resident == 0 if codec == "fp32" else 0 < resident <= 2 * NUMEL * 4
    latecomer = late.reduce(board, codec)
    newest = latecomer.catch_up(KEY, 5, NUMEL, board.manifests[(KEY.group, 5)])
    assert torch.equal(newest.aggregate, landed[5][0]) and landed[5][0].any()
    caught = latecomer.catch_up(KEY, 2, NUMEL, board.manifests[(KEY.group, 2)])  # 3 rounds back: held
    assert torch.equal(caught.aggregate, landed[2][0])
    assert caught.contributors == landed[2][1]
    with pytest.raises(CollectiveError, match="every member forgot the round"):
        latecomer.catch_up(KEY, 0, NUMEL, board.manifests[(KEY.group, 0)])  # 5 rounds back


def test_a_catch_up_begun_while_the_round_reduces_returns_what_the_members_applied(nodes, monkeypatch):
    """A joiner fetches the round in flight: its asks reach the members before they hold any shard.
    Each ask waits less than the reduce takes, so the shards are asked for again until they are held."""
    monkeypatch.setattr(shard_fetch, "ASK_WAIT_S", 0.05)
    members, late = nodes[:3], nodes[3]
    board = Board(KEY.run, {n.id for n in members})
    ids = [n.id for n in members]
    manifest = Manifest(KEY.run, KEY.group, 2, 1, ids[0], ids, {n.id: n.endpoint for n in members}, ids, "fp32")
    board.manifests[(KEY.group, 2)] = manifest
    reduces = [n.reduce(board) for n in members]
    latecomer = late.reduce(board)
    caught: list = []
    fetching = threading.Thread(target=lambda: caught.append(latecomer.catch_up(KEY, 2, NUMEL, manifest)))
    fetching.start()
    handles = [r.start(KEY, 2, payload(i), 1.0) for i, r in enumerate(reduces)]
    results = [h.result(WAIT_S) for h in handles]
    fetching.join(WAIT_S)
    assert not fetching.is_alive() and len(caught) == 1
    assert caught[0].contributors == results[0].contributors == sorted(ids)
    assert torch.equal(caught[0].aggregate, results[0].aggregate)


def test_a_failed_catch_up_says_why_the_members_refused(nodes):
    """A catch-up that follows another manifest of the round than the members (a split) gets no shard,
    and its error names the refusal instead of only the shards it lacks."""
    members, late = nodes[:3], nodes[3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    [h.result(WAIT_S) for h in [r.start(KEY, 2, payload(i), 1.0) for i, r in enumerate(reduces)]]
    theirs = board.manifests[(KEY.group, 2)]
    # the same round under another leader (whichever member wrote theirs: another manifest needs another one)
    leader = next(m for m in theirs.members if m != theirs.leader)
    other = Manifest(KEY.run, KEY.group, 2, 1, leader, theirs.members, theirs.endpoints, theirs.owners, theirs.codec)
    assert other.digest != theirs.digest
    with pytest.raises(CollectiveError, match="no member returned shards .0, 1, 2.*under another manifest"):
        late.reduce(board).catch_up(KEY, 2, NUMEL, other)


SHAPES = [(96, 100), (70,), (64, 128), (3, 4, 5)]


def sparse_payloads(seed: int, config: SparseLoCoConfig) -> list[bytes]:
    torch.manual_seed(seed)
    deltas = [torch.randn(s) * (seed + 1) for s in SHAPES]
    return compress_all(SparseLoCoState.zeros_like(deltas), deltas, config)


def test_sparse_bundles_give_every_member_the_in_process_collectives_result_bit_for_bit(nodes):
    config = SparseLoCoConfig(topk=8)

    def combiner():
        return SparseBundle(SHAPES, config.codec_for,
                            lambda parts, shape, _: sparseloco.combine(parts, shape, config.clip))

    members = nodes[:3]
    ids = [n.id for n in members]
    board = Board(KEY.run, set(ids))
    reduces = [n.reduce(board, combiner=combiner()) for n in members]
    payloads = [sparse_payloads(i, config) for i in range(3)]
    results = [h.result(WAIT_S) for h in [r.start(KEY, 0, p, 1.0) for r, p in zip(reduces, payloads)]]
    local = LocalGroup(ids, combiner=combiner())
    expected = [h.result(WAIT_S) for h in [local.member(i).start(KEY, 0, p, 1.0) for i, p in enumerate(payloads)]]
    for result in results:
        assert result.contributors == ids and result.info["lost_shards"] == []
        assert torch.equal(result.aggregate, expected[0].aggregate)
