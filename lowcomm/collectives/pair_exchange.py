"""NoLoCo's pair exchange over gRPC: each member trades its contribution with its group only.

    manifest = the round's agreed members (collectives.manifest; no global all-reduce follows)
    groups   = grouping(run, round, paired members)   # identical on every member: same manifest
    push my tensors to each group-mate (Exchange RPC), collect theirs until the deadline

The deadline is ``sync.reduce_timeout_s`` after this member read the manifest, and nothing waits
past it: a mate whose contribution has not arrived by then is left out of this member's update
(the algorithm then averages over what arrived, itself always included), a push that no mate
took by then is abandoned. So a dead or stalled partner costs its mates one deadline and no
more; nobody waits on anyone but its own group, so no round can deadlock.

Pushes are retried (with back-off, until the deadline) while the mate is unreachable or answers
NOT_READY. Each push is signed by its sender's key over its header and digest (transport.signing)
and refused unless the signature holds. The mate's side is ``pair_inbox.Inbox``: it buffers contributions that arrive before
it read the manifest, and refuses stale, future, replayed and non-mate ones; ``pair_payload``
checks the bytes against the model. Every refusal is counted (``rejected``) and reported through
``on_event("reject", ...)``; none reaches the caller as an exception.

Membership: client-mode members (``manifest.owners`` leaves them out) cannot be dialled, so they
cannot receive pushes: they are not paired and update as a group of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch

from lowcomm.collectives.base import Collective, CollectiveError, FutureHandle, GroupKey, RoundResult
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.pair_inbox import Inbox, InboxFull
from lowcomm.collectives.pair_payload import TensorListFormat
from lowcomm.collectives.reduce_owner import ContributionRejected
from lowcomm.collectives.config import SyncConfig
from lowcomm.proto import wire_pb2
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer, Unauthenticated, Verifier, check_digest, digest
from lowcomm.transport.wire import Channels, Traffic, WireError, assemble, slices

logger = logging.getLogger(__name__)
Reply = wire_pb2.ExchangeReply
Grouping = Callable[[str, int, Sequence[str]], dict[str, tuple[str, ...]]]
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0
MAX_SENDER_CHARS = 128


@dataclass
class ExchangeResult:
    """One member's round: its group, the mates' tensors that arrived in time, who took part."""

    me: str
    group: tuple[str, ...]
    received: dict[str, list[torch.Tensor]]
    contributors: list[str]  # the group members whose tensors are in this member's update (itself included)
    participants: list[str]  # the round's manifest members
    info: dict = field(default_factory=dict)

    def norm(self) -> float | None:
        """RoundResult.norm's counterpart: None, there is no one aggregate (each member mixes its own group's)."""
        return None


def pairing_digest(groups: dict[str, tuple[str, ...]]) -> str:
    """A short hash of a round's whole pairing: equal on two members iff they paired identically."""
    text = json.dumps(sorted(set(groups.values())), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PairExchange(Collective):
    """A peer's pair exchange: ``start(key, round, tensors).result(timeout)`` → ``ExchangeResult``."""

    def __init__(self, signer: Signer, service: PeerService, channels: Channels, traffic: Traffic,
                 agreement: ManifestAgreement, sync: SyncConfig, codec: str, shapes: Sequence[tuple[int, ...]],
                 grouping: Grouping, on_event=None):
        self.me = signer.peer_id
        self.signer = signer
        self.verifier = Verifier()
        self.channels = channels
        self.traffic = traffic
        self.agreement = agreement
        self.sync = sync
        self.format = TensorListFormat(codec, shapes, sync.zstd_level)
        self.grouping = grouping
        self.inbox = Inbox(self.me)
        self.on_event = on_event or (lambda kind, **fields: None)
        self.before_send = None  # fault-injection hook for tests: called with the round after the manifest
        self.rejected = 0
        self._lock = threading.Lock()
        self._rounds = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pair-round")
        self._pushes = ThreadPoolExecutor(max_workers=32, thread_name_prefix="pair-push")  # apart: a round waits on them
        service.exchange_handler = self._serve
        service.exchange_cap_s = sync.reduce_timeout_s + sync.manifest_s

    # ---- the caller's side ----------------------------------------------------------------

    def start(self, key: GroupKey, round_: int, tensors: Sequence[torch.Tensor], weight: float = 1.0,
              donate: bool = False) -> FutureHandle:
        """``tensors``: this member's contribution, shaped as ``shapes``. NoLoCo's mean is unweighted; the
        group's mean is a tensor of its own (``donate`` changes nothing)."""
        tensors = [t.detach().to("cpu", torch.float32) for t in tensors]
        channel = (key.run, key.group)
        self.inbox.enter(channel, round_)  # before announcing: a fast mate's push is buffered, not refused
        return FutureHandle(self._rounds.submit(self._run, key, round_, tensors))

    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest) -> RoundResult:
        """No round result exists to fetch: each group averages apart (NoLoCo catches up alone)."""
        raise CollectiveError(f"round {round_}: a pair exchange has no round result to catch up on")

    def _run(self, key: GroupKey, round_: int, tensors: list[torch.Tensor]) -> ExchangeResult:
        channel = (key.run, key.group)
        try:
            t0 = time.monotonic()
            blob = self.format.encode(tensors)  # while the DHT agrees, not inside the exchange's deadline
            manifest = self.agreement.agree(key.group, round_, 1, self.format.codec_name)
            if self.before_send is not None:
                self.before_send(round_)
            t_manifest = time.monotonic()
            deadline = t_manifest + self.sync.reduce_timeout_s
            paired = [m for m in manifest.members if m in manifest.owners]
            groups = self.grouping(key.run, round_, paired) if paired else {}
            group = tuple(groups.get(self.me, (self.me,)))
            mates = [p for p in group if p != self.me]
            for sender in self.inbox.set_mates(channel, round_, frozenset(mates)):
                self._count_reject(round_, sender, "not in this peer's group (buffered before the manifest)")
            pushes = {mate: self._pushes.submit(self._push, manifest.endpoints[mate], key, round_, blob, deadline)
                      for mate in mates}
            received = self.inbox.take(channel, round_, deadline)
            pushed = {}
            for mate, future in pushes.items():
                try:
                    pushed[mate] = future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
                except Exception as e:  # dead, stalled or refusing: its mates update without it
                    pushed[mate] = f"failed: {str(e)[:120]}"
            missing = [m for m in mates if m not in received]
            if missing:
                self.on_event("timeout", round=round_, stage="exchange", missing=missing)
            contributors = [p for p in group if p == self.me or p in received]
            record = {"group": list(group), "pairing": pairing_digest(groups) if groups else None,
                      "received_from": sorted(received), "pushed": pushed}
            return ExchangeResult(self.me, group, received, contributors, list(manifest.members), {
                "manifest_s": t_manifest - t0, "exchange_s": time.monotonic() - t_manifest,
                "leader": manifest.leader, "trained_members": len(manifest.members), "record": record})
        finally:
            self.inbox.close(channel, round_)

    def _push(self, endpoint: str, key: GroupKey, round_: int, blob: bytes, deadline: float) -> str:
        """Streams the blob to a mate until it takes it; retries while it is unreachable or not ready."""
        stub, wait_s = self.channels.stub(endpoint), RETRY_FIRST_S
        header = dict(run_id=key.run, group=key.group, round=round_, sender=self.me, codec=self.format.codec_name,
                      total_bytes=len(blob), digest=digest(blob))
        sender_key, signature = self.signer.sign("exchange", header)

        def chunks():
            for i, data in enumerate(slices(blob, self.sync.chunk_bytes)):
                if i == 0:
                    yield wire_pb2.ExchangeChunk(**header, data=data, sender_key=sender_key, signature=signature)
                else:
                    yield wire_pb2.ExchangeChunk(data=data)

        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"round {round_}: {endpoint} did not take the contribution by the deadline")
            try:
                reply = stub.Exchange(self.traffic.sending(chunks(), deadline), timeout=remaining)
                self.traffic.count_received(reply, deadline)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:  # not listening (yet): try again
                    raise
            else:
                if reply.status in (Reply.ACCEPTED, Reply.BUFFERED):
                    return Reply.Status.Name(reply.status).lower()
                if reply.status == Reply.REJECTED:
                    raise ContributionRejected(f"refused by {endpoint}: {reply.error}")
            time.sleep(max(0.0, min(wait_s, deadline - time.monotonic())))
            wait_s = min(2 * wait_s, RETRY_MAX_S)

    # ---- the receiver's side --------------------------------------------------------------

    def _serve(self, requests, context) -> wire_pb2.ExchangeReply:
        first = next(requests, None)
        round_ = int(first.round) if first is not None else 0
        sender = first.sender[:MAX_SENDER_CHARS] if first is not None else ""
        try:
            if first is None:
                raise ContributionRejected("empty stream")
            if not first.sender or len(first.sender) > MAX_SENDER_CHARS:
                raise ContributionRejected("missing or oversized sender id")
            self.verifier.verify("exchange", _signed_header(first), first.sender, first.sender_key, first.signature)
            if first.codec != self.format.codec_name:
                raise ContributionRejected(f"codec {first.codec!r}, this run exchanges {self.format.codec_name!r}")
            channel = (first.run_id, first.group)
            self.inbox.admit(channel, round_, sender)
            blob = assemble(first.total_bytes, self._datas(first, requests), self.format.max_bytes)
            check_digest(blob, first.digest, sender)
            tensors = self.format.decode(blob)
            known = self.inbox.deliver(channel, round_, sender, tensors)
        except InboxFull as e:
            return Reply(status=Reply.NOT_READY, round=round_, error=str(e))
        except (ContributionRejected, Unauthenticated, WireError) as e:
            self._count_reject(round_, sender, str(e))
            return Reply(status=Reply.REJECTED, round=round_, error=str(e))
        return Reply(status=Reply.ACCEPTED if known else Reply.BUFFERED, round=round_)

    @staticmethod
    def _datas(first, requests):
        yield first.data
        for chunk in requests:
            yield chunk.data

    def _count_reject(self, round_: int, sender: str, error: str) -> None:
        with self._lock:
            self.rejected += 1
        logger.info("round %d: refused a contribution from %s: %s", round_, sender[:40], error)
        self.on_event("reject", method="Exchange", round=round_, sender=sender[:40], error=error[:200])


def _signed_header(first) -> dict:
    """The header fields of a contribution's first chunk that its signature covers (as `_push` signs them)."""
    return dict(run_id=first.run_id, group=first.group, round=first.round, sender=first.sender, codec=first.codec,
                total_bytes=first.total_bytes, digest=first.digest)
