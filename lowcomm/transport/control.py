"""The control plane on hivemind's DHT: run config, peer records, round announcements, manifests, φ hashes.

Every record lives under a subkey that carries its writer's `[owner:<public key>]` marker, so
transport.record_signing makes it writable by that key only; readers further check that a
record's `peer_id` field is the hash of that key, and drop (and count) anything else. The run
config is read only from the subkey of the coordinator's key given in the join command.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial

import hivemind
from hivemind.utils import get_dht_time

from lowcomm.transport import dht_stores
from lowcomm.transport.addresses import dht_maddrs
from lowcomm.transport.held_records import HeldRecords
from lowcomm.transport.identity import Identity, peer_id_of
from lowcomm.transport.peer_record import PeerRecord
from lowcomm.transport.record_fields import clean_stats

logger = logging.getLogger(__name__)
DHT_CALL_S = 30.0  # the longest one store or get may take
DHT_ALIVE_CHECK_S = 0.5  # while waiting on one, how often to check that the DHT's process still runs
JOIN_ATTEMPTS, JOIN_RETRY_S = 3, 2.0  # joining through initial peers: tries, and the pause before the n-th retry × n
RUNS_KEY = "lowcomm.runs"  # every coordinator's run name, so `status` can list the runs a DHT holds
MAX_RUN_NAME = 128
TOMBSTONE_MARGIN_S = 30.0  # how much longer than a record its tombstone lives
CLOCK_AHEAD_S = 300.0  # how far a writer's clock may run ahead of this node's before its record's life is refused
REPORTED = 4096  # the (writer, reason) pairs reported by `on_reject`, once each
# hivemind's caching, off: every read here asks for the latest records (latest=True), so a copy pushed to
# the nearest node after each read (cache_nearest) and the background re-reads of cached keys before they
# expire (cache_refresh_before_expiry) only cost traffic. Every node a store's or a read's search asks
# answers with all of the key's records it holds, stored or cached (about 1 KB each, mostly the owner's key
# and signature): a key's records go to its 3 nearest nodes (hivemind: 5) and a node keeps no copy of what
# it read (cache_locally), so fewer nodes answer with them. A record is stored again at least every half
# of its lifetime, so fewer copies lose none (experiments/dht_call_bytes.py, docs/scale.md)
DHT_TRAFFIC = {"cache_nearest": 0, "cache_refresh_before_expiry": 0, "cache_locally": False, "num_replicas": 3}


class ConfigRejected(RuntimeError):
    """No run config signed by the expected coordinator key was found in the DHT, or it was unusable."""


class DHTUnreachable(RuntimeError):
    """This node could not start or reach any of its initial peers."""


@dataclass(frozen=True)
class SignedConfig:
    """The run config record as the coordinator's key signed it; the runtime parses and checks `text`."""

    text: str  # the run config's canonical JSON
    hash: str  # what the coordinator says the config hashes to
    version: int
    epoch: float  # the DHT time the run started


