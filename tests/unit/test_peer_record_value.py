"""A peer record as stored: the fields off their defaults, read back whole (transport.peer_record.PeerRecord)."""

from dataclasses import asdict

from hivemind.utils.serializer import MSGPackSerializer

from lowcomm.transport.control import PeerRecord

TRAINING = dict(peer_id="Qm" + "a" * 44, endpoint="10.201.0.3:45123", state="training", throughput=1234.5678,
                round=57, step=1710, loss=2.3456789, loss_kind="held-out")


def test_a_data_parallel_record_stores_no_pipeline_field_and_reads_back_equal():
    record = PeerRecord(**TRAINING)
    value = record.value()
    assert set(value) == {*TRAINING, "heartbeat"}
    assert PeerRecord.from_value(value) == record
    # a record's value is signed and sent by every store and in every read's answer, once per record
    assert len(MSGPackSerializer.dumps(value)) < 0.7 * len(MSGPackSerializer.dumps(asdict(record)))


def test_a_stage_record_keeps_what_is_off_its_default():
    record = PeerRecord(**TRAINING, stage=2, stage_state="online", grad_norm=0.5, rollback_to=3, rollback_at=9,
                        token="t" * 40, link="20mbit:80ms", client_mode=True)
    value = record.value()
    assert {"stage", "stage_state", "grad_norm", "rollback_to", "rollback_at", "token", "link",
            "client_mode"} <= set(value)
    assert PeerRecord.from_value(value) == record


def test_a_fresh_record_stores_its_identity_address_and_time_only():
    record = PeerRecord(peer_id="Qm" + "b" * 44, endpoint="127.0.0.1:1")
    assert set(record.value()) == {"peer_id", "endpoint", "heartbeat"}
    read = PeerRecord.from_value(record.value())
    assert read == record and read.state == "joining" and read.stage == -1 and read.rollback_to == -1


def test_a_record_stored_whole_reads_the_same():
    record = PeerRecord(**TRAINING)
    assert PeerRecord.from_value(asdict(record)) == PeerRecord.from_value(record.value())
