"""A driver pushes its microbatches through the pipeline: each hop's peer picked by the SWARM router.

    forward  hops 1..S−1 (activations 8-bit blockwise, pipeline.activations)
    last hop: backward with the targets → loss and the gradient of its input
    backward hops S−1..1, each resending the hop's input and its output's gradient (stateless)

A hop that times out is retried on another replica of the stage. A replica that answers RETRY (it
has not read this driver's record of the run yet: runtime.stage_guard reads the DHT again within
0.25 s) is asked again after `RETRY_PAUSE_S`, up to `SAME_REPLICA_RETRIES` times in a hop, then
passed over for this hop, never banned. Any other failure (the peer is gone, moved to another
stage, or refused the call) bans that peer until the expiry its DHT record had at that moment. A
stage with no replica left is waited for (it is being rebuilt or a peer is moving there) up to
`pipeline.stage_wait_s`, then the microbatch is dropped with a clear error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from lowcomm.pipeline.activations import pack_tokens
from lowcomm.pipeline.routing import BACKWARD, FORWARD, StageRouter
from lowcomm.pipeline.stages import Hop, hop_order
from lowcomm.proto import wire_pb2
from lowcomm.transport.signing import Signer, sign_message
from lowcomm.transport.wire import Channels, Traffic, deadline_after

Reply = wire_pb2.StageReply
RETRY_PAUSE_S = 0.3  # longer than the stage guard's re-read interval (runtime.stage_guard.MISS_REFRESH_S)
SAME_REPLICA_RETRIES = 3


class StageUnavailable(RuntimeError):
    """No replica of a stage answered within pipeline.stage_wait_s."""


@dataclass(frozen=True)
class StageEntry:
    endpoint: str
    throughput: float
    expires_at: float  # time.monotonic() at which its DHT record expires, as last read


class Driver:
    def __init__(self, run: str, signer: Signer, stages: int, swap_ends: bool, router: StageRouter, channels: Channels,
                 traffic: Traffic, directory: Callable[[], dict[int, dict[str, StageEntry]]],
                 local: Callable[[], object | None], hop_timeout_s: float, stage_wait_s: float,
                 refresh_s: float, on_event: Callable[..., None], stop: threading.Event):
        self.run, self.signer, self.me, self.stages, self.swap_ends = run, signer, signer.peer_id, stages, swap_ends
        self.router, self.channels, self.traffic = router, channels, traffic
        self.directory, self.local = directory, local
        self.hop_timeout_s, self.stage_wait_s, self.refresh_s = hop_timeout_s, stage_wait_s, refresh_s
        self.on_event, self.stop = on_event, stop
        self.entries: dict[int, dict[str, StageEntry]] = {}
        self._refreshed = -float("inf")
        self.failures = 0

    # ---- one microbatch -----------------------------------------------------------------------

    def train(self, microbatch: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of one microbatch through every stage; the loss."""
        hops = hop_order(self.stages, microbatch, self.swap_ends)
        inputs = [pack_tokens(x)]
        for hop in hops[:-1]:
            reply = self._hop("StageForward", FORWARD, hop, microbatch, inputs[-1])
            inputs.append(reply.output)
        last = self._hop("StageBackward", BACKWARD, hops[-1], microbatch, inputs[-1], targets=pack_tokens(y))
        grad = last.output
        for hop, hop_input in zip(reversed(hops[:-1]), reversed(inputs[:-1])):
            grad = self._hop("StageBackward", BACKWARD, hop, microbatch, hop_input, grad_output=grad).output
        return last.loss

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]], wait_s: float | None = None) -> float:
        """Mean held-out loss of the stages' synced weights (φ), in the plain stage order; a stage with no
        replica is waited for up to `wait_s` (default pipeline.stage_wait_s)."""
        hops = hop_order(self.stages, 0, False)
        losses = []
        for x, y in batches:
            data = pack_tokens(x)
            for hop in hops[:-1]:
                data = self._hop("StageForward", FORWARD, hop, 0, data, use_phi=True, wait_s=wait_s).output
            losses.append(self._hop("StageForward", FORWARD, hops[-1], 0, data, targets=pack_tokens(y),
                                    use_phi=True, wait_s=wait_s).loss)
        return sum(losses) / len(losses)

    # ---- one hop, with retries ----------------------------------------------------------------

    def _hop(self, method: str, task: str, hop: Hop, microbatch: int, data, grad_output=None, targets=None,
             use_phi: bool = False, wait_s: float | None = None) -> wire_pb2.StageReply:
        call = wire_pb2.StageCall(run_id=self.run, stage=hop.stage, microbatch=microbatch, embed=hop.embed,
                                  head=hop.head, input=data, use_phi=use_phi, sender=self.me)
        if grad_output is not None:
            call.grad_output.CopyFrom(grad_output)
        if targets is not None:
            call.targets.CopyFrom(targets)
        sign_message(self.signer, method, call)  # stage servers serve only signed calls from the run's peers
        wait_s = self.stage_wait_s if wait_s is None else wait_s
        give_up = time.monotonic() + wait_s
        tried: set[str] = set()
        retries: dict[str, int] = {}
        self._refresh()
        while not self.stop.is_set():
            peer = self.router.pick(hop.stage, task, exclude=tried)
            if peer is None:
                if time.monotonic() > give_up:
                    raise StageUnavailable(f"no replica of stage {hop.stage} answered for {wait_s:.0f}s "
                                           "(pipeline.stage_wait_s)")
                tried.clear()
                self.stop.wait(min(1.0, self.refresh_s))  # the stage is being rebuilt or a peer is moving there
                self._refresh(force=True)
                continue
            entry = self.entries.get(hop.stage, {}).get(peer)
            if entry is None:
                tried.add(peer)
                continue
            t0 = time.perf_counter()
            try:
                reply = self._send(method, peer, entry, call)
            except grpc.RpcError as e:
                self.failures += 1
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    tried.add(peer)  # slow, not necessarily gone: another replica this time
                    self.on_event("hop_timeout", stage=hop.stage, target=peer)
                else:
                    self._ban(peer, entry, f"{e.code().name}")
                continue
            if reply.status == Reply.OK:
                self.router.report(peer, task, time.perf_counter() - t0)
                return reply
            self.failures += 1
            if reply.status == Reply.RETRY:
                retries[peer] = retries.get(peer, 0) + 1
                self.on_event("hop_retry", stage=hop.stage, target=peer, reason=reply.error[:120])
                if retries[peer] > SAME_REPLICA_RETRIES or time.monotonic() + RETRY_PAUSE_S > give_up:
                    tried.add(peer)
                else:
                    self.stop.wait(RETRY_PAUSE_S)
            elif reply.status == Reply.BUSY:
                tried.add(peer)
            else:
                self._ban(peer, entry, f"{Reply.Status.Name(reply.status)}: {reply.error[:120]}")
        raise StageUnavailable("the peer is stopping")

    def _send(self, method: str, peer: str, entry: StageEntry, call) -> wire_pb2.StageReply:
        local = self.local() if peer == self.me else None
        if local is not None:  # this peer's own stage: no wire
            return local.forward(call) if method == "StageForward" else local.backward(call)
        deadline = deadline_after(self.hop_timeout_s)
        self.traffic.count_sent(call, deadline)
        reply = getattr(self.channels.stub(entry.endpoint), method)(call, timeout=self.hop_timeout_s)
        self.traffic.count_received(reply, deadline)
        return reply

    def _ban(self, peer: str, entry: StageEntry, why: str) -> None:
        self.router.ban(peer, entry.expires_at)
        self.on_event("ban", target=peer, reason=why, seconds=round(max(0.0, entry.expires_at - time.monotonic()), 1))

    def _refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._refreshed < self.refresh_s:
            return
        self._refreshed = time.monotonic()
        self.entries = self.directory()
        for stage in range(self.stages):
            peers = self.entries.get(stage, {})
            self.router.update_peers(stage, {p: e.throughput for p, e in peers.items()})
