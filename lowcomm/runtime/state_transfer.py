"""Global state as bytes: safetensors blobs, validated on receipt, served to joiners and resyncing peers.

A holder keeps one snapshot (round, blob); a request may ask for a minimum round and wait for the
holder to get there, so a joiner can start exactly at a round boundary (a request for a round past
any it can reach, without waiting, is answered with the round held: `held_round`). That wait lasts at most
`MAX_STATE_WAIT_S` and ends when the caller's call does; a wait_s that is not a finite number waits
for nothing (NaN would slip past both bounds and spin until the call ends). Received state is
checked against the model's expected tensor names and shapes, dtype float32 and finiteness before
any of it touches the model; its φ is checked against the run's agreed hash (`state_phi_hash`) by whoever
loads or keeps it (runtime.state_sync, runtime.coordinator).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lowcomm.algorithms.state import tensors_hash
from lowcomm.compress.finite import all_finite
from lowcomm.proto import wire_pb2
from lowcomm.transport.peer_record import MAX_COUNT
from lowcomm.transport.wire import Channels, Traffic, WireError, assemble, slices


PHI_PREFIXES = ("phi.", "param.")  # φ of the round-based algorithms; the parameters of ddp and DeMo
PROBE_ROUND = MAX_COUNT  # a round no holder reaches (none past it is any run's): its answer says the round held
MAX_STATE_WAIT_S = 120.0  # the longest a GetState call waits for the requested round
WAIT_SLICE_S = 1.0  # a waiting server thread looks at its call's state at least this often


class StateError(RuntimeError):
    """Received state is malformed or does not fit this run's model."""


@dataclass
class Snapshot:
    round: int
    tokens: int
    config_hash: str
    phi_hash: str
    blob: bytes


def encode_state(tensors: dict[str, torch.Tensor], round_: int, tokens: int, config_hash: str,
                 phi_hash: str) -> Snapshot:
    """`phi_hash` is the algorithm's hash of its global parameters (the drift check compares it)."""
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    blob = st_save(tensors, metadata={"round": str(round_), "tokens": str(tokens), "config_hash": config_hash,
                                      "phi_hash": phi_hash})
    return Snapshot(round_, tokens, config_hash, phi_hash, blob)


def decode_state(blob: bytes, expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    try:
        tensors = st_load(blob)
    except Exception as e:  # safetensors raises several types on garbage
        raise StateError(f"state is not a valid safetensors blob: {e}") from None
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise StateError(f"state tensors do not match the model (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != tuple(expected[name]):
            raise StateError(f"state tensor {name}: {tensor.dtype} {tuple(tensor.shape)}, expected float32 "
                             f"{tuple(expected[name])}")
        if not all_finite(tensor):
            raise StateError(f"state tensor {name} contains NaN or Inf")
    return tensors


def state_phi_hash(tensors: dict[str, torch.Tensor], names: list[str]) -> str:
    """The φ hash (`Replica.phi_hash`: algorithms.state.tensors_hash) of a state's global parameters:
    `phi.<name>`, else `param.<name>`, for each model parameter ``names`` in the model's order.

    The order comes from the model, never from the state: a sender that relabels two tensors of one
    shape cannot make their bytes hash as the agreed φ."""
    for prefix in PHI_PREFIXES:
        if all(prefix + name in tensors for name in names):
            return tensors_hash(tensors[prefix + name] for name in names)
    raise StateError(f"state holds no complete set of global parameters ({' or '.join(PHI_PREFIXES)}<name>)")


class StateHolder:
    """Serves the newest snapshot over GetState."""

    def __init__(self, run_id: str, chunk_bytes: int):
        self.run_id = run_id
        self.chunk_bytes = chunk_bytes
        self._snapshot: Snapshot | None = None
        self._cond = threading.Condition()

    def publish(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._snapshot = snapshot
            self._cond.notify_all()

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def serve(self, request, context):
        if request.run_id != self.run_id:
            yield wire_pb2.StateChunk(error=f"unknown run {request.run_id!r}")
            return
        wait_s = min(max(request.wait_s, 0.0), MAX_STATE_WAIT_S) if math.isfinite(request.wait_s) else 0.0
        deadline = time.monotonic() + wait_s
        context.add_callback(self._wake)
        with self._cond:
            while self._snapshot is None or self._snapshot.round < request.min_round:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not context.is_active():
                    have = -1 if self._snapshot is None else self._snapshot.round
                    yield wire_pb2.StateChunk(error=f"state at round {have}, below the requested {request.min_round}",
                                              round=max(have, 0))
                    return
                self._cond.wait(min(remaining, WAIT_SLICE_S))
            snap = self._snapshot
        for i, data in enumerate(slices(snap.blob, self.chunk_bytes)):
            if i == 0:
                yield wire_pb2.StateChunk(run_id=self.run_id, round=snap.round, config_hash=snap.config_hash,
                                          phi_hash=snap.phi_hash, total_bytes=len(snap.blob), data=data,
                                          tokens=snap.tokens)
            else:
                yield wire_pb2.StateChunk(data=data)


def held_round(channels: Channels, traffic: Traffic, endpoint: str, run_id: str, requester: str,
               timeout: float) -> int | None:
    """The round of the state the holder at ``endpoint`` serves now (0: none yet), from one header-only
    answer to a request for a round it cannot hold; None if it did not answer so. A peer record's round
    may be up to half its life old (docs/round-protocol.md, Decision 58): a joiner asks its source."""
    request = wire_pb2.StateRequest(run_id=run_id, requester=requester, min_round=PROBE_ROUND, wait_s=0.0)
    deadline = time.monotonic() + timeout
    traffic.count_sent(request, deadline)
    stream = None
    try:
        stream = channels.stub(endpoint).GetState(request, timeout=timeout)
        for chunk in traffic.receiving(stream, deadline):
            claimed = int(chunk.round) if chunk.error.startswith("state at round") else -1
            return claimed if 0 <= claimed < PROBE_ROUND else None  # a round past it: no run's, refused
    except grpc.RpcError:
        return None
    finally:
        if stream is not None:
            stream.cancel()
    return None


def download_state(channels: Channels, traffic: Traffic, endpoint: str, run_id: str, requester: str,
                   min_round: int, wait_s: float, timeout: float, max_bytes: int) -> wire_pb2.StateChunk:
    """The holder's state as a StateChunk whose `data` is the whole blob (validated by decode_state later)."""
    request = wire_pb2.StateRequest(run_id=run_id, requester=requester, min_round=min_round, wait_s=wait_s)
    deadline = time.monotonic() + timeout + wait_s
    traffic.count_sent(request, deadline)
    first, datas = None, []
    try:
        stream = channels.stub(endpoint).GetState(request, timeout=max(0.1, deadline - time.monotonic()))
        for chunk in traffic.receiving(stream, deadline):
            if first is None:
                if chunk.error:
                    raise StateError(f"{endpoint} refused state: {chunk.error}")
                first = chunk
            datas.append(chunk.data)
    except grpc.RpcError as e:
        raise StateError(f"state download from {endpoint} failed: {e.code().name}") from None
    if first is None:
        raise StateError(f"{endpoint} sent no state")
    try:
        blob = assemble(first.total_bytes, datas, max_bytes)
    except WireError as e:
        raise StateError(str(e)) from None
    header = wire_pb2.StateChunk()
    header.CopyFrom(first)
    header.data = blob
    return header
