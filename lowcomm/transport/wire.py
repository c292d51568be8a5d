"""gRPC plumbing for the data plane: the server, channels with deadlines, chunked blobs, byte counting.

Every message a peer sends (requests it makes and replies it serves) is counted in `traffic`, at
its protobuf size plus gRPC's 5-byte message frame, so reports compare bytes on equal terms. A
peer with an emulated link (transport.shaper) also has every message paced there, at that same
size: `count_sent`/`count_received` for a single message, `sending`/`receiving` for a stream.
A message is counted when it enters the link, so a round's bytes include replies still crossing
the link when the sender's own round has ended (its receivers' rounds last until they arrive).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from concurrent import futures
from typing import Iterable, Iterator

import grpc

from lowcomm.proto import wire_pb2_grpc
from lowcomm.transport.shaper import LinkShaper

GRPC_FRAME_BYTES = 5  # compressed flag + length prefix of every gRPC message
MAX_CHUNK_BYTES = 4 << 20  # hard cap on one message, whatever the config says


class WireError(RuntimeError):
    """A malformed or oversized message, or a stream that broke its own header."""


class Traffic:
    """Thread-safe byte counters for one process, and its emulated link (None: unshaped, no waits).

    `deadline` is in time.monotonic() seconds: no pacing wait outlasts it.
    """

    def __init__(self, link: LinkShaper | None = None):
        self._lock = threading.Lock()
        self.link = link
        self.sent = 0
        self.received = 0
        self.checkpoint_sent = 0  # state served to the coordinator's checkpointer: not training traffic

    def count_sent(self, message, deadline: float | None = None) -> None:
        """One message on its own (a unary request or reply): counted, then paced."""
        size = message.ByteSize() + GRPC_FRAME_BYTES
        with self._lock:
            self.sent += size
        if self.link is not None:
            self.link.sender().send(size, deadline)

    def count_received(self, message, deadline: float | None = None) -> None:
        size = message.ByteSize() + GRPC_FRAME_BYTES
        with self._lock:
            self.received += size
        if self.link is not None:
            self.link.receiver().receive(size, deadline)

    def sending(self, messages: Iterable, deadline: float | None = None, *, checkpoint: bool = False) -> Iterator:
        """The messages of one outgoing stream, each counted and paced before it is passed on.

        ``checkpoint``: the stream feeds the coordinator's checkpoints; its bytes are paced like any
        others but counted in ``checkpoint_sent``, apart from the training traffic in ``sent``.
        """
        flow = self.link.sender() if self.link is not None else None
        for message in messages:
            size = message.ByteSize() + GRPC_FRAME_BYTES
            with self._lock:
                if checkpoint:
                    self.checkpoint_sent += size
                else:
                    self.sent += size
            if flow is not None:
                flow.send(size, deadline)
            yield message

    def receiving(self, messages: Iterable, deadline: float | None = None) -> Iterator:
        """The messages of one incoming stream, each counted and paced before it is passed on."""
        flow = self.link.receiver() if self.link is not None else None
        for message in messages:
            size = message.ByteSize() + GRPC_FRAME_BYTES
            with self._lock:
                self.received += size
            if flow is not None:
                flow.receive(size, deadline)
            yield message


def deadline_after(timeout: float | None) -> float | None:
    """A gRPC timeout (seconds from now) as a monotonic deadline for pacing waits."""
    return None if timeout is None else time.monotonic() + timeout


def context_deadline(context) -> float | None:
    """A served call's deadline as a monotonic deadline (None when the caller set none)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e7 else time.monotonic() + remaining


def channel_options(chunk_bytes: int) -> list[tuple[str, int]]:
    limit = min(chunk_bytes, MAX_CHUNK_BYTES) + (64 << 10)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
            ("grpc.enable_retries", 0), ("grpc.so_reuseport", 0)]


def start_server(servicer: wire_pb2_grpc.PeerServicer, host: str, port: int, chunk_bytes: int,
                 max_workers: int = 64) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                         options=channel_options(chunk_bytes))
    wire_pb2_grpc.add_PeerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}; pick another --port")
    server.start()
    return server, bound


class Channels:
    """One cached channel and stub per endpoint, for the endpoints this peer chose to dial; `once` for
    an endpoint somebody else named (a dial-back), which is never cached. With ``max_channels``, the
    least recently used channel is closed once more are open (a call still on it ends CANCELLED)."""

    def __init__(self, chunk_bytes: int, max_channels: int | None = None):
        self._options = channel_options(chunk_bytes)
        self.max_channels = max_channels
        self._stubs: OrderedDict[str, wire_pb2_grpc.PeerStub] = OrderedDict()
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def stub(self, endpoint: str) -> wire_pb2_grpc.PeerStub:
        with self._lock:
            if endpoint in self._stubs:
                self._stubs.move_to_end(endpoint)
                return self._stubs[endpoint]
            channel = grpc.insecure_channel(endpoint, options=self._options)
            self._channels[endpoint] = channel
            stub = self._stubs[endpoint] = wire_pb2_grpc.PeerStub(channel)
            while self.max_channels is not None and len(self._stubs) > self.max_channels:
                oldest, _ = self._stubs.popitem(last=False)
                self._channels.pop(oldest).close()
            return stub

    @contextlib.contextmanager
    def once(self, endpoint: str) -> Iterator[wire_pb2_grpc.PeerStub]:
        """A stub on a channel of its own, closed on exit."""
        channel = grpc.insecure_channel(endpoint, options=self._options)
        try:
            yield wire_pb2_grpc.PeerStub(channel)
        finally:
            channel.close()

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()


def slices(blob: bytes, chunk_bytes: int) -> Iterator[bytes]:
    """The blob cut into chunk-sized views; an empty blob still yields one (empty) chunk."""
    step = max(1, min(chunk_bytes, MAX_CHUNK_BYTES))
    view = memoryview(blob)
    if not blob:
        yield b""
    for start in range(0, len(blob), step):
        yield bytes(view[start:start + step])


def assemble(first_total: int, datas: Iterable[bytes], max_bytes: int) -> bytes:
    """Joins streamed chunks, refusing a declared or actual size above `max_bytes`, a short stream, or
    an empty chunk after the first (`slices` never sends one), so a stream holds at most one chunk per
    declared byte and an endless trickle of empty chunks is refused at its second chunk."""
    if first_total > max_bytes:
        raise WireError(f"declared size {first_total} bytes exceeds the limit of {max_bytes}")
    out = bytearray()
    for i, data in enumerate(datas):
        if i and not data:
            raise WireError(f"empty chunk {i} in a stream of {first_total} bytes")
        out += data
        if len(out) > first_total:
            raise WireError(f"stream carries more than its declared {first_total} bytes")
    if len(out) != first_total:
        raise WireError(f"stream ended after {len(out)} of its declared {first_total} bytes")
    return bytes(out)
