"""The gRPC `Peer` service: counts (and paces) traffic and hands each call to the layer that owns it.

Collectives register the reduce, hole-filling and pair-exchange handlers, the runtime registers the state
provider; a call that arrives before its handler is registered gets a clear error, not a crash.
Any exception a handler raises is turned into an error status and counted, never propagated.

A Ping may ask for a dial-back (runtime.reachability): this peer Pings the caller back and says
only whether the caller itself answered. It dials only `IP:PORT` with the caller's own IP address
as seen on this connection (another host is answered "no" undialled, anything but HOST:PORT is an
INVALID_ARGUMENT), so nobody can make a peer dial a third machine or probe ports elsewhere. Each
probe gets a channel of its own, closed after it, and at most `DIAL_BACKS` run at once (beyond that
a Ping is refused with RESOURCE_EXHAUSTED).

The calls that may wait (Reduce, GetShard, GetState, Exchange) are admitted `MAX_WAITING_CALLS` at
a time, fewer than the server's threads, so a flood of them never starves Ping or the stage calls:
one beyond the cap ends at once with RESOURCE_EXHAUSTED and counts as an error (a `reject` event).
A streamed round holds a Reduce call from every other contributor open at each owner at once, so
the cap grows to fit the largest round this peer joined (`fit_round`: its contributors − 1 plus
`OTHER_CALLS`, up to `ROUND_CALLS_MAX` + `OTHER_CALLS`); the server makes threads as needed up to
`SERVER_THREADS`, 16 beyond the highest cap. A round's contributors come from a manifest that its
members signed and checked, so a stranger cannot raise the cap.
GetState, which anyone may call (a joiner has no membership to prove), holds at most
`METHOD_CAPS["GetState"]` of those places, so a flood of state requests waiting for a far round
cannot starve the members' Reduce calls. A handler that raises `Overloaded` (its own per-sender
cap) ends its call the same way.

GetPost answers with this peer's own signed round post (transport.post_pulls), or an empty one: it
holds no place among the waiting calls, as nothing waits, and a reader checks the answer as a post.
Asked for kind `stats`, it answers with this peer's stats signed by `stats_post`
(transport.stats_pulls), which signs anew at most once a second however often it is asked.

A bare Wake (transport.wakeups) is a hint with nothing to trust in it: a malformed one is refused and
counted, a well-formed one at most makes a waiting agreement read the DHT sooner. A Wake that carries
a round post (transport.round_posts) is kept only once its writer's signature and record check out.

A stage call passes the runtime's `stage_guard` first; a guard reports its own refusals (with the
sender) and raises `Refused`, so each refused call is one `reject` event, not two. A stage serves
one call at a time, so at most `MAX_STAGE_CALLS` are let in to wait for it: one more is answered
BUSY at once (its driver tries another replica) and counted, so a run peer that floods a stage
holds a handful of server threads, not all of them.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from lowcomm.proto import wire_pb2, wire_pb2_grpc
from lowcomm.transport.addresses import ip_of, join_host_port, split_endpoint
from lowcomm.transport.round_posts import KINDS, STATS, PostRefused, RoundPosts
from lowcomm.transport.wakeups import Wakeups, valid_wake
from lowcomm.transport.wire import Channels, Traffic, context_deadline, deadline_after

logger = logging.getLogger(__name__)
DIAL_BACKS = 4  # dial-backs running at once; each holds a server thread up to DIAL_BACK_TIMEOUT_S
DIAL_BACK_TIMEOUT_S = 5.0
MAX_WAITING_CALLS = 48  # Reduce, GetShard, GetState and Exchange calls served at once, at least
ROUND_CALLS_MAX = 512  # the most Reduce calls a round may hold open at once at one owner (contributors - 1)
OTHER_CALLS = 16  # the waiting calls' places besides a round's Reduce calls
SERVER_THREADS = ROUND_CALLS_MAX + OTHER_CALLS + 16  # made as needed; 16 beyond the cap: Ping, Wake, stage calls
MAX_STAGE_CALLS = 8  # stage calls in a server at once (served one at a time; the others wait their turn)
METHOD_CAPS = {"GetState": 8}  # of the waiting calls: GetState is unsigned (anyone may ask for the state)


class Overloaded(RuntimeError):
    """A handler refuses a call for want of capacity; the call ends with RESOURCE_EXHAUSTED."""


class Refused(ValueError):
    """A guard refused a call and reported the refusal itself: the call is answered REJECTED (RETRY when
    `retry` is set: the refusal may not hold a moment later) and not counted a second time."""

    retry = False


class DialBackRefused(ValueError):
    """A dial-back target that is not HOST:PORT."""


def caller_ip(context) -> str | None:
    """The caller's IP address from gRPC's peer string (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`), an IPv4 address
    mapped into IPv6 as IPv4; None for anything else (a unix socket)."""
    kind, _, address = context.peer().partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return _unmapped(ip_of(address.rsplit(":", 1)[0]))


def dial_back_target(requested: str, context) -> str | None:
    """The endpoint to Ping back: `requested` when its host is the caller's own IP address, None when it
    is another host; DialBackRefused when it is not HOST:PORT at all."""
    try:
        host, port = split_endpoint(requested)
    except ValueError:
        raise DialBackRefused(f"dial-back target {requested[:80]!r} is not HOST:PORT") from None
    caller = caller_ip(context)
    return join_host_port(caller, port) if caller is not None and _unmapped(ip_of(host)) == caller else None


def _unmapped(ip) -> str | None:
    return None if ip is None else str(getattr(ip, "ipv4_mapped", None) or ip)


class PeerService(wire_pb2_grpc.PeerServicer):
    def __init__(self, peer_id: str, traffic: Traffic, channels: Channels):
        self.peer_id = peer_id
        self.traffic = traffic
        self.channels = channels
        self.round = 0
        self.reduce_handler: Callable | None = None
        self.shard_handler: Callable | None = None
        self.exchange_handler: Callable | None = None  # (requests, context) -> ExchangeReply
        self.exchange_cap_s = 120.0  # the longest one Exchange call may hold a server thread
        self.state_handler: Callable | None = None
        self.stage_handler = None  # pipeline.server.StageServer: forward(call) and backward(call) -> StageReply
        self.stage_guard: Callable[[str, object], None] | None = None  # raises Refused for a call not to serve
        self.checkpointer: str | None = None  # the coordinator's peer id: its GetState calls are checkpoints
        self._errors = 0
        self._lock = threading.Lock()
        self._dial_backs = threading.BoundedSemaphore(DIAL_BACKS)
        self._stage_calls = threading.BoundedSemaphore(MAX_STAGE_CALLS)
        self._waiting = 0  # calls admitted by _admit and not yet over
        self._by_method: dict[str, int] = {}  # the same, per method
        self.max_waiting_calls = MAX_WAITING_CALLS
        self.on_error: Callable[[str, str], None] | None = None
        self.wakeups = Wakeups()  # what agreement waits on (transport.wakeups)
        self.posts: RoundPosts | None = None  # the round records posted here (transport.round_posts)
        self.stats_post: Callable[[str], wire_pb2.WakeRequest | None] | None = None  # run -> signed stats

    @property
    def errors(self) -> int:
        return self._errors

    def _failed(self, method: str, error: Exception, context) -> None:
        with self._lock:
            self._errors += 1
        logger.warning("%s from %s failed: %s", method, context.peer(), error)
        if self.on_error is not None:
            self.on_error(method, str(error))

    def _admit(self, method: str, context) -> Callable[[], None]:
        """A one-shot release of this call's place among the waiting calls (also run when the call
        ends); a call beyond `max_waiting_calls`, or beyond its method's own cap (`METHOD_CAPS`), is
        counted and ended with RESOURCE_EXHAUSTED."""
        cap = METHOD_CAPS.get(method)
        with self._lock:
            full = (f"{self.max_waiting_calls} calls are served already" if self._waiting >= self.max_waiting_calls
                    else f"{cap} {method} calls are served already"
                    if cap is not None and self._by_method.get(method, 0) >= cap else None)
            if full is None:
                self._waiting += 1
                self._by_method[method] = self._by_method.get(method, 0) + 1
        if full is not None:
            self._failed(method, Overloaded(full), context)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this peer is busy ({full}); retry later")
        released = []

        def release():
            with self._lock:
                if not released:
                    released.append(True)
                    self._waiting -= 1
                    self._by_method[method] -= 1

        context.add_callback(release)
        return release

    def fit_round(self, contributors: int) -> None:
        """Makes room for a round of `contributors`: each owner serves a Reduce call from every other one
        at once. The cap only grows, up to ROUND_CALLS_MAX + OTHER_CALLS."""
        need = min(max(contributors - 1, 0), ROUND_CALLS_MAX) + OTHER_CALLS
        with self._lock:
            if need <= self.max_waiting_calls:
                return
            self.max_waiting_calls = need
        logger.info("serving up to %d waiting calls at once for a round of %d contributors", need, contributors)

    @property
    def waiting_calls(self) -> int:
        return self._waiting

    def Reduce(self, request_iterator, context):
        if self.reduce_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer serves no reduce yet")
        release = self._admit("Reduce", context)
        try:
            deadline = context_deadline(context)
            requests = self.traffic.receiving(request_iterator, deadline)
            yield from self.traffic.sending(self.reduce_handler(requests, context), deadline)
        except Overloaded as e:  # counted by the handler that refused
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Exception as e:  # hostile input must never take the server down
            self._failed("Reduce", e, context)
            yield wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.REJECTED, error=f"{type(e).__name__}: {e}")
        finally:
            release()

    def GetShard(self, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        if self.shard_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer holds no shards")
        release = self._admit("GetShard", context)
        try:
            yield from self.traffic.sending(self.shard_handler(request, context), deadline)
        except Exception as e:
            self._failed("GetShard", e, context)
            yield wire_pb2.ReduceReply(status=wire_pb2.ReduceReply.REJECTED, error=f"{type(e).__name__}: {e}")
        finally:
            release()

    def GetState(self, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        if self.state_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer has no state to give yet")
        release = self._admit("GetState", context)
        try:
            checkpoint = self.checkpointer is not None and request.requester == self.checkpointer
            yield from self.traffic.sending(self.state_handler(request, context), deadline, checkpoint=checkpoint)
        except Exception as e:
            self._failed("GetState", e, context)
            yield wire_pb2.StateChunk(error=f"{type(e).__name__}: {e}")
        finally:
            release()

    def Exchange(self, request_iterator, context):
        if self.exchange_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer runs no pair exchange")
        release = self._admit("Exchange", context)
        try:
            return self._exchange(request_iterator, context)
        finally:
            release()

    def _exchange(self, request_iterator, context):
        deadline = context_deadline(context)
        # A client that sets no deadline and trickles its stream must not hold a server thread for
        # good: the call is cancelled after exchange_cap_s whatever the client asked for.
        cap = threading.Timer(self.exchange_cap_s, context.cancel)
        cap.daemon = True
        cap.start()
        try:
            reply = self.exchange_handler(self.traffic.receiving(request_iterator, deadline), context)
        except Exception as e:  # hostile input must never take the server down
            self._failed("Exchange", e, context)
            reply = wire_pb2.ExchangeReply(status=wire_pb2.ExchangeReply.REJECTED, error=f"{type(e).__name__}: {e}")
        finally:
            cap.cancel()
        self.traffic.count_sent(reply, deadline)
        return reply

    def StageForward(self, request, context):
        return self._stage_call("StageForward", request, context)

    def StageBackward(self, request, context):
        return self._stage_call("StageBackward", request, context)

    def _stage_call(self, method: str, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        if self.stage_handler is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this peer serves no pipeline stage")
        if not self._stage_calls.acquire(blocking=False):
            busy = Overloaded(f"{MAX_STAGE_CALLS} stage calls are waiting for this stage already")
            self._failed(method, busy, context)
            reply = wire_pb2.StageReply(status=wire_pb2.StageReply.BUSY, error=f"Overloaded: {busy}")
            self.traffic.count_sent(reply, deadline)
            return reply
        try:
            if self.stage_guard is not None:
                self.stage_guard(method, request)
            serve = self.stage_handler.forward if method == "StageForward" else self.stage_handler.backward
            reply = serve(request)
        except Refused as e:  # the guard reported it
            status = wire_pb2.StageReply.RETRY if e.retry else wire_pb2.StageReply.REJECTED
            reply = wire_pb2.StageReply(status=status, error=f"{type(e).__name__}: {e}")
        except Exception as e:  # hostile input must never take the server down
            self._failed(method, e, context)
            reply = wire_pb2.StageReply(status=wire_pb2.StageReply.REJECTED, error=f"{type(e).__name__}: {e}")
        finally:
            self._stage_calls.release()
        self.traffic.count_sent(reply, deadline)
        return reply

    def Ping(self, request, context):
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        reply = wire_pb2.PingReply(peer_id=self.peer_id, round=self.round)
        if request.dial_back:
            self._dial_back(request, reply, context)
        self.traffic.count_sent(reply, deadline)
        return reply

    def Wake(self, request, context):
        """A round's record posted here, or a bare hint that its records changed (transport.wakeups): kept
        if it checks out, and wakes this peer's wait on the round, if any."""
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        refused = valid_wake(request)
        if refused is None and request.kind:
            try:
                if self.posts is None:
                    raise PostRefused("this peer takes no round posts")
                self.posts.accept(request)
            except PostRefused as e:
                refused = str(e)
        if refused is not None:
            self._failed("Wake", ValueError(refused), context)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        self.wakeups.notify(request.group, request.round)
        reply = wire_pb2.WakeReply()
        self.traffic.count_sent(reply, deadline)
        return reply

    def GetPost(self, request, context):
        """This peer's own signed round post of (kind, group, round), for a reader that no post reached
        (transport.post_pulls); an empty one where it holds none. Nothing waits: answered at once."""
        deadline = context_deadline(context)
        self.traffic.count_received(request, deadline)
        refused = valid_wake(request) or (None if request.kind in KINDS else f"no post kind {request.kind[:32]!r}")
        if refused is not None:
            self._failed("GetPost", ValueError(refused), context)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        if request.kind == STATS:
            own = self.stats_post(request.run) if self.stats_post is not None else None
        elif self.posts is not None and request.run == self.posts.run:
            own = self.posts.own(request.kind, request.group, request.round)
        else:
            own = None
        reply = own if own is not None else wire_pb2.WakeRequest()
        self.traffic.count_sent(reply, deadline)
        return reply

    def _dial_back(self, request, reply, context) -> None:
        """Fills `reply` with whether the caller answers at the endpoint it names; aborts the call for a
        target that is not HOST:PORT, or when DIAL_BACKS probes run already."""
        try:
            target = dial_back_target(request.dial_back, context)
        except DialBackRefused as e:
            self._failed("Ping", e, context)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if target is None:  # answered, never dialled: another machine's address is not the caller's to name
            reply.error = (f"refused to dial {request.dial_back[:80]}: this Ping came from {caller_ip(context)}; "
                           "announce the address others reach this peer at (--announce-addr)")
            return
        if not self._dial_backs.acquire(blocking=False):
            self._failed("Ping", RuntimeError("too many dial-backs at once"), context)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this peer runs {DIAL_BACKS} dial-backs already; retry later or ask another helper")
        try:
            reply.dial_back_ok = self._probe(target, request.sender)
        finally:
            self._dial_backs.release()
        if not reply.dial_back_ok:
            reply.error = f"no answer from {request.sender[:80] or 'the sender'} at {target}"

    def _probe(self, target: str, sender: str) -> bool:
        """Whether `sender` itself (any peer when empty) answers a Ping at `target`, on a channel used once."""
        probe = wire_pb2.PingRequest(sender=self.peer_id)
        probe_deadline = deadline_after(DIAL_BACK_TIMEOUT_S)
        self.traffic.count_sent(probe, probe_deadline)
        try:
            with self.channels.once(target) as stub:
                answer = stub.Ping(probe, timeout=DIAL_BACK_TIMEOUT_S)
        except grpc.RpcError:
            return False
        self.traffic.count_received(answer, probe_deadline)
        # the asker itself must answer, not whatever else listens at that address
        return answer.peer_id == sender if sender else bool(answer.peer_id)
