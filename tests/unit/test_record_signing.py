"""The DHT's record validator (transport.record_signing) and the Ed25519 identity behind it."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from lowcomm.transport.identity import Identity, KeyFileError, owner_marker_from_text, peer_id_of

KEY = b"run.peers"


def signed(identity: Identity, value: bytes = b"\x81\xa7peer_id\xa1x", subkey: bytes | None = None,
           expiration: float = 1e9) -> DHTRecord:
    record = DHTRecord(KEY, identity.owner_marker if subkey is None else subkey, value, expiration)
    return dataclasses.replace(record, value=identity.validator.sign_value(record))


def test_an_own_record_is_signed_and_any_change_to_it_is_refused():
    writer, reader = Identity.generate(), Identity.generate()
    record = signed(writer)
    assert reader.validator.validate(record)
    assert reader.validator.strip_value(record) == b"\x81\xa7peer_id\xa1x"
    for forged in (dataclasses.replace(record, expiration_time=2e9),  # a longer life
                   dataclasses.replace(record, key=b"other.peers"),  # replayed under another key
                   dataclasses.replace(record, value=b"\x81\xa7peer_id\xa1y" + record.value[11:])):
        assert not reader.validator.validate(forged)
    other = signed(reader)  # a valid signature by another key, moved under the writer's marker
    assert not reader.validator.validate(dataclasses.replace(other, subkey=writer.owner_marker))


def test_records_of_another_writer_are_left_unsigned_and_unprotected_ones_pass():
    writer, other = Identity.generate(), Identity.generate()
    record = DHTRecord(KEY, other.owner_marker, b"v", 1e9)
    assert writer.validator.sign_value(record) == b"v"  # not its key: it cannot sign for it
    assert not writer.validator.validate(record)  # and unsigned, nobody takes it
    assert writer.validator.validate(DHTRecord(KEY, b"plain", b"v", 1e9))


@pytest.mark.parametrize("value", [b"v", b"v[signature:]", b"v[signature:!!notbase64]",
                                   b"v[signature:" + b"A" * 88 + b"]",
                                   b"v[signature:" + b"QUFB" * 40 + b"]"])
def test_missing_malformed_or_wrong_sized_signatures_are_refused(value):
    writer = Identity.generate()
    assert not writer.validator.validate(DHTRecord(KEY, writer.owner_marker, value, 1e9))


def test_two_signatures_or_two_markers_are_refused():
    writer, other = Identity.generate(), Identity.generate()
    record = signed(writer)
    assert not writer.validator.validate(dataclasses.replace(record, value=record.value + record.value[-90:]))
    both = DHTRecord(writer.owner_marker, other.owner_marker, b"v", 1e9)
    assert not writer.validator.validate(dataclasses.replace(both, value=writer.validator.sign_value(both)))


def test_rsa_records_and_oversized_or_garbled_markers_are_refused():
    reader = Identity.generate()
    rsa_writer = RSASignatureValidator(RSAPrivateKey())  # a node running hivemind's own validator
    record = DHTRecord(KEY, rsa_writer.local_public_key, b"v", 1e9)
    assert not reader.validator.validate(dataclasses.replace(record, value=rsa_writer.sign_value(record)))
    for marker in (b"[owner:ssh-ed25519 " + b"A" * 4096 + b"]", b"[owner:ssh-ed25519 AAAAnotakey]", b"[owner:]"):
        assert not reader.validator.validate(DHTRecord(KEY, marker, b"v[signature:" + b"A" * 88 + b"]", 1e9))


def test_the_join_command_key_names_the_same_marker_and_peer_id():
    identity = Identity.generate()
    assert owner_marker_from_text(identity.public_key_text) == identity.owner_marker
    assert peer_id_of(identity.owner_marker) == identity.peer_id
    assert len(identity.owner_marker) < 100 and identity.public_key.startswith(b"ssh-ed25519 ")


def test_a_key_file_keeps_the_identity_and_refuses_other_keys(tmp_path):
    path = tmp_path / "peer.key"
    first = Identity.load_or_create(path)
    assert Identity.load_or_create(path).peer_id == first.peer_id
    assert path.stat().st_mode & 0o777 == 0o600
    rsa_der = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    for content in (rsa_der, b"garbage"):
        path.write_bytes(content)
        with pytest.raises(KeyFileError, match="no Ed25519 private key"):
            Identity.load_or_create(path)
