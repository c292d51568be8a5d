"""Client mode or not: whether the other peers can dial this one, decided once at join.

A joining peer asks a helper to Ping it back at the endpoint it announces (transport.service's
dial-back): the coordinator first, known by its key (the run key's peer id, not a state anyone can
publish), then serving peers that are joining or training, never a client-mode peer (nobody can
dial it), one on its way out, or itself. The first helper that answers decides: a dial-back that
went through means reachable; one that failed, or that the helper refused because this peer
announces another address than the one its Ping came from, means client mode. A helper busy with
other dial-backs is asked again a little later; helpers that do not answer are skipped.

When no helper answers, nothing is known about this peer, and it serves with a warning to check
that the coordinator's gRPC port is reachable. Taking silence for "unreachable" would spread: with
the coordinator's port filtered every joiner would go client mode in turn (client-mode peers are
never asked), and a run of client-mode peers only has no shard owners and completes no round.
Each silent helper costs up to PING_TIMEOUT_S, at most HELPERS_ASKED of them. `--client-mode` and
`--no-client-mode` skip the check.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from dataclasses import asdict, dataclass
from typing import Callable

import grpc

from lowcomm.proto import wire_pb2
from lowcomm.transport.addresses import ip_of, join_host_port, split_endpoint
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.wire import Channels, Traffic, deadline_after

logger = logging.getLogger(__name__)
HELPERS_ASKED = 3  # each silent one costs up to PING_TIMEOUT_S
PING_TIMEOUT_S = 10.0  # the helper's own dial-back waits 5 s (transport.service)
BUSY_RETRIES, BUSY_WAIT_S = 3, 2.0  # a helper running its most dial-backs is asked again, 2-4 s later
HELPER_STATES = ("joining", "training")  # a peer's record in one of these serves; the coordinator's always does


@dataclass(frozen=True)
class Reachability:
    client_mode: bool
    how: str  # "flag" (--client-mode / --no-client-mode), "dial-back" (a helper answered) or "no-helper"
    helper: str | None = None  # the endpoint of the helper that answered
    detail: str = ""  # the helper's error, or why nobody answered

    @property
    def undecided(self) -> bool:
        """No helper answered: the peer serves without knowing whether others can dial it."""
        return self.how == "no-helper"

    def event(self) -> dict:
        return asdict(self)


def helpers(records: dict[str, PeerRecord], me: str, coordinator: str) -> list[str]:
    """The endpoints to ask, best first: the coordinator (the record of peer id `coordinator`, the run
    key's), then the joining or training peers that serve, freshest record first."""
    first = [records[coordinator]] if coordinator in records and coordinator != me else []
    peers = [r for peer_id, r in records.items() if peer_id not in (me, coordinator) and not r.client_mode
             and r.state in HELPER_STATES]
    peers.sort(key=lambda r: -r.heartbeat)
    return [r.endpoint for r in (first + peers)[:HELPERS_ASKED]]


def decide(forced: bool | None, endpoints: list[str], ask: Callable[[str], tuple[bool, str]]) -> Reachability:
    """`forced` (the flag) if given; else the first answer of `ask(helper) -> (dial_back_ok, error)`,
    which raises when the helper does not answer. Nobody answering decides nothing: the peer serves."""
    if forced is not None:
        return Reachability(forced, "flag")
    silent = []
    for endpoint in endpoints:
        try:
            ok, error = ask(endpoint)
        except Exception as e:  # the helper did not answer: ask the next one
            silent.append(f"{endpoint}: {_reason(e)}")
            continue
        return Reachability(not ok, "dial-back", endpoint, "" if ok else error or "the dial-back failed")
    return Reachability(False, "no-helper", None,
                        "; ".join(silent) if silent else "no coordinator or serving peer in the DHT")


def dial_back(channels: Channels, traffic: Traffic, me: str, endpoint: str) -> Callable[[str], tuple[bool, str]]:
    """`ask` for decide: a Ping to the helper asking it to Ping `endpoint` (this peer) back. A helper
    dials back only the caller's own IP address, so a hostname is resolved here, as other peers would."""
    def ask(helper: str) -> tuple[bool, str]:
        target = dialable(endpoint)
        if target is None:
            return False, f"{endpoint} does not resolve to an address"
        request = wire_pb2.PingRequest(sender=me, dial_back=target)
        for attempt in range(BUSY_RETRIES + 1):
            deadline = deadline_after(PING_TIMEOUT_S)
            traffic.count_sent(request, deadline)
            try:
                reply = channels.stub(helper).Ping(request, timeout=PING_TIMEOUT_S)
                break
            except grpc.RpcError as e:  # a helper busy with other joiners' dial-backs: a moment later
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == BUSY_RETRIES:
                    raise
                time.sleep(BUSY_WAIT_S * (1.0 + random.random()))
        traffic.count_received(reply, deadline)
        return reply.dial_back_ok, reply.error
    return ask


def dialable(endpoint: str) -> str | None:
    """`endpoint` with its host as an IP address (a hostname resolved, IPv4 first; None when it does not
    resolve)."""
    host, port = split_endpoint(endpoint)
    if ip_of(host) is not None:
        return endpoint
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as the planes announce
    return join_host_port(infos[0][4][0], port) if infos else None


def explain(verdict: Reachability, endpoint: str) -> str | None:
    """Logs a decision the user may want to check or override; returns the warning given, if any."""
    if verdict.undecided:
        warning = (f"no helper answered the reachability check ({verdict.detail}): serving at {endpoint} "
                   "unchecked; check that the coordinator's gRPC --port is reachable from this machine, or "
                   "pass --client-mode if the other peers cannot dial this one")
    elif verdict.how == "flag" or not verdict.client_mode:
        logger.info("reachability of %s: %s", endpoint, verdict)
        return None
    else:
        warning = (f"{verdict.helper} could not dial {endpoint} back ({verdict.detail}): client mode; open or "
                   "forward that port, or pass --announce-addr with the address others reach")
    logger.warning("%s", warning)
    return warning


def _reason(error: Exception) -> str:
    code, details = getattr(error, "code", None), getattr(error, "details", None)
    if callable(code):  # a grpc.RpcError: its text is many lines, its code and details say it
        try:
            text = code().name + (f" ({details()})" if callable(details) and details() else "")
        except Exception:  # not an RpcError after all
            text = str(error)
    else:
        text = str(error)
    return (text.strip().splitlines() or [type(error).__name__])[0][:200]
