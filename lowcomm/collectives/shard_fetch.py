"""A member's side of reading a reduced shard: an owner's reply, a hole filled from another member that
holds the shard, and a round this peer was left out of caught up from its members.

Every request names the manifest the round follows (`Manifest.digest`): a member holding the shard
under another manifest of the round (a split) does not serve it. A member that no longer holds the
round (held_shards.KEEP_ROUNDS, HOLD_S) says so at once (EXPIRED), and a catch-up every member
answered so fails at once instead of at its deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from lowcomm.collectives.base import CollectiveError, GroupKey, RoundResult
from lowcomm.collectives.manifest_record import Manifest
from lowcomm.collectives.pieces import Sink, Superseded, read_pieces
from lowcomm.collectives.reduce_owner import ContributionRejected
from lowcomm.proto import wire_pb2
from lowcomm.transport.wire import WireError, assemble

logger = logging.getLogger(__name__)
OK = wire_pb2.ReduceReply.OK
ASK_WAIT_S = 5.0  # how long one ask of a catch-up waits for a member to hold the shard
RETRY_S = 0.2  # the pause after a round of asks that all failed without waiting
CATCH_UP_STREAMS = 8  # shards a catch-up fetches at once


class ShardExpired(CollectiveError):
    """The asked member no longer holds the round (held_shards.KEEP_ROUNDS, HOLD_S): asking again is no use."""


def _unexpired(replies):
    """``replies`` unchanged, unless the first says the round is forgotten there (ShardExpired)."""
    for i, reply in enumerate(replies):
        if i == 0 and reply.status == wire_pb2.ReduceReply.EXPIRED:
            raise ShardExpired(reply.error[:200])
        yield reply


@dataclass
class ShardReply:
    values: torch.Tensor
    contributors: list[str]
    blob: bytes


class ShardFetching:
    """The reading half of collectives.sharded_reduce.ShardedReduce (a mixin: it uses the collective's
    channels, traffic, combiner, slots and settings)."""

    def _read_reply(self, stream, shard: int, bounds: tuple[int, int], members: int, deadline: float,
                    own_part: bytes | None = None, out: Sink | None = None) -> ShardReply:
        """An owner's or holder's reply → the shard's values; ``own_part``: what this member sent the owner;
        ``out``: where a streamed shard's values go (else a tensor of their own)."""
        stream = _unexpired(self.traffic.receiving(stream, deadline))
        if self.streams:
            alias, out = out is not None, out if out is not None else Sink(torch.empty(bounds[1] - bounds[0]))
            values = self.held_as_values()  # a lossless codec's shard is held as its values (held_shards)
            try:
                pieces, contributors = read_pieces(stream, self.codec, bounds[1] - bounds[0], self.elems, out,
                                                   keep=values is None)
            except ContributionRejected as e:
                raise CollectiveError(f"owner of shard {shard}: {e}") from None
            return ShardReply(out.values, contributors, pieces if values is None else values(out.values, alias))
        first, datas = None, []
        for reply in stream:
            if first is None:
                first = reply
                if reply.status != OK:
                    raise CollectiveError(f"owner of shard {shard} refused: {reply.error}")
            datas.append(reply.data)
        if first is None:
            raise CollectiveError(f"owner of shard {shard} sent no reply")
        blob = assemble(first.total_bytes, datas, self.combiner.max_reply_bytes(bounds, members))
        try:
            blob = self.combiner.complete(blob, self.me, own_part)  # what is held and served: the whole reply
            values = self.combiner.finish(blob, bounds)
        except ContributionRejected as e:
            raise CollectiveError(f"owner of shard {shard} replied with a bad aggregate: {e}") from None
        return ShardReply(values, list(first.contributors), blob)

    def catch_up(self, key: GroupKey, round_: int, numel: int, manifest: Manifest) -> RoundResult:
        """The result of a round this peer was left out of, fetched from the members that hold it. Every
        member keeps the round's encoded reduced shards (the bytes it applied), so a peer that announced
        too late applies exactly those: it loses its own part but stays on the shared φ for one round's
        download instead of the state's.

        The shards are fetched side by side, each asking its owner then the other members until the
        deadline: a round still reducing (a joiner fetching the round in flight) is waited for on every
        shard at once, not shard after shard."""
        t0 = time.monotonic()
        self.slots.reach(key.group, round_)
        deadline = t0 + self.sync.reduce_timeout_s + 2 * self.sync.manifest_s
        bounds = self.combiner.shard_bounds(len(manifest.owners), numel)
        fetch = _CatchUp(set(manifest.members) - {self.me}, deadline)

        def shard(j: int) -> ShardReply | None:
            while not fetch.over():
                reply = self._fill_hole(manifest, key, round_, j, bounds[j], ask_owner=True,
                                        wait_s=min(ASK_WAIT_S, fetch.remaining()), catching=fetch)
                if reply is not None:
                    return reply
                fetch.pause()
            return None

        workers = max(1, min(len(manifest.owners), CATCH_UP_STREAMS))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"catch-up-{round_}") as pool:
            replies = {j: r for j, r in enumerate(pool.map(shard, range(len(manifest.owners)))) if r is not None}
        missing = sorted(set(range(len(manifest.owners))) - set(replies))
        if missing:
            gone = ": every member forgot the round" if fetch.all_forgot() else fetch.reason(missing[0])
            raise CollectiveError(f"round {round_}: catching up, no member returned shards {missing}{gone}")
        for j, reply in replies.items():
            self.slots.hold(key.group, round_, j, reply.blob, reply.contributors, manifest.digest)
        contributors = sorted(set.intersection(*(set(r.contributors) for r in replies.values())))
        aggregate = torch.cat([replies[j].values for j in range(len(manifest.owners))])
        return RoundResult(aggregate, contributors, list(manifest.members),
                           {"manifest_s": 0.0, "reduce_s": time.monotonic() - t0, "leader": manifest.leader,
                            "epoch": manifest.round, "caught_up": True, "record": {"owners": list(manifest.owners)}})

    def _fill_hole(self, manifest: Manifest, key: GroupKey, round_: int, shard: int, bounds: tuple[int, int],
                   ask_owner: bool = False, wait_s: float = 1.0, out: Sink | None = None,
                   catching: "_CatchUp | None" = None):
        """Shard ``shard`` from its owner (``ask_owner``) or another member that holds it, else None;
        ``catching``: the catch-up this ask is part of, told who forgot the round and why others refused."""
        owner = manifest.owners[shard]
        askable = [owner] if ask_owner else []
        askable += [m for m in manifest.members if m not in (self.me, owner)]
        for member in askable:
            request = wire_pb2.ShardRequest(run_id=key.run, group=key.group, round=round_, shard=shard, wait_s=wait_s,
                                            manifest=manifest.digest)
            call_deadline = time.monotonic() + self.sync.manifest_s + wait_s
            self.traffic.count_sent(request, call_deadline)
            try:
                stub = self.channels.stub(manifest.endpoints[member])
                replies = stub.GetShard(request, timeout=max(0.1, call_deadline - time.monotonic()))
                return self._read_reply(replies, shard, bounds, len(manifest.members), call_deadline, out=out)
            except Superseded:
                raise
            except ShardExpired as e:
                logger.info("round %d: %s no longer holds shard %d: %s", round_, member, shard, e)
                if catching is not None:
                    catching.forgot(member)
            except (grpc.RpcError, CollectiveError, WireError) as e:
                logger.info("round %d: %s could not fill shard %d: %s", round_, member, shard, e)
                if catching is not None:
                    catching.refused(shard, member, _short(e))
        return None