class ControlPlane:
    """One peer's (or the coordinator's) view of the run's DHT records."""

    def __init__(self, dht: hivemind.DHT, identity: Identity, run: str):
        self.dht = dht
        self.identity = identity
        self.run = run
        self.rejected_records = 0
        self.run_epoch = 0.0  # from the run config's record (fetch_config)
        self.calls: Counter[str] = Counter()  # "store peers", "get announce", ...: this node's DHT calls by kind
        self.searches: Counter[str] = Counter()  # "store peers", ...: the calls among them that searched the DHT
        self._peers_held = HeldRecords()  # the peer records read so far, until they expire
        self.max_record_ttl_s: float | None = None  # sync.record_ttl_s: a peer record claiming more is refused
        self.on_reject = lambda writer, reason: None  # a record refused: once per writer and reason
        self._reported: set[tuple[str, str]] = set()
        self._refusals = threading.Lock()

    @classmethod
    def start(cls, identity: Identity, run: str, initial_peers: list[str] | None = None,
              host: str = "127.0.0.1", port: int = 0, announce: str | None = None) -> "ControlPlane":
        """A DHT node listening on `host:port` (0: a free port) that announces what others dial:
        `announce`'s host (HOST[:PORT], as --announce-addr), else `host`, else, for 0.0.0.0, this
        machine's primary address (transport.addresses)."""
        attempts = JOIN_ATTEMPTS if initial_peers else 1
        for attempt in range(1, attempts + 1):
            try:
                host_maddrs, announce_maddrs = dht_maddrs(host, port, announce)
                dht = hivemind.DHT(initial_peers=initial_peers or [], host_maddrs=host_maddrs,
                                   announce_maddrs=announce_maddrs, record_validators=[identity.validator],
                                   start=True, **DHT_TRAFFIC)
                break
            except Exception as e:  # p2pd's and hivemind's own error types; the first line says what happened
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                if attempt < attempts:  # a daemon slow to start on a loaded host, a bootstrap peer busy
                    logger.warning("joining the DHT failed (%s); attempt %d of %d in %.0f s", reason, attempt + 1,
                                   attempts, JOIN_RETRY_S * attempt)
                    time.sleep(JOIN_RETRY_S * attempt)
                    continue
                where = f"through {', '.join(initial_peers)}" if initial_peers else f"on {host}:{port}"
                raise DHTUnreachable(f"could not join the DHT {where} ({reason}); check that the address is the "
                                     "coordinator's (or a peer's) and that its port is reachable from here") from e
        return cls(dht, identity, run)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def shutdown(self) -> None:
        self.dht.shutdown()

    def alive(self) -> bool:
        """Whether the DHT's process still runs (a signal to the whole process group ends it first)."""
        return self.dht.is_alive()

    def _wait(self, call):
        """``call()``'s future's result within DHT_CALL_S: a DHT process that died never answers, so its death
        ends the wait (DHTUnreachable), and no wait is endless."""
        if not self.dht.is_alive():
            raise DHTUnreachable("the DHT's process is gone")
        future = call()
        deadline = time.monotonic() + DHT_CALL_S
        while True:  # in slices: a DHT process that dies meanwhile (a stop signal to the group) ends the wait
            try:
                return future.result(timeout=max(0.0, min(DHT_ALIVE_CHECK_S, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if not self.dht.is_alive():
                    future.cancel()
                    raise DHTUnreachable("the DHT's process is gone") from None
                if time.monotonic() >= deadline:
                    future.cancel()
                    raise TimeoutError(f"the DHT did not answer within {DHT_CALL_S:.0f}s") from None

    # ---- generic signed records -------------------------------------------------------------

    def _kind(self, key: str) -> str:  # "peers", "announce", ...: a key's kind
        return key[len(self.run) + 1:].split(".", 1)[0] if key.startswith(f"{self.run}.") else key

    def _count(self, call: str, key: str) -> None:
        self.calls[f"{call} {self._kind(key)}"] += 1

    def _store(self, key: str, value: dict, ttl: float) -> bool:  # lives ``ttl`` seconds from now
        return self._store_until(key, value, get_dht_time() + ttl)

    def _store_until(self, key: str, value: dict, expiration: float) -> bool:
        """Stores this peer's record under ``key`` on the key's nearest nodes (transport.dht_stores)."""
        return bool(self._call("store", key, partial(dht_stores.store, key=key, subkey=self.identity.owner_marker,
                                                      value=value, expiration=expiration)))

    def _call(self, call: str, key: str, coroutine):
        """``coroutine``'s result from the DHT's process, the call counted (and, if it searched, the search)."""
        self._count(call, key)
        result, searched = self._wait(lambda: self.dht.run_coroutine(coroutine, return_future=True))
        if searched:
            self.searches[f"{call} {self._kind(key)}"] += 1
        return result

    def _expire(self, key: str, ttl: float) -> None:
        """Replaces this key's record with a tombstone that outlives it (readers drop ``gone`` records).
        A record cannot be deleted, and a DHT node keeps, per subkey, the value that expires last: an
        overwrite expiring sooner than the record loses to it, and the record lingers until its own
        expiration. The tombstone expires ``ttl`` (the record's lifetime) plus TOMBSTONE_MARGIN_S from
        now, later than the record and than a heartbeat that was already in flight."""
        self._store_until(key, {"peer_id": self.identity.peer_id, "gone": True},
                          get_dht_time() + ttl + TOMBSTONE_MARGIN_S)

    def _read(self, key: str) -> dict[str, dict]:
        """peer_id -> value for every well-formed record under `key` whose signer matches its peer_id."""
        return {p: value for p, (value, _) in self._read_entries(key).items() if not value.get("gone")}

    def _read_entries(self, key: str) -> dict[str, tuple[dict, float]]:
        """peer_id -> (value, expiration) of every well-formed record under `key`, tombstones included."""
        self._count("get", key)
        found = self._wait(lambda: self.dht.get(key, latest=True, return_future=True))
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            signer = peer_id_of(subkey) if isinstance(subkey, bytes) and subkey.startswith(b"[owner:") else None
            if signer is None or not isinstance(value, dict) or value.get("peer_id") != signer:
                self._refuse(signer or "?", "a record whose peer_id is not its signer's")
                logger.warning("dropped a record under %s whose signer does not match its peer_id", key)
                continue
            out[signer] = (value, float(getattr(item, "expiration_time", 0.0)))
        return out

    # ---- run config -------------------------------------------------------------------------

    def publish_config(self, text: str, config_hash: str, version: int, ttl: float, epoch: float = 0.0) -> None:
        """Signs and stores the run config's JSON `text`; `epoch`: the DHT time the run started (pipelines
        count their wall-clock rounds from it)."""
        value = {"peer_id": self.identity.peer_id, "version": version, "config": text,
                 "hash": config_hash, "epoch": epoch}
        if not self._store(f"{self.run}.config", value, ttl):
            raise RuntimeError("could not store the run config in the DHT")

    def fetch_config(self, coordinator_marker: bytes, timeout: float = 30.0) -> SignedConfig:
        """The run config record signed by the coordinator's key; refuses any other writer's config.

        Only the signature is checked here: the runtime parses the text (runtime.run_config) and
        checks it against its hash."""
        expected = peer_id_of(coordinator_marker)
        deadline = time.monotonic() + timeout
        others = set()
        while time.monotonic() < deadline:
            records = self._read(f"{self.run}.config")
            if expected in records:
                value = records[expected]
                text, config_hash, version = value.get("config"), value.get("hash"), value.get("version", 0)
                if not isinstance(text, str) or not isinstance(config_hash, str) or not isinstance(version, int):
                    raise ConfigRejected("the coordinator's run config record is malformed "
                                         "(config and hash must be strings, version an integer)")
                epoch = value.get("epoch", 0.0)
                self.run_epoch = float(epoch) if isinstance(epoch, (int, float)) and math.isfinite(epoch) else 0.0
                return SignedConfig(text, config_hash, version, self.run_epoch)
            others |= set(records)
            time.sleep(0.2)
        hint = (f" (configs signed by other keys were refused: {sorted(others)})" if others else "")
        raise ConfigRejected(
            f"no run config for run {self.run!r} signed by the coordinator key {expected} within {timeout:.0f}s"
            f"{hint}; check --coordinator and --run-key against the coordinator's printed join command")

    # ---- peers -------------------------------------------------------------------------------

    def publish_peer(self, record: PeerRecord, ttl: float) -> None:
        record.heartbeat = get_dht_time()
        self._store(f"{self.run}.peers", record.value(), ttl)

    def publish_stats(self, stats: dict, ttl: float) -> None:
        """What this peer has done so far, for status pages (runtime.observer), under a key of its own: the
        peer records that every round's agreement reads stay small, and these go out less often."""
        self._store(f"{self.run}.stats", {"peer_id": self.identity.peer_id, "stats": stats}, ttl)

    def live_stats(self) -> dict[str, dict]:
        """peer_id -> its latest stats, checked by clean_stats (a record that fails is dropped and counted)."""
        out = {}
        for peer_id, value in self._read(f"{self.run}.stats").items():
            try:
                out[peer_id] = clean_stats(value.get("stats"))
            except ValueError as e:
                self._refuse(peer_id, "malformed stats", str(e))
        return out

    def expire_peer(self, ttl: float) -> None:
        """Removes this peer's record at once; ``ttl``: the lifetime its records were published with."""
        self._expire(f"{self.run}.peers", ttl)

    def live_peers(self) -> dict[str, PeerRecord]:
        """The live peer records: a read's, and those earlier reads returned that have not expired since
        (a read can miss a node's records, transport.held_records)."""
        read = self._read_entries(f"{self.run}.peers")
        now = get_dht_time()  # after the read, which may take DHT_CALL_S
        if self.max_record_ttl_s is not None:
            latest = now + self.max_record_ttl_s + TOMBSTONE_MARGIN_S + CLOCK_AHEAD_S
            for writer in [w for w, (_, expiration) in read.items() if not expiration <= latest]:  # NaN too
                del read[writer]
                self._refuse(writer, "a peer record that claims to live longer than the run's record lifetime")
        out = {}
        for peer_id, value in self._peers_held.merge(read, now).items():
            try:
                out[peer_id] = PeerRecord.from_value(value)
            except (TypeError, ValueError) as e:
                self._refuse(peer_id, "a malformed peer record", str(e))
        return out

    def _refuse(self, writer: str, reason: str, detail: str = "") -> None:
        """Drops a record: counted each time, reported (`on_reject`) once per writer and reason, a fixed text
        (``detail``, which may quote the record, goes to the debug log only)."""
        logger.debug("refused a record of %s: %s %s", writer[:40], reason, detail[:200])
        with self._refusals:
            self.rejected_records += 1
            report = (writer, reason) not in self._reported and len(self._reported) < REPORTED
            if report:
                self._reported.add((writer, reason))
        if report:
            self.on_reject(writer, reason)

    # ---- the runs this DHT holds ---------------------------------------------------------------

    def publish_run_name(self, ttl: float) -> None:
        """The coordinator lists its run under RUNS_KEY (its own subkey)."""
        self._store(RUNS_KEY, {"peer_id": self.identity.peer_id, "run": self.run}, ttl)

    def runs_seen(self) -> list[str]:
        """The run names coordinators listed in this DHT (well-formed names only), sorted."""
        names = {v.get("run") for v in self._read(RUNS_KEY).values()}
        return sorted(n for n in names if isinstance(n, str) and 0 < len(n) <= MAX_RUN_NAME and n.isprintable())

    # ---- rounds ------------------------------------------------------------------------------

    def record(self, fields: dict) -> dict:
        """A record of this peer's holding ``fields`` (round posts send the records the DHT would hold)."""
        return {"peer_id": self.identity.peer_id, **fields}

    def announce(self, group: str, round_: int, info: dict, ttl: float) -> None:
        self._store(f"{self.run}.announce.{group}.{round_}", self.record(info), ttl)

    def announcers(self, group: str, round_: int) -> dict[str, dict]:
        return self._read(f"{self.run}.announce.{group}.{round_}")

    def manifest_record(self, manifest: dict) -> dict:
        return self.record({"manifest": json.dumps(manifest)})

    def publish_manifest(self, group: str, round_: int, manifest: dict, ttl: float) -> None:
        self._store(f"{self.run}.manifest.{group}.{round_}", self.manifest_record(manifest), ttl)

    def manifests(self, group: str, round_: int) -> dict[str, dict]:
        return self.parse_manifests(self._read(f"{self.run}.manifest.{group}.{round_}"))

    def parse_manifests(self, records: dict[str, dict]) -> dict[str, dict]:
        """writer -> manifest of the manifest records (the DHT's or posted) whose manifest names its writer
        as leader; any other is dropped and counted."""
        out = {}
        for writer, value in records.items():
            try:
                manifest = json.loads(value["manifest"])
            except (KeyError, TypeError, ValueError):
                self._refuse(writer, "a manifest record that does not parse")
                continue
            if isinstance(manifest, dict) and manifest.get("leader") == writer:
                out[writer] = manifest
            else:
                self._refuse(writer, "a manifest that does not name its writer as its leader")
        return out

    def publish_phi_hash(self, group: str, round_: int, phi_hash: str, ttl: float) -> None:
        self._store(f"{self.run}.phi.{group}.{round_}", {"peer_id": self.identity.peer_id, "hash": phi_hash}, ttl)

    def phi_hashes(self, group: str, round_: int) -> dict[str, str]:
        return {p: v["hash"] for p, v in self._read(f"{self.run}.phi.{group}.{round_}").items()
                if isinstance(v.get("hash"), str)}

    def publish_anchor(self, group: str, round_: int, anchor: dict, ttl: float) -> None:
        """The coordinator's signed anchor of ``round_`` (runtime.round_anchor says what it holds)."""
        self._store(f"{self.run}.anchor.{group}.{round_}", {"peer_id": self.identity.peer_id, **anchor}, ttl)

    def anchors(self, group: str, round_: int) -> dict[str, dict]:
        """signer -> anchor record of ``round_``; the reader picks the coordinator's."""
        return self._read(f"{self.run}.anchor.{group}.{round_}")
