"""An outsider attacking a live swarm, as a stranger would: fresh keys, its own DHT node joined
through the coordinator's multiaddr, and the project's own gRPC stubs and message helpers.

It knows only what anyone may read: the coordinator's join information (``coordinator.json`` of a
simulate run), the peer records and φ votes in the DHT, the manifests any peer serves (`GetPost`), and
a state any peer serves.
Each attack is one function that returns what the swarm answered (one dict per message sent):

- ``forged_parts``: a Reduce part under another member's id (signed with the outsider's key, and
  unsigned), weight 1e12, every value 1.0;
- ``outsider_parts``: a part the outsider signs as itself for a round it is not a member of (its
  stand-in for a relabelled replay: it never captured a member's part);
- ``outsider_manifests``: manifests of the coming rounds naming the outsider the only owner, stored
  and posted to the members;
- ``sybil_records``: fresh keys voting a φ hash of their own and publishing "training" records that
  point at the outsider's endpoint, which serves a poisoned state;
- ``bomb_parts``: a zstd frame declaring 2**28 codes, sent as a Reduce part;
- ``far_future_streams``: a Reduce stream per fresh key at every owner naming a round 10**6 ahead,
  with an hour's deadline, cancelled once answered;
- ``stream_flood``: throughout the run, 4 streams per fresh key at every owner naming the next two
  rounds (within an owner's reach, so each waits for the round's slot), sent again as each ends.

Run as a program (``python tests/outsider.py RUN_DIR``) it waits for the swarm, attacks in rounds
until RUN_DIR/outsider.stop exists or ``--deadline-s`` passes, and appends every answer to
RUN_DIR/outsider.jsonl (its ids, once, to RUN_DIR/outsider-ids.json). Its DHT node and gRPC server
live in its own process group, which the test kills.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.manifest_record import Manifest
from lowcomm.collectives.reduce_messages import KIND
from lowcomm.proto import wire_pb2
from lowcomm.runtime.state_transfer import StateHolder, download_state, encode_state
from lowcomm.transport.control import ControlPlane, PeerRecord
from lowcomm.transport.identity import Identity
from lowcomm.transport.record_signing import SignedRecords
from lowcomm.transport.round_posts import MANIFEST, post_request
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer, digest
from lowcomm.transport.wire import Channels, Traffic, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from children import wait_until  # noqa: E402
from unit.test_hostile_parts import bomb  # noqa: E402 (tests/ on the path first, as pytest puts it)

GROUP = "0-0"  # the group of a DiLoCo run without stages or fragments
CHUNK_BYTES = 1 << 20
CALL_S = 30.0  # the longest one attack call waits for its answer
FLOOD_KEYS = 12  # fresh keys behind the flood: 4 streams each fill an owner's 48 waiting places
SYBILS = 3
POISON = 666.0


class MultiKeyValidator(SignedRecords):
    """Signs each record with the key its `[owner:...]` marker names: one DHT node writes for every
    outsider key (a node's own validator signs for one key only)."""

    def __init__(self, identities: list[Identity]):
        super().__init__(identities[0].sign, identities[0].owner_marker)
        self._by_marker = {i.owner_marker: i.sign for i in identities}

    def sign_with(self, record):
        for marker, sign in self._by_marker.items():
            if marker in record.key or (record.subkey is not None and marker in record.subkey):
                return sign
        return None


class Outsider:
    """The outsider's keys, DHT views (one ControlPlane per key, one DHT node) and gRPC server."""

    def __init__(self, info: dict, sybils: int = SYBILS):
        self.run = info["run"]
        self.identity = Identity.generate()
        self.sybils = [Identity.generate() for _ in range(sybils)]
        validator = MultiKeyValidator([self.identity, *self.sybils])
        self.identity.validator = validator
        self.control = ControlPlane.start(self.identity, self.run, initial_peers=list(info["maddrs"]))
        self.sybil_controls = [ControlPlane(self.control.dht, i, self.run) for i in self.sybils]
        self.signer = Signer(self.identity)
        self.channels = Channels(CHUNK_BYTES)
        self.holder = StateHolder(self.run, CHUNK_BYTES)
        self.service = PeerService(self.identity.peer_id, Traffic(), Channels(CHUNK_BYTES))
        self.service.state_handler = self._serve_poison
        self.server, port = start_server(self.service, "127.0.0.1", 0, CHUNK_BYTES)
        self.endpoint = f"127.0.0.1:{port}"
        self.poisoned: dict[str, torch.Tensor] | None = None
        self.state_meta: tuple[str, int] | None = None  # (config hash, tokens) of the state it copied

    @property
    def ids(self) -> list[str]:
        return [self.identity.peer_id, *(i.peer_id for i in self.sybils)]

    def close(self) -> None:
        self.server.stop(0)
        self.channels.close()
        self.control.shutdown()

    # ---- what anyone may read ------------------------------------------------------------------

    def honest_records(self) -> dict[str, PeerRecord]:
        return {p: r for p, r in self.control.live_peers().items() if p not in self.ids and r.state == "training"}

    def newest_manifest(self) -> dict | None:
        """The manifest of the newest round the training peers wrote one of (its lowest-id writer's), from
        the round before their records' newest on: asked of them (`GetPost` answers anyone with a peer's
        own posts; a manifest reaches the DHT only where a post did not arrive) and read from the DHT."""
        records = self.honest_records()
        if not records:
            return None
        newest, found = max(r.round for r in records.values()), None
        for round_ in range(max(newest - 1, 0), newest + 64):  # a record's round may be rounds old: to the last
            written = self._manifests(records, round_)
            if written:
                found = written[min(written)]
            elif found is not None or round_ > newest + 1:
                break
        return found

    def _manifests(self, records: dict[str, PeerRecord], round_: int) -> dict[str, dict]:
        out = {w: m for w, m in self.control.manifests(GROUP, round_).items() if w not in self.ids}
        for peer_id, record in sorted(records.items()):
            request = wire_pb2.PostRequest(run=self.run, group=GROUP, round=round_, kind=MANIFEST)
            try:
                reply = self.channels.stub(record.endpoint).GetPost(request, timeout=CALL_S)
            except grpc.RpcError:
                continue
            if reply.sender == peer_id:
                out.update(self.control.parse_manifests({peer_id: json.loads(reply.value)}))
        return out

    def copy_state(self, endpoint: str) -> int:
        """Downloads a peer's state (anyone may) and keeps it with φ poisoned; the number of φ values."""
        state = download_state(self.channels, Traffic(), endpoint, self.run, self.identity.peer_id, 0,
                               wait_s=0.0, timeout=CALL_S, max_bytes=1 << 30)
        from safetensors.torch import load as st_load

        tensors = st_load(state.data)
        self.state_meta = (state.config_hash, int(state.tokens))
        self.poisoned = {k: torch.full_like(v, POISON) if k.startswith("phi.") else v for k, v in tensors.items()}
        return sum(v.numel() for k, v in tensors.items() if k.startswith("phi."))

    def _serve_poison(self, request, context):
        """A poisoned state labelled with whatever round was asked for, under an honest-looking hash."""
        if self.poisoned is None:
            yield wire_pb2.StateChunk(error="no state yet")
            return
        config_hash, tokens = self.state_meta
        self.holder.publish(encode_state(self.poisoned, int(request.min_round), tokens, config_hash, "0" * 64))
        yield from self.holder.serve(request, context)

    # ---- sending parts -------------------------------------------------------------------------

    def send_part(self, endpoint: str, header: dict, blob: bytes, signer: Signer | None, sender: str | None = None,
                  timeout: float = CALL_S, first_bytes: int | None = None) -> dict:
        """One Reduce part to ``endpoint``: signed by ``signer`` (None: unsigned), under ``sender`` (default:
        the signer's id); the owner's first answer (status and error) or the call's gRPC code."""
        fields = {**header, "sender": sender or (signer.peer_id if signer else self.identity.peer_id),
                  "total_bytes": len(blob), "digest": digest(blob), "pieces": 0, "piece_elems": 0,
                  "norm": 0.0}
        first = wire_pb2.ReduceChunk(**fields, data=blob[:first_bytes])
        if signer is not None:
            first.sender_key, first.signature = signer.sign(KIND, fields)
        rest = [] if first_bytes is None else [wire_pb2.ReduceChunk(data=blob[i:i + CHUNK_BYTES])
                                               for i in range(first_bytes, len(blob), CHUNK_BYTES)]
        try:
            replies = self.channels.stub(endpoint).Reduce(iter([first, *rest]), timeout=timeout)
            reply = next(iter(replies))
            return {"status": wire_pb2.ReduceReply.Status.Name(reply.status), "error": reply.error[:200],
                    "contributors": list(reply.contributors)}
        except grpc.RpcError as e:
            return {"status": e.code().name, "error": (e.details() or "")[:200]}
        except StopIteration:
            return {"status": "NO_REPLY", "error": ""}


def _header(manifest: dict, round_: int, shard: int, weight: float) -> dict:
    return dict(run_id=manifest["run"], group=manifest["group"], round=round_, epoch=manifest["round"], shard=shard,
                weight=weight, codec=manifest["codec"], manifest=Manifest.from_dict(manifest).digest)


def _ones(manifest: dict, shard: int, numel: int) -> bytes:
    combiner = DenseMean(manifest["codec"], 0)
    bounds = combiner.shard_bounds(len(manifest["owners"]), numel)
    return combiner.encode(torch.ones(numel), bounds[shard])


def _targets(manifest: dict):
    """(shard, owner, its endpoint, a member other than the owner) for every shard of ``manifest``."""
    for shard, owner in enumerate(manifest["owners"]):
        victim = next((m for m in manifest["members"] if m != owner), owner)
        yield shard, owner, manifest["endpoints"][owner], victim


# ---- the attacks ---------------------------------------------------------------------------------


def forged_parts(outsider: Outsider, manifest: dict, numel: int) -> list[dict]:
    """Weight 1e12, all ones, under a member's id: signed with the outsider's key, then unsigned."""
    out = []
    for round_ in (manifest["round"], manifest["round"] + 1):
        for shard, owner, endpoint, victim in _targets(manifest):
            blob = _ones(manifest, shard, numel)
            for signer in (outsider.signer, None):
                answer = outsider.send_part(endpoint, _header(manifest, round_, shard, 1e12), blob, signer, victim)
                out.append({"attack": "forged", "signed": signer is not None, "owner": owner, "round": round_,
                            **answer})
    return out


def outsider_parts(outsider: Outsider, manifest: dict, numel: int) -> list[dict]:
    """Signed as itself, for the manifest's round (the outsider is no member of it)."""
    out = []
    for shard, owner, endpoint, _ in _targets(manifest):
        answer = outsider.send_part(endpoint, _header(manifest, manifest["round"], shard, 1e12),
                                    _ones(manifest, shard, numel), outsider.signer)
        out.append({"attack": "nonmember", "owner": owner, "round": manifest["round"], **answer})
    return out


def bomb_parts(outsider: Outsider, manifest: dict) -> list[dict]:
    """A few KB of zstd declaring 2**28 codes, as a part signed by the outsider and as one under a member's id."""
    blob, out = bomb(2**28), []
    for shard, owner, endpoint, victim in _targets(manifest):
        for sender in (None, victim):
            header = {**_header(manifest, manifest["round"], shard, 1.0), "codec": "uint8"}
            answer = outsider.send_part(endpoint, header, blob, outsider.signer, sender, first_bytes=4096)
            out.append({"attack": "bomb", "owner": owner, "as_member": sender is not None, **answer})
    return out


def outsider_manifests(outsider: Outsider, manifest: dict, ahead: int = 3) -> list[dict]:
    """Manifests of the next ``ahead`` rounds, written by the outsider, naming itself the only owner: stored
    in the DHT and posted to every member, signed by the outsider (a round's leader posts its manifest)."""
    me = outsider.identity.peer_id
    members = sorted({me, *manifest["members"]})
    endpoints = {**manifest["endpoints"], me: outsider.endpoint}
    out = []
    for round_ in range(manifest["round"] + 1, manifest["round"] + 1 + ahead):
        forged = {**manifest, "round": round_, "epoch_rounds": 1, "leader": me, "members": members,
                  "endpoints": {m: endpoints[m] for m in members}, "owners": [me], "contributors": []}
        outsider.control.publish_manifest(GROUP, round_, forged, ttl=120.0)
        out.append({"attack": "manifest", "round": round_, "status": "PUBLISHED"})
        post = post_request(outsider.signer, outsider.run, MANIFEST, GROUP, round_,
                            outsider.control.manifest_record(forged))
        for member in manifest["members"]:
            try:
                outsider.channels.stub(manifest["endpoints"][member]).Wake(post, timeout=CALL_S)
                status = "POSTED"
            except grpc.RpcError as e:
                status = e.code().name
            out.append({"attack": "manifest", "round": round_, "member": member, "status": status})
    return out


def sybil_records(outsider: Outsider, manifest: dict, ahead: int = 3) -> list[dict]:
    """Each sybil votes a φ hash of its own for the coming rounds and says it trains one round ahead of
    the swarm at the outsider's endpoint, which serves a poisoned state."""
    out = []
    for control in outsider.sybil_controls:
        me = control.identity.peer_id
        control.publish_peer(PeerRecord(me, outsider.endpoint, state="training", round=manifest["round"] + 1,
                                        throughput=1e9), ttl=60.0)  # outlives a stalled attack loop
        for round_ in range(manifest["round"], manifest["round"] + 1 + ahead):
            control.publish_phi_hash(GROUP, round_, "f" * 64, ttl=120.0)
        out.append({"attack": "sybil", "sybil": me, "round": manifest["round"], "status": "PUBLISHED"})
    return out


def _stream(outsider: Outsider, endpoint: str, manifest: dict, shard: int, round_: int, signer: Signer,
            release: threading.Event):
    """A Reduce stream of one signed first chunk that then stays open until ``release``, with an hour's deadline."""
    fields = {**_header(manifest, round_, shard, 1.0), "sender": signer.peer_id, "total_bytes": 4,
              "digest": digest(bytes(4)), "pieces": 0, "piece_elems": 0, "norm": 0.0}
    first = wire_pb2.ReduceChunk(**fields)
    first.sender_key, first.signature = signer.sign(KIND, fields)

    def chunks():
        yield first
        release.wait(CALL_S)

    return outsider.channels.stub(endpoint).Reduce(chunks(), timeout=3600.0)


def _first_answer(call) -> tuple[str, str]:
    try:
        reply = next(iter(call))
        return wire_pb2.ReduceReply.Status.Name(reply.status), reply.error[:200]
    except grpc.RpcError as e:
        return e.code().name, (e.details() or "")[:200]
    except StopIteration:
        return "NO_REPLY", ""
    finally:
        call.cancel()


def far_future_streams(outsider: Outsider, manifest: dict, keys: list[Signer]) -> list[dict]:
    """A stream per fresh key at every owner naming a round 10**6 ahead, each cancelled once answered."""
    release, out = threading.Event(), []
    calls = [(owner, _stream(outsider, endpoint, manifest, shard, manifest["round"] + 10**6, signer, release))
             for shard, owner, endpoint, _ in _targets(manifest) for signer in keys]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        answers = [pool.submit(_first_answer, call) for _, call in calls]
        try:
            for (owner, _), future in zip(calls, answers):
                status, error = future.result(timeout=CALL_S + 5)
                out.append({"attack": "flood", "far": True, "owner": owner, "status": status, "error": error})
        finally:
            release.set()
    return out


def stream_flood(outsider: Outsider, keys: list[Signer], stop: threading.Event, log, owners: int,
                 per_key: int = 4) -> list[threading.Thread]:
    """Keeps ``per_key`` streams per fresh key open at each of the first ``owners`` owners of the newest
    manifest, each naming one of the two rounds after it (within an owner's reach, so it waits for that
    round's slot); a stream that ends is logged and sent again, naming the rounds after the newest
    manifest by then. Returns the threads, which end once ``stop`` is set."""
    release = threading.Event()

    def keep_one(owner_index: int, signer: Signer, i: int) -> None:
        while not stop.is_set():
            manifest = outsider.newest_manifest()
            if manifest is None or owner_index >= len(manifest["owners"]):
                stop.wait(0.2)
                continue
            shard, owner, endpoint, _ = list(_targets(manifest))[owner_index]
            round_ = manifest["round"] + 1 + i % 2
            status, error = _first_answer(_stream(outsider, endpoint, manifest, shard, round_, signer, release))
            log([{"attack": "flood", "far": False, "owner": owner, "round": round_, "status": status,
                  "error": error}])
        release.set()

    threads = [threading.Thread(target=keep_one, args=(o, signer, i), daemon=True)
               for o in range(owners) for signer in keys for i in range(per_key)]
    for t in threads:
        t.start()
    return threads


# ---- the program ---------------------------------------------------------------------------------


def attack_rounds(outsider: Outsider, flood_keys: list[Signer], run_dir: Path, until: float, log) -> None:
    """One of every other attack per round the swarm starts, and the stream flood from the end of the
    first round's attacks on, until the stop file or ``until``."""
    stop_file, stop = run_dir / "outsider.stop", threading.Event()
    numel, attacked, flood = None, set(), []
    try:
        while not stop_file.exists() and time.monotonic() < until:
            manifest = outsider.newest_manifest()
            if manifest is None or manifest["round"] in attacked:
                stop.wait(0.2)  # the next round's manifest is not written yet
                continue
            attacked.add(manifest["round"])
            if numel is None:
                numel = outsider.copy_state(manifest["endpoints"][manifest["owners"][0]])
                log([{"attack": "copied_state", "numel": numel, "status": "OK"}])
            with ThreadPoolExecutor(max_workers=6) as pool:
                jobs = [pool.submit(forged_parts, outsider, manifest, numel),
                        pool.submit(outsider_parts, outsider, manifest, numel),
                        pool.submit(bomb_parts, outsider, manifest),
                        pool.submit(outsider_manifests, outsider, manifest),
                        pool.submit(sybil_records, outsider, manifest),
                        pool.submit(far_future_streams, outsider, manifest, flood_keys)]
                for job in jobs:
                    try:
                        log(job.result())
                    except Exception as e:  # an attack that failed on the outsider's side is still recorded
                        log([{"attack": "error", "status": "ERROR", "error": f"{type(e).__name__}: {e}"[:300]}])
            if not flood:  # after one burst that no flood crowds out: every refusal's reason is seen once
                flood = stream_flood(outsider, flood_keys, stop, log, owners=len(manifest["owners"]))
    finally:
        stop.set()
        for t in flood:
            t.join(CALL_S + 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--deadline-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    until = time.monotonic() + args.deadline_s
    ready = args.run_dir / "coordinator.json"
    try:
        wait_until(ready.exists, args.deadline_s, "the swarm's coordinator.json")
    except AssertionError:
        return 2
    outsider = Outsider(json.loads(ready.read_text()))
    flood_keys = [Signer.generate() for _ in range(FLOOD_KEYS)]
    (args.run_dir / "outsider-ids.json").write_text(json.dumps({
        "outsider": outsider.identity.peer_id, "sybils": outsider.ids[1:], "flood": [k.peer_id for k in flood_keys]}))
    lock = threading.Lock()

    def log(rows: list[dict]) -> None:
        with lock, open(args.run_dir / "outsider.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps({"t": time.time(), **row}) + "\n")

    try:
        attack_rounds(outsider, flood_keys, args.run_dir, until, log)
    finally:
        outsider.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