def _short(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {(error.details() or '')[:120]}"
    return str(error)[:160]


class _CatchUp:
    """A catch-up's shared state across its shard fetches: the deadline, the members that forgot the
    round (every one of them: give up at once) and why each shard's last asks failed."""

    def __init__(self, others: set[str], deadline: float):
        self.others, self.deadline = others, deadline
        self._lock = threading.Lock()
        self._forgot: set[str] = set()
        self._why: dict[int, dict[str, str]] = {}
        self._stop = threading.Event()
        if not others:  # nobody to ask
            self._stop.set()

    def forgot(self, member: str) -> None:
        with self._lock:
            self._forgot.add(member)
            if self._forgot >= self.others:
                self._stop.set()

    def all_forgot(self) -> bool:
        with self._lock:
            return self._forgot >= self.others

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def over(self) -> bool:
        return self._stop.is_set() or self.remaining() <= 0

    def pause(self) -> None:
        """Between two rounds of asks that all failed at once (refusals, not waits)."""
        self._stop.wait(min(RETRY_S, self.remaining()))

    def refused(self, shard: int, member: str, why: str) -> None:
        with self._lock:
            self._why.setdefault(shard, {})[member] = why

    def reason(self, shard: int) -> str:
        """Each member's last refusal of ``shard``, as the end of the catch-up's error; "" if none."""
        with self._lock:
            why = dict(self._why.get(shard, {}))
        return (" (shard %d: %s)" % (shard, "; ".join(f"{m[:12]}: {e}" for m, e in sorted(why.items())))) if why else ""
