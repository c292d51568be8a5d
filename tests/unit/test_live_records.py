"""The live peer records in a round's agreement (collectives.round_reads, Decision 41). With posts they are
read at most once per a record's life, and once per DHT poll only where a look needs them fresh; a peer
that fell behind reads them again at its next look; a peer that posted its withdrawal is not waited for,
nor in the rounds after while it stays silent, and its next announcement makes it a member again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lowcomm.collectives import round_reads
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.round_reads import RoundReads
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import RoundPosts
from lowcomm.transport.signing import Signer
from lowcomm.transport.wakeups import Wakes, Wakeups
from threads import in_threads
from unit.test_round_posts import Delivery, PostingControl

NEVER_S = 3600.0  # no poll and no deadline comes within the test
RECORD_LIFE_S, DHT_POLL_S = 10.0, 2.0


class Clock:
    """round_reads' time, moved by the test: the records' age is what it says."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(round_reads, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


@pytest.fixture(scope="module")
def signers():
    return sorted((Signer.generate() for _ in range(3)), key=lambda s: s.peer_id)


def test_with_posts_the_records_are_read_once_per_their_life_and_fresh_where_asked(clock, signers):
    control = PostingControl("me", {}, {"a": PeerRecord("a", "a:1", state="training")})
    wakes = Wakes(Wakeups(), None, poll_s=0.05, posts=RoundPosts("run"), signer=signers[0], dht_poll_s=DHT_POLL_S)
    reads = RoundReads(control, wakes, records_s=RECORD_LIFE_S)
    assert "a" in reads.live() and control.reads["peers"] == 1
    clock.now += 5
    reads.live()  # younger than a record's life: the ones read
    assert control.reads["peers"] == 1
    reads.live(fresh=True)  # older than a DHT poll: read again
    assert control.reads["peers"] == 2
    clock.now += 1
    reads.live(fresh=True)
    assert control.reads["peers"] == 2
    clock.now += RECORD_LIFE_S
    reads.live()
    assert control.reads["peers"] == 3
    reads.forget()  # this peer fell behind: the next look reads
    reads.live(cached=True)
    assert control.reads["peers"] == 4
    # without posts, nothing says who reached a round: every DHT poll
    polling = RoundReads(control, Wakes.polling(DHT_POLL_S), records_s=RECORD_LIFE_S)
    polling.live()
    clock.now += DHT_POLL_S + 1
    polling.live()
    assert control.reads["peers"] == 6


def agree_all(agreements, round_: int) -> list:
    """Each agreement of ``round_`` in its own thread; a wait for a peer that never announces never ends."""
    return in_threads(lambda r: agreements[r].agree("0-0", round_, 1, "fp32"), len(agreements))


def test_a_withdrawn_peer_is_not_waited_for_while_silent_and_steady_rounds_read_no_records(clock, signers):
    a, b, c = ids = [s.peer_id for s in signers]
    by_id = {s.peer_id: s for s in signers}
    boards = {f"{p}:1": (RoundPosts("run"), Wakeups()) for p in ids}
    delivery = Delivery(boards)
    store = {}
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ids}  # c's stays "training" throughout
    controls = {p: PostingControl(p, store, live) for p in ids}
    sync = SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S, record_ttl_s=RECORD_LIFE_S)
    agreements = {p: ManifestAgreement(controls[p], sync, f"{p}:1", quorum=True, records_s=RECORD_LIFE_S,
                                       wakes=Wakes(boards[f"{p}:1"][1], delivery, poll_s=NEVER_S,
                                                   posts=boards[f"{p}:1"][0], signer=by_id[p], dht_poll_s=DHT_POLL_S))
                  for p in ids}
    for agreement in agreements.values():
        agreement.learn("0-0", 4, ids)

    agreements[c].withdraw("0-0", 5)  # posted to a and b (and stored)
    five = agree_all([agreements[a], agreements[b]], 5)
    assert [m.members for m in five] == [[a, b]] * 2
    reads = {p: controls[p].reads["peers"] for p in (a, b)}

    clock.now += 3  # a round later: older than a DHT poll, younger than a record's life
    six = agree_all([agreements[a], agreements[b]], 6)  # c's record unchanged, nothing posted since: not due
    assert [m.members for m in six] == [[a, b]] * 2
    assert {p: controls[p].reads["peers"] for p in (a, b)} == reads  # every previous member reached it: no read

    clock.now += 3
    agreements[c].announce("0-0", 7)  # c comes back: due again, and a member
    seven = agree_all([agreements[a], agreements[b], agreements[c]], 7)
    assert [m.members for m in seven] == [ids] * 3
    assert {p: controls[p].reads["peers"] for p in (a, b)} == reads
