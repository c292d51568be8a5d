"""Ed25519 public keys as lowcomm's wires carry them (OpenSSH form), and their signatures.

Every key a stranger sends (in a DHT record's `[owner:...]` marker, a call's ``sender_key``, the join
command's ``--run-key``) is bounded in size and must be an `ssh-ed25519` key before any parsing is
trusted; a signature is exactly 64 bytes.
"""

from __future__ import annotations

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

KEY_TYPE = b"ssh-ed25519"
MAX_PUBLIC_KEY_BYTES = 128  # an OpenSSH Ed25519 public key is 80 bytes; anything longer is refused unparsed
SIGNATURE_BYTES = 64


def public_key_from_openssh(data: bytes) -> ed25519.Ed25519PublicKey:
    """The key of ``b"ssh-ed25519 AAAA..."``; ValueError for anything else."""
    if not isinstance(data, bytes) or not data.startswith(KEY_TYPE + b" ") or len(data) > MAX_PUBLIC_KEY_BYTES:
        raise ValueError("not an ssh-ed25519 public key")
    try:
        key = serialization.load_ssh_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("a malformed ssh-ed25519 public key") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ValueError("not an ssh-ed25519 public key")
    return key


def verify(public: ed25519.Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` by ``public`` covers ``data`` (a signature of the wrong size is simply false)."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public.verify(signature, data)
        return True
    except Exception:  # cryptography's InvalidSignature; a hostile input must never raise past here
        return False
