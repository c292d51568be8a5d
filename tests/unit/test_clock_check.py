"""A joiner's check of its clock against the coordinator's record (runtime.clock_check): it warns only
when the offset is certain from the record's store time, whatever the record's age (0 to a lifetime)."""

from __future__ import annotations

from lowcomm.runtime.clock_check import clock_warning
from lowcomm.transport.control import CLOCK_AHEAD_S, PeerRecord

TTL = 10.0


def coordinator(stored_at: float) -> PeerRecord:
    return PeerRecord("c", "c:1", state="coordinator", heartbeat=stored_at)


def test_a_clock_that_agrees_is_not_warned_about_whatever_the_records_age():
    for age in (0.0, TTL / 2, TTL):
        assert clock_warning(coordinator(1000.0), 1000.0 + age, TTL) is None
    assert clock_warning(None, 1000.0, TTL) is None  # no coordinator record read: nothing to compare


def test_a_clock_behind_by_more_than_half_a_lifetime_is_warned_about_with_what_to_do():
    warning = clock_warning(coordinator(1000.0), 1000.0 - 60.0, TTL)
    assert warning is not None and "at least 60 s behind" in warning and "NTP" in warning
    assert clock_warning(coordinator(1000.0), 1000.0 - TTL / 2 + 0.1, TTL) is None


def test_a_clock_far_ahead_is_warned_about_and_a_fresh_records_age_is_not_taken_for_it():
    ahead = CLOCK_AHEAD_S  # offset; the record may be up to a lifetime old, so only offset > allowance / 2 is sure
    warning = clock_warning(coordinator(1000.0), 1000.0 + ahead + TTL, TTL)
    assert warning is not None and f"at least {ahead:.0f} s ahead" in warning
    assert clock_warning(coordinator(1000.0), 1000.0 + CLOCK_AHEAD_S / 2 + TTL - 1.0, TTL) is None
