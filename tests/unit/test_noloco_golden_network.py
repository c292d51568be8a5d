"""NoLoCo replicas over the real pair exchange (loopback gRPC, signed pushes) reproduce the golden
trajectory of `algorithms_noloco.json`; the in-process golden tests are in test_replicas_golden."""

from __future__ import annotations

import threading

import pytest
import torch
from golden import assert_close

from lowcomm.algorithms.noloco import NoLoCoConfig
from lowcomm.algorithms.noloco_replica import NoLoCo
from lowcomm.algorithms.registry import PAIRS, algorithm, noloco_grouping
from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import Manifest
from lowcomm.collectives.pair_exchange import PairExchange
from lowcomm.config import RunConfig
from lowcomm.transport.identity import Identity
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer, Unauthenticated, Verifier
from lowcomm.transport.wire import Channels, Traffic, start_server
from unit.test_replicas_golden import WAIT_S, Blocks, Track, build, drive_rounds, fixture


# ---------------------------------------------------------------------- NoLoCo over the real pair exchange
class Board:
    """The DHT's part for a complete swarm: a round's manifest lists every member once all announced it."""

    def __init__(self, run: str, endpoints: dict[str, str]):
        self.run, self.endpoints = run, endpoints
        self.announced: dict[int, set[str]] = {}
        self.cond = threading.Condition()


class BoardAgreement:
    """The one member of ManifestAgreement that PairExchange calls (``agree``), over a ``Board``."""

    def __init__(self, board: Board, me: str):
        self.board, self.me = board, me

    def agree(self, group, round_, epoch_rounds, codec, suspects=frozenset()):
        board = self.board
        with board.cond:
            board.announced.setdefault(round_, set()).add(self.me)  # after PairExchange.start entered the round
            board.cond.notify_all()
            assert board.cond.wait_for(lambda: board.announced[round_] >= set(board.endpoints), WAIT_S)
        ids = sorted(board.endpoints)
        return Manifest(board.run, group, round_, epoch_rounds, ids[0], ids, dict(board.endpoints), ids, codec)


class NamedSigner(Signer):
    """A real key under a fixed name: the golden trajectory pairs peers by the names it was recorded with,
    and a real peer id is the hash of its key."""

    def __init__(self, name: str):
        super().__init__(Identity.generate())
        self.peer_id = name


class NamedVerifier(Verifier):
    """Checks signatures as the runtime does, but a sender's key by its name (``keys``), not by its hash."""

    def __init__(self, keys: dict[str, bytes]):
        super().__init__()
        self.keys = keys

    def check_sender(self, sender: str, key: bytes) -> None:
        if self.keys.get(sender) != key:
            raise Unauthenticated(f"the call's key is not the key of {sender!r}")


class Peer:
    """One peer's transport, as runtime.peer builds it: key, traffic, channels, service, server."""

    def __init__(self, peer_id: str, sync: SyncConfig):
        self.signer = NamedSigner(peer_id)
        self.id = peer_id
        self.traffic = Traffic(None)
        self.channels = Channels(sync.chunk_bytes)
        self.service = PeerService(peer_id, self.traffic, self.channels)
        self.server, port = start_server(self.service, "127.0.0.1", 0, sync.chunk_bytes)
        self.endpoint = f"127.0.0.1:{port}"
        self.events: list[dict] = []

    def close(self) -> None:
        self.server.stop(0)
        self.channels.close()


@pytest.fixture
def noloco_peers():
    data = fixture("algorithms_noloco")
    sync = SyncConfig(reduce_timeout_s=20.0, chunk_bytes=1 << 16)
    peers = [Peer(f"peer-{r}", sync) for r in range(len(data["grads"][0]))]
    yield data, sync, peers
    for peer in peers:
        peer.close()


def test_noloco_replicas_over_the_pair_exchange_reproduce_the_golden_trajectory(noloco_peers):
    """algorithms_noloco.json (5 replicas: pairs, the odd member in group 0) through NoLoCo replicas on
    PairExchange over loopback gRPC, grouped by the registry's grouping under the fixture's run name."""
    data, sync, peers = noloco_peers
    cfg = data["config"]
    rounds, replicas, steps = len(data["grads"]), len(data["grads"][0]), len(data["grads"][0][0])
    config = RunConfig(noloco=NoLoCoConfig(inner_steps=steps, group_size=cfg["group_size"], outer_lr=cfg["alpha"],
                                           momentum=cfg["beta"], codec="fp32"))
    assert config.noloco.gamma == cfg["gamma"] and algorithm("noloco").exchange == PAIRS
    models = [Blocks(data["phi0"]) for _ in range(replicas)]
    shapes = [tuple(p.shape) for p in models[0].parameters()]
    board = Board(data["run"], {peer.id: peer.endpoint for peer in peers})
    exchanges = [PairExchange(peer.signer, peer.service, peer.channels, peer.traffic, BoardAgreement(board, peer.id),
                              sync, config.noloco.codec, shapes + shapes, noloco_grouping(config),
                              on_event=lambda kind, peer=peer, **fields: peer.events.append({"kind": kind, **fields}))
                 for peer in peers]
    for exchange in exchanges:
        exchange.verifier = NamedVerifier({peer.id: peer.signer.key for peer in peers})
    tracks = [Track() for _ in range(replicas)]
    reps = build("noloco", config, models, exchanges, GroupKey(data["run"]), tracks)
    assert all(isinstance(rep, NoLoCo) for rep in reps)
    drive_rounds(reps, models, data["grads"], data["inner_lr"], tracks)
    for r, track in enumerate(tracks):
        assert [(x.round, x.step) for x in track.landed] == [(t, (t + 1) * steps) for t in range(rounds)]
        for x, stored in zip(track.landed, data["trajectory"]):
            group = x.info["record"]["group"]
            assert len(group) in (2, 3) and x.contributors == group and x.info["record"]["received_from"]
            for k in range(len(x.phi)):
                assert_close(x.phi[k], stored[r][k], msg=f"replica {r}, round {x.round + 1}, param {k}")
        for p, q in zip(models[r].parameters(), reps[r].phi):  # θ ← φ after every round
            assert torch.equal(p, q)
    assert not any(e["kind"] in ("reject", "timeout") for peer in peers for e in peer.events)
    assert not all(torch.equal(a, b) for a, b in zip(reps[0].phi, reps[1].phi))  # no shared φ: pairs mix
