"""A peer's signing identity: the Ed25519 key that signs its DHT records, its calls and (for the
coordinator) its join tokens, and the peer id derived from it.

The peer id is a hash of the public key's `[owner:ssh-ed25519 ...]` marker, so a record that names a
peer can only be written by the holder of that peer's key (transport.record_signing enforces the
marker). One key serves the DHT and the data plane, so a call is self-certifying and a volunteer
keeps one secret (docs/round-protocol.md, Decision 54, says why Ed25519 and not hivemind's RSA).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from lowcomm.transport.keys import KEY_TYPE, public_key_from_openssh
from lowcomm.transport.record_signing import SignedRecords


class KeyFileError(ValueError):
    """A key file that holds no Ed25519 private key."""


def peer_id_of(owner_marker: bytes) -> str:
    """The stable short id of the key behind an `[owner:...]` marker."""
    return hashlib.sha256(owner_marker).hexdigest()[:20]


def public_key_from_text(public_key_text: str) -> ed25519.Ed25519PublicKey:
    """The key of the join command's ``--run-key`` text (the base64 body); ValueError if it is not one."""
    return public_key_from_openssh(KEY_TYPE + b" " + public_key_text.strip().encode())


def owner_marker_from_text(public_key_text: str) -> bytes:
    """The `[owner:...]` marker for a public key given as in the join command."""
    return b"[owner:" + KEY_TYPE + b" " + public_key_text.strip().encode() + b"]"


@dataclass
class Identity:
    private_key: ed25519.Ed25519PrivateKey
    validator: SignedRecords = field(default=None, repr=False)  # the DHT's record validator for this key

    def __post_init__(self):
        if self.validator is None:
            self.validator = SignedRecords(self.sign, self.owner_marker)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> "Identity":
        """Keeps a coordinator's key across restarts so its printed join command stays valid."""
        path = Path(path)
        if path.exists():
            try:
                key = serialization.load_der_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError, UnsupportedAlgorithm):
                key = None
            if not isinstance(key, ed25519.Ed25519PrivateKey):
                raise KeyFileError(f"{path} holds no Ed25519 private key; move it away and start again to "
                                   "make a new key (the join command changes with it)")
            return cls(key)
        key = ed25519.Ed25519PrivateKey.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # owner-only from the first byte
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        tmp.replace(path)
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        """The raw 64-byte Ed25519 signature of ``data``."""
        return self.private_key.sign(data)

    @property
    def public_key(self) -> bytes:
        """``b"ssh-ed25519 AAAA..."``: the public half in OpenSSH form, as calls carry it."""
        return self.private_key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH)

    @property
    def owner_marker(self) -> bytes:
        """`[owner:ssh-ed25519 ...]`: put in a DHT subkey, it makes the record writable by this key only."""
        return b"[owner:" + self.public_key + b"]"

    @property
    def public_key_text(self) -> str:
        """The public half as printed in the join command (the OpenSSH base64 body)."""
        return self.public_key.decode().split()[1]

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.owner_marker)
