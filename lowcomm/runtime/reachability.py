"""Client mode or not: whether the other peers can dial this one, decided once at join.

A joining peer asks a helper to Ping it back at the endpoint it announces (transport.service's
dial-back): the coordinator first, which always serves one, then serving peers, never a
client-mode peer (nobody can dial it) or itself. The first helper that answers decides: a
dial-back that went through means reachable, one that failed means client mode. Helpers that do
not answer at all are skipped; when none answers, nobody could dial this peer either, so it runs
in client mode too. `--client-mode` and `--no-client-mode` skip the check.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable

from lowcomm.proto import wire_pb2
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.wire import Channels, Traffic, deadline_after

logger = logging.getLogger(__name__)
HELPERS_ASKED = 3  # each silent one costs up to PING_TIMEOUT_S
PING_TIMEOUT_S = 10.0  # the helper's own dial-back waits 5 s (transport.service)
SERVES_STATE = ("coordinator", "holder")


@dataclass(frozen=True)
class Reachability:
    client_mode: bool
    how: str  # "flag" (--client-mode / --no-client-mode), "dial-back" (a helper answered) or "no-helper"
    helper: str | None = None  # the endpoint of the helper that answered
    detail: str = ""  # the helper's error, or why nobody answered

    def event(self) -> dict:
        return asdict(self)


def helpers(records: dict[str, PeerRecord], me: str) -> list[str]:
    """The endpoints to ask, best first: the coordinator (a resumed run's holder), then the serving
    peers with the freshest records; never this peer or a client-mode one."""
    candidates = [r for peer_id, r in records.items() if peer_id != me and not r.client_mode]
    candidates.sort(key=lambda r: (r.state not in SERVES_STATE, -r.heartbeat))
    return [r.endpoint for r in candidates[:HELPERS_ASKED]]


def decide(forced: bool | None, endpoints: list[str], ask: Callable[[str], tuple[bool, str]]) -> Reachability:
    """`forced` (the flag) if given; else the first answer of `ask(helper) -> (dial_back_ok, error)`,
    which raises when the helper does not answer."""
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
    return Reachability(True, "no-helper", None,
                        "; ".join(silent) if silent else "no coordinator or serving peer in the DHT")


def dial_back(channels: Channels, traffic: Traffic, me: str, endpoint: str) -> Callable[[str], tuple[bool, str]]:
    """`ask` for decide: a Ping to the helper asking it to Ping `endpoint` (this peer) back."""
    def ask(helper: str) -> tuple[bool, str]:
        request = wire_pb2.PingRequest(sender=me, dial_back=endpoint)
        deadline = deadline_after(PING_TIMEOUT_S)
        traffic.count_sent(request, deadline)
        reply = channels.stub(helper).Ping(request, timeout=PING_TIMEOUT_S)
        traffic.count_received(reply, deadline)
        return reply.dial_back_ok, reply.error
    return ask


def explain(verdict: Reachability, endpoint: str) -> None:
    """Logs a decision the user may want to override."""
    if verdict.how == "flag" or not verdict.client_mode:
        logger.info("reachability of %s: %s", endpoint, verdict)
    elif verdict.how == "no-helper":
        logger.warning("nobody answered the reachability check (%s): client mode; pass --no-client-mode if the "
                       "other peers can dial %s", verdict.detail, endpoint)
    else:
        logger.warning("%s could not dial %s back (%s): client mode; open or forward that port, or pass "
                       "--announce-addr with the address others reach", verdict.helper, endpoint, verdict.detail)


def _reason(error: Exception) -> str:
    code = getattr(error, "code", None)
    if callable(code):  # a grpc.RpcError: its text is many lines, its code says it
        try:
            return code().name
        except Exception:  # not an RpcError after all
            pass
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
