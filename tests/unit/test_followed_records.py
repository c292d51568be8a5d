"""When the coordinator reads the live peer records it follows rounds by (runtime.round_anchor.FollowedRecords,
Decisions 51, 56): once per POSTED_RECORDS_POLL_S while every voter trains, sooner for a voter it has not seen
training."""

from __future__ import annotations

import pytest

from lowcomm.collectives.round_reads import POSTED_RECORDS_POLL_S
from lowcomm.runtime import round_anchor
from lowcomm.runtime.round_anchor import FollowedRecords
from lowcomm.transport.control import PeerRecord

HEARTBEAT_S, LIFE_S = 2.0, 10.0


class Records:
    """A control plane whose live records a test sets; it counts the reads."""

    def __init__(self):
        self.records: dict[str, PeerRecord] = {}
        self.reads = 0

    def set(self, **states: str) -> None:
        self.records = {p: PeerRecord(p, f"{p}:1", state=s, round=3) for p, s in states.items()}

    def live_peers(self) -> dict[str, PeerRecord]:
        self.reads += 1
        return dict(self.records)


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(round_anchor.time, "monotonic", lambda: now[0])
    return now


def reads_at(view: FollowedRecords, control: Records, clock, times: list[float], voters=frozenset()) -> list[float]:
    """The times among ``times`` at which a refresh for ``voters`` read the records."""
    out = []
    for t in times:
        clock[0] = t
        before = control.reads
        view.refresh(frozenset(voters))
        if control.reads > before:
            out.append(t)
    return out


def test_every_voter_training_reads_once_per_posted_records_poll(clock):
    control = Records()
    control.set(a="training", b="training")
    view = FollowedRecords(control, HEARTBEAT_S, LIFE_S)
    poll = POSTED_RECORDS_POLL_S
    assert poll > LIFE_S
    times = [0, 1, 2, 5, 10, 15, poll - 0.1, poll, poll + 10, 2 * poll - 0.1, 2 * poll]
    assert reads_at(view, control, clock, times, voters={"a", "b"}) == [0, poll, 2 * poll]
    assert view.training == {"a", "b"} and view.newest == 3 and not view.joiners


def test_a_voter_not_seen_training_is_read_for_after_a_heartbeat_then_every_half_life(clock):
    control = Records()
    control.set(a="training")
    view = FollowedRecords(control, HEARTBEAT_S, LIFE_S)
    assert reads_at(view, control, clock, [0], voters={"a"}) == [0]
    # b is named a voter: read again a heartbeat after the last read; still not training: every half life
    assert reads_at(view, control, clock, [1, 2, 3, 4, 6.9, 7, 8], voters={"a", "b"}) == [2, 7]
    assert view.training == {"a"}
    control.set(a="training", b="training")
    assert reads_at(view, control, clock, [11.9, 12, 13], voters={"a", "b"}) == [12]
    assert view.training == {"a", "b"}
    # from then on once per POSTED_RECORDS_POLL_S
    assert reads_at(view, control, clock, [22, 12 + POSTED_RECORDS_POLL_S - 0.1, 12 + POSTED_RECORDS_POLL_S],
                    voters={"a", "b"}) == [12 + POSTED_RECORDS_POLL_S]


def test_a_joining_record_keeps_the_half_life_cadence(clock):
    control = Records()
    control.set(a="training", c="joining")
    view = FollowedRecords(control, HEARTBEAT_S, LIFE_S)
    assert reads_at(view, control, clock, [0, 4.9, 5, 9.9, 10], voters={"a"}) == [0, 5, 10]
    assert view.joiners


def test_records_not_admitted_do_not_count_as_training(clock):
    control = Records()
    control.set(a="training", sybil="training")
    view = FollowedRecords(control, HEARTBEAT_S, LIFE_S, admits=lambda peer: peer != "sybil")
    view.refresh(frozenset({"a"}))
    assert view.training == {"a"}
