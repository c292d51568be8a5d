"""Parts bound to their sender's key: forged senders, relabelled replays and tampered payloads are refused.

The attacks of issue 16 ("Why"): a part sent under another member's id (which got the victim's real
part refused as a replay), and a valid part of one round relabelled to another. Each part's first
chunk carries its sender's public key and a signature over its header and digest (transport.signing).
Real gRPC servers on loopback (test_sharded_reduce's nodes); assertions are on refusals and values.
"""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from lowcomm.collectives.combiners import DenseMean
from lowcomm.proto import wire_pb2
from lowcomm.transport.identity import peer_id_of
from lowcomm.transport.signing import Signer, Unauthenticated, Verifier, digest, signed_bytes
from unit.test_hostile_parts import open_slot, part, rejects
from unit.test_sharded_reduce import KEY, NUMEL, SYNC, WAIT_S, Board, nodes, payload  # noqa: F401 (nodes: the fixture)

REJECTED = wire_pb2.ReduceReply.REJECTED


def send(sender, owner, *chunks):
    return list(sender.channels.stub(owner.endpoint).Reduce(iter(chunks), timeout=WAIT_S))[0]


def test_a_part_under_another_members_id_is_refused_and_the_victims_own_part_counts(nodes):
    """The issue's forged contribution: weight 1e12, every value 1.0, under a victim's id, sent first."""
    members = nodes[:3]
    attacker, victim, owner = members
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    combiner = DenseMean("fp32", 0)
    bounds = combiner.shard_bounds(3, NUMEL)
    shard = sorted(n.id for n in members).index(owner.id)
    forged = combiner.encode(torch.ones(NUMEL), bounds[shard])
    for weight in (1.0, 1e12):  # refused at once, before the owner even started the round
        reply = send(attacker, owner, part(attacker.signer, 0, shard=shard, weight=weight, blob=forged,
                                           sender=victim.id))
        assert reply.status == REJECTED and "not the key of" in reply.error
    # the victim's key, the attacker's signature
    header = part(attacker.signer, 0, shard=shard, blob=forged, sender=victim.id)
    header.sender_key = victim.signer.key
    reply = send(attacker, owner, header)
    assert reply.status == REJECTED and "bad signature" in reply.error
    payloads = [payload(i) for i in range(3)]
    results = [h.result(WAIT_S) for h in [r.start(KEY, 0, p, 1.0) for r, p in zip(reduces, payloads)]]
    for result in results:  # the victim's real part was no replay: every member is in, values untouched
        assert result.contributors == sorted(n.id for n in members)
        torch.testing.assert_close(result.aggregate, sum(payloads) / 3, rtol=1e-5, atol=1e-5)
    assert len(rejects(owner)) == 3


@pytest.mark.parametrize("field, value", [("round", 1), ("shard", 1), ("weight", 1e6), ("epoch", 1),
                                          ("run_id", "another-run"), ("group", "other/0"), ("codec", "uint8")])
def test_a_valid_part_relabelled_to_another_round_shard_weight_or_run_is_refused(nodes, field, value):
    owner, victim = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, victim.id}))
    for round_ in (0, 1):
        open_slot(reduce, round_, {owner.id, victim.id}, owner.id)
    blob = DenseMean("fp32", 0).encode(payload(1), (0, NUMEL))
    captured = part(victim.signer, 0, blob=blob)  # the victim's own valid part of round 0
    setattr(captured, field, value)
    reply = send(victim, owner, captured)
    assert reply.status == REJECTED and "bad signature" in reply.error
    assert [e["sender"] for e in rejects(owner)] == [victim.id[:40]]


def test_a_tampered_payload_unsigned_part_or_foreign_run_is_refused_before_decoding(nodes):
    owner, member = nodes[0], nodes[1]
    reduce = owner.reduce(Board(KEY.run, {owner.id, member.id}))
    slot = open_slot(reduce, 0, {owner.id, member.id}, owner.id)
    blob = DenseMean("fp32", 0).encode(payload(1), (0, NUMEL))
    tampered = part(member.signer, 0, blob=blob)
    tampered.data = DenseMean("fp32", 0).encode(payload(2), (0, NUMEL))  # same size, other values
    assert send(member, owner, tampered).error.endswith("does not match its signed digest")
    unsigned = part(member.signer, 0, blob=blob)
    unsigned.ClearField("signature")
    assert "is not signed" in send(member, owner, unsigned).error
    keyless = part(member.signer, 0, blob=blob)
    keyless.ClearField("sender_key")
    assert "no usable public key" in send(member, owner, keyless).error
    stranger = Signer.generate()  # a valid signature by a key that is not a member's
    assert "is not a member" in send(member, owner, part(stranger, 0, blob=blob)).error
    assert len(rejects(owner)) == 4 and not slot.items


def test_a_refused_member_costs_its_round_no_deadline(nodes):
    """An owner stops waiting for a member whose part it refused: the round ends with the others' parts
    long before a reduce deadline of 10 × the test's wait."""
    members = nodes[:3]
    board = Board(KEY.run, {n.id for n in members})
    reduces = [n.reduce(board) for n in members]
    for r in reduces:
        r.sync = type(SYNC)(**{**SYNC.__dict__, "reduce_timeout_s": 10 * WAIT_S})
        r.max_weight = 4096.0
    payloads = [payload(i) for i in range(3)]
    weights = [4096.0, 1e9, 4096.0]  # members[1] inflates its weight: every owner refuses its part
    results = [h.result(WAIT_S) for h in [r.start(KEY, 0, p, w) for r, p, w in zip(reduces, payloads, weights)]]
    for result in results:
        assert result.contributors == sorted([members[0].id, members[2].id])


def test_signatures_bind_every_header_field_and_refuse_other_key_types():
    signer, verifier = Signer.generate(), Verifier()
    fields = dict(run_id="r", round=3, weight=2.5, digest=digest(b"x"))
    key, signature = signer.sign("reduce", fields)
    verifier.verify("reduce", fields, signer.peer_id, key, signature)
    for changed in (dict(fields, round=4), dict(fields, weight=2.5000001), dict(fields, digest=digest(b"y"))):
        with pytest.raises(Unauthenticated, match="bad signature"):
            verifier.verify("reduce", changed, signer.peer_id, key, signature)
    with pytest.raises(Unauthenticated, match="bad signature"):
        verifier.verify("exchange", fields, signer.peer_id, key, signature)  # another kind of call
    assert signed_bytes("reduce", fields) != signed_bytes("reduce", dict(fields, run_id="r2"))
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    for fake in (b"ssh-ed25519 AAAAnotakey", rsa_key[:120]):  # malformed, and another key type (bounded)
        with pytest.raises(Unauthenticated, match="no ssh-ed25519 public key"):
            verifier.verify("reduce", fields, peer_id_of(b"[owner:" + fake + b"]"), fake, signature)
    with pytest.raises(Unauthenticated, match="no usable public key"):  # too long to parse at all
        verifier.verify("reduce", fields, peer_id_of(b"[owner:" + rsa_key + b"]"), rsa_key, signature)
    for short in (signature[:63], signature + b"x"):
        with pytest.raises(Unauthenticated, match="is not signed"):
            verifier.verify("reduce", fields, signer.peer_id, key, short)
