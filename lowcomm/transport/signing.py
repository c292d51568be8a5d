"""Data-plane calls bound to their sender's key: every contribution is signed, every receiver verifies.

A peer id is a hash of its Ed25519 public key (transport.identity), the key that signs its DHT
records. A signed call carries that public key (OpenSSH form, 80 bytes), the payload's sha256 and
an Ed25519 signature (64 bytes) over ``SIGNED_PREFIX | kind | 0 | canonical JSON of the call's
header fields`` (the digest among them). The receiver checks the key against the claimed sender id
and the signature on the first message, before it admits or waits for anything, and the digest
once the payload is in, before it decodes it: the sender field proves nothing by itself, and the
header binds the payload to one run, group, round, shard and weight, so a relabelled or replayed
part fails.

The key is the peer's identity, so a call is self-certifying (no DHT lookup to find a sender's key,
no record to trust for the binding) and a volunteer keeps one secret.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

from cryptography.hazmat.primitives.asymmetric import ed25519

from lowcomm.transport.identity import Identity, peer_id_of
from lowcomm.transport.keys import MAX_PUBLIC_KEY_BYTES, SIGNATURE_BYTES, public_key_from_openssh, verify

SIGNED_PREFIX = b"lowcomm-call/1\x00"
_CACHE = 4096  # parsed sender keys kept


class Unauthenticated(ValueError):
    """A call whose key, signature or sender id does not hold up."""


def signed_bytes(kind: str, fields: dict) -> bytes:
    """What a signature covers: the call's kind and its header fields (bytes values as hex)."""
    plain = {k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()}
    return SIGNED_PREFIX + kind.encode() + b"\x00" + json.dumps(plain, sort_keys=True, separators=(",", ":")).encode()


def digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


def check_digest(payload: bytes, declared: bytes, sender: str) -> None:
    """Raises Unauthenticated unless ``payload`` is what the signed header's digest says."""
    if digest(payload) != declared:
        raise Unauthenticated(f"payload from {sender[:40]!r} does not match its signed digest")


class Signer:
    """Signs this peer's calls with its identity's key."""

    def __init__(self, identity: Identity):
        self.identity = identity
        self.peer_id = identity.peer_id
        self.key = identity.public_key  # b"ssh-ed25519 AAAA..."

    @classmethod
    def generate(cls) -> "Signer":
        return cls(Identity.generate())

    def sign(self, kind: str, fields: dict) -> tuple[bytes, bytes]:
        """``(public key, signature)`` for a call of ``kind`` with header ``fields``."""
        return self.key, self.identity.sign(signed_bytes(kind, fields))


class Verifier:
    """Checks signed calls; keeps the parsed keys of recent senders (bounded)."""

    def __init__(self):
        self._keys: OrderedDict[bytes, ed25519.Ed25519PublicKey] = OrderedDict()
        self._lock = threading.Lock()

    def check_sender(self, sender: str, key: bytes) -> None:
        """Raises Unauthenticated unless ``key`` is ``sender``'s: its hash must be the claimed id."""
        if not key or len(key) > MAX_PUBLIC_KEY_BYTES:
            raise Unauthenticated(f"call from {sender[:40]!r} carries no usable public key")
        if peer_id_of(b"[owner:" + key + b"]") != sender:
            raise Unauthenticated(f"the call's key is not the key of {sender[:40]!r}")

    def verify(self, kind: str, fields: dict, sender: str, key: bytes, signature: bytes) -> None:
        """Raises Unauthenticated unless ``signature`` by ``sender``'s ``key`` covers ``fields``."""
        self.check_sender(sender, key)
        if len(signature) != SIGNATURE_BYTES:
            raise Unauthenticated(f"call from {sender[:40]!r} is not signed")
        if not verify(self._parse(key, sender), signature, signed_bytes(kind, fields)):
            raise Unauthenticated(f"bad signature on a {kind} call from {sender[:40]!r} "
                                  "(forged, or relabelled to another run, round, shard or weight)")

    def _parse(self, key: bytes, sender: str) -> ed25519.Ed25519PublicKey:
        with self._lock:
            public = self._keys.get(key)
            if public is not None:
                self._keys.move_to_end(key)
                return public
        try:
            public = public_key_from_openssh(key)
        except ValueError:
            raise Unauthenticated(f"call from {sender[:40]!r} carries no ssh-ed25519 public key") from None
        with self._lock:
            self._keys[key] = public
            while len(self._keys) > _CACHE:
                self._keys.popitem(last=False)
        return public


def message_digest(message) -> bytes:
    """sha256 of a protobuf message's deterministic encoding, its ``sender_key`` and ``signature`` left out."""
    plain = type(message)()
    plain.CopyFrom(message)
    plain.ClearField("sender_key")
    plain.ClearField("signature")
    return digest(plain.SerializeToString(deterministic=True))


def sign_message(signer: Signer, kind: str, message) -> None:
    """Signs a whole one-message call (a StageCall) in place: its sender, and the digest of all its fields."""
    message.sender_key, message.signature = signer.sign(kind, {"sender": message.sender,
                                                               "digest": message_digest(message)})


def verify_message(verifier: Verifier, kind: str, message) -> None:
    """Raises Unauthenticated unless ``message`` was signed (sign_message) by the key of its sender."""
    verifier.verify(kind, {"sender": message.sender, "digest": message_digest(message)}, message.sender,
                    message.sender_key, message.signature)
