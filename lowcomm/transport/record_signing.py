"""DHT records only their owner may write: the record validator every lowcomm DHT node runs.

A key or subkey that contains `[owner:ssh-ed25519 <key>]` marks a protected record: its value must
end in exactly one `[signature:<base64>]`, that key's Ed25519 signature over the record (key,
subkey, the value without the signature, expiry; msgpack, as hivemind serializes a DHTRecord).
Nodes drop a protected record whose signature does not hold, whose marker is not an Ed25519 key
(an RSA marker included) or that names two keys; records without a marker pass unchecked. This is
the contract of hivemind's RSASignatureValidator with an Ed25519 key: a record carries an 80-byte
key and an 88-byte signature where RSA's took 388 and 356 (Decision 54).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Callable
from functools import lru_cache

from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from lowcomm.transport.keys import public_key_from_openssh, verify

_OWNER = re.compile(rb"\[owner:([^\]]*)\]")
_SIGNATURE = re.compile(rb"\[signature:([^\]]*)\]")
_KEYS_CACHED = 4096  # parsed owner keys kept (hostile markers cost a parse each, bounded in size)


@lru_cache(maxsize=_KEYS_CACHED)
def _owner_key(marker_body: bytes) -> ed25519.Ed25519PublicKey:
    return public_key_from_openssh(marker_body)


def _signed_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps(dataclasses.astuple(record))


class SignedRecords(RecordValidatorBase):
    """Signs this node's own protected records with ``sign``; checks everyone's."""

    def __init__(self, sign: Callable[[bytes], bytes], owner_marker: bytes):
        self._sign = sign
        self.local_public_key = owner_marker  # hivemind's name for a validator's own marker

    def owns(self, record: DHTRecord) -> bytes | None:
        """The marker of the key this node signs ``record`` with, None if the record is not its own."""
        marker = self.local_public_key
        return marker if marker in record.key or (record.subkey is not None and marker in record.subkey) else None

    def sign_with(self, record: DHTRecord) -> Callable[[bytes], bytes] | None:
        """How to sign ``record``: this node's key where the record is its own, else None (left unsigned)."""
        return self._sign if self.owns(record) else None

    def sign_value(self, record: DHTRecord) -> bytes:
        sign = self.sign_with(record)
        if sign is None:
            return record.value
        return record.value + b"[signature:" + base64.b64encode(sign(_signed_bytes(record))) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        return _SIGNATURE.sub(b"", record.value)

    def validate(self, record: DHTRecord) -> bool:
        markers = set(_OWNER.findall(record.key))
        if record.subkey is not None:
            markers |= set(_OWNER.findall(record.subkey))
        if not markers:
            return True  # not a protected record
        if len(markers) > 1:
            return False
        try:
            public = _owner_key(markers.pop())
        except ValueError:
            return False
        signatures = _SIGNATURE.findall(record.value)
        if len(signatures) != 1:
            return False
        try:
            signature = base64.b64decode(signatures[0], validate=True)
        except (binascii.Error, ValueError):
            return False
        stripped = dataclasses.replace(record, value=self.strip_value(record))
        return verify(public, signature, _signed_bytes(stripped))

    @property
    def priority(self) -> int:
        return 10  # before any validator that decodes the value (hivemind's convention)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecords)  # one per node: a second adds nothing
