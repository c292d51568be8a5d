"""Join tokens: the coordinator's signature that admits one peer id to one run until an expiry.

A token is ``lct1.<payload>.<signature>``, both parts base64url without padding: the payload is
the canonical JSON ``{"exp": unix seconds, "peer": peer id, "run": run name}`` and the signature
is Ed25519 by the coordinator's key (the key whose public half is the join command's
``--run-key``) over ``TOKEN_PREFIX | payload``. It is bound to the peer's id, the hash of the
peer's own key, so a token copied from the DHT admits nobody but its owner; every peer checks it
with the coordinator key it already holds, without asking anyone.
"""

from __future__ import annotations

import base64
import binascii
import json
import math

from cryptography.hazmat.primitives.asymmetric import ed25519

from lowcomm.transport.identity import Identity, public_key_from_text
from lowcomm.transport.keys import verify

TOKEN_PREFIX = b"lowcomm-join-token/1\x00"
VERSION = "lct1"
MAX_TOKEN_CHARS = 2048  # a 128-character run name and a signature fit with room to spare


class TokenRefused(ValueError):
    """A token that does not admit the peer: the message says why (malformed, forged, expired, not its own)."""


def _canonical(run: str, peer_id: str, expires: int) -> bytes:
    return json.dumps({"exp": expires, "peer": peer_id, "run": run}, sort_keys=True, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_token(coordinator: Identity, run: str, peer_id: str, expires: int) -> str:
    """The token admitting ``peer_id`` to ``run`` until unix time ``expires``, signed by ``coordinator``."""
    payload = _canonical(run, peer_id, int(expires))
    signature = coordinator.sign(TOKEN_PREFIX + payload)
    return f"{VERSION}.{_b64(payload)}.{_b64(signature)}"


def coordinator_public_key(public_key_text: str) -> ed25519.Ed25519PublicKey:
    """The coordinator's key from the join command's ``--run-key`` text (ValueError if it is not one)."""
    try:
        return public_key_from_text(public_key_text)
    except ValueError:
        raise ValueError("the run key is not an ssh-ed25519 public key") from None


def check_token(token: object, coordinator: ed25519.Ed25519PublicKey, run: str, peer_id: str, now: float) -> int:
    """The expiry of a token that admits ``peer_id`` to ``run`` at ``now``; TokenRefused otherwise.

    ``token`` may come from the network: its type and size are checked before anything is decoded."""
    if not isinstance(token, str) or not token:
        raise TokenRefused("no join token")
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenRefused(f"a join token of {len(token)} characters (at most {MAX_TOKEN_CHARS})")
    version, _, rest = token.partition(".")
    payload_text, _, signature_text = rest.partition(".")
    try:
        if version != VERSION or not payload_text or not signature_text:
            raise ValueError
        payload, signature = _unb64(payload_text), _unb64(signature_text)
        fields = json.loads(payload)
        expires, owner, token_run = fields["exp"], fields["peer"], fields["run"]
    except (ValueError, TypeError, KeyError, binascii.Error):
        raise TokenRefused("a malformed join token") from None
    if not (isinstance(expires, int) and not isinstance(expires, bool) and isinstance(owner, str)
            and isinstance(token_run, str)):
        raise TokenRefused("a malformed join token")
    if not verify(coordinator, signature, TOKEN_PREFIX + _canonical(token_run, owner, expires)):
        raise TokenRefused("a join token not signed by this run's coordinator")
    if token_run != run:
        raise TokenRefused(f"a join token for run {token_run[:128]!r}, not {run!r}")
    if owner != peer_id:
        raise TokenRefused(f"a join token for peer {owner[:40]!r}, not {peer_id!r}")
    if not math.isfinite(now) or expires <= now:
        raise TokenRefused(f"a join token that expired at unix time {expires}")
    return expires
