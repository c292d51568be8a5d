"""Pulling a round post from its writer (`PeerService.GetPost`).

A writer posts its round records to the peers it knows of (transport.round_posts); a reader that no
post reached, such as a peer that joined after the writer posted, asks the writers it still misses
for their own signed posts instead of reading the DHT. An answer is kept only if its sender is the
writer asked, it is of the kind, group and round asked, and `RoundPosts.accept` takes it (the run,
the writer's signature, the record's `peer_id`), exactly as if it had been posted; then the reader's
looks find it among the posts. An empty answer (the writer holds none), a refusal, a timeout or a
forgery leaves that writer missing, for the DHT (where its record is stored if a post of it failed).

Bounded: at most MAX_PULLS writers per call, PULL_THREADS at once, each within PULL_TIMEOUT_S, and
an answer of at most round_posts.MAX_VALUE_BYTES of record (the channel's own cap bounds the message).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from lowcomm.proto import wire_pb2
from lowcomm.transport.round_posts import PostRefused, RoundPosts
from lowcomm.transport.wire import Channels, Traffic, deadline_after

logger = logging.getLogger(__name__)
PULL_TIMEOUT_S = 2.0
PULL_THREADS = 8
MAX_PULLS = 64


def get_post(channels: Channels, traffic: Traffic, endpoint: str, request: wire_pb2.PostRequest,
             timeout_s: float = PULL_TIMEOUT_S) -> wire_pb2.WakeRequest | None:
    """``endpoint``'s answer to ``request`` (an empty post where it holds none), counted and paced; None
    where the call failed or the endpoint cannot be dialled (a record naming it is a stranger's claim)."""
    deadline = deadline_after(timeout_s)
    try:
        traffic.count_sent(request, deadline)
        reply = channels.stub(endpoint).GetPost(request, timeout=timeout_s)
        traffic.count_received(reply, deadline)
        return reply
    except Exception as e:  # grpc.RpcError, or an endpoint gRPC cannot parse
        logger.debug("GetPost(%s, round %d) at %s failed: %s", request.kind[:32], request.round, endpoint[:80],
                     e.code() if isinstance(e, grpc.RpcError) else e)
        return None


def pull_posts(channels: Channels, traffic: Traffic, posts: RoundPosts, kind: str, group: str, round_: int,
               writers: dict[str, str]) -> set[str]:
    """Asks each of ``writers`` (peer id -> endpoint) for its post of (kind, group, round); the writers
    whose post checked out and is now kept among ``posts``."""
    asked = dict(sorted(writers.items())[:MAX_PULLS])
    if not asked:
        return set()
    request = wire_pb2.PostRequest(run=posts.run, group=group, round=round_, kind=kind)

    def pull(writer: str) -> str | None:
        reply = get_post(channels, traffic, asked[writer], request)
        if reply is None or not reply.sender:
            return None  # no answer, or it holds none
        try:
            if (reply.sender, reply.kind, reply.group, reply.round) != (writer, kind, group, round_):
                raise PostRefused(f"asked {writer[:40]} for its {kind} post of round {round_}, got "
                                  f"{reply.sender[:40]}'s {reply.kind[:32]} post of round {reply.round}")
            posts.accept(reply, pulled=True)
        except PostRefused as e:
            logger.warning("refused a pulled post: %s", e)
            return None
        return writer

    with ThreadPoolExecutor(max_workers=min(PULL_THREADS, len(asked)), thread_name_prefix="pull") as pool:
        return {writer for writer in pool.map(pull, asked) if writer is not None}
