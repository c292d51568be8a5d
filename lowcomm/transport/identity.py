"""A peer's signing identity: the RSA key that signs its DHT records, and the peer id derived from it.

The peer id is a hash of the public key, so a record that names a peer can only be written by the
holder of that peer's key (hivemind's RSASignatureValidator enforces the `[owner:<key>]` marker).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey


def _private_key_from_der(der: bytes) -> RSAPrivateKey:
    # hivemind's RSAPrivateKey has no loader; its own unpickling path does exactly this.
    from cryptography.hazmat.primitives import serialization

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(der, password=None)
    return key


def peer_id_of(owner_marker: bytes) -> str:
    """The stable short id of the key behind an `[owner:...]` marker."""
    return hashlib.sha256(owner_marker).hexdigest()[:20]


@dataclass
class Identity:
    private_key: RSAPrivateKey
    validator: RSASignatureValidator

    @classmethod
    def generate(cls) -> "Identity":
        key = RSAPrivateKey()
        return cls(key, RSASignatureValidator(key))

    @classmethod
    def load_or_create(cls, path: Path) -> "Identity":
        """Keeps a coordinator's key across restarts so its printed join command stays valid."""
        path = Path(path)
        if path.exists():
            key = _private_key_from_der(path.read_bytes())
        else:
            key = RSAPrivateKey()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # owner-only from the first byte
            with os.fdopen(fd, "wb") as f:
                f.write(key.to_bytes())
            tmp.replace(path)
        return cls(key, RSASignatureValidator(key))

    @property
    def owner_marker(self) -> bytes:
        """`[owner:ssh-rsa ...]`: put in a DHT subkey, it makes the record writable by this key only."""
        return self.validator.local_public_key

    @property
    def public_key_text(self) -> str:
        """The public half as printed in the join command (the ssh-rsa base64 body)."""
        return self.private_key.get_public_key().to_bytes().decode().split()[1]

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.owner_marker)


def owner_marker_from_text(public_key_text: str) -> bytes:
    """The `[owner:...]` marker for a public key given as in the join command."""
    return b"[owner:ssh-rsa " + public_key_text.strip().encode() + b"]"
