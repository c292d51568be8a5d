"""A read of the live peer records without this peer's own record (its stores did not land for a
record's life) keeps, for a while, the peers of the last read that held it (collectives.round_reads,
Decision 44): two peers whose reads come back empty still wait for each other and form their round
together, instead of each taking it alone and failing its quorum. Over test_who_counts' in-memory
control plane; assertions are on members, events and counts, never on durations."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from lowcomm.collectives import round_reads
from lowcomm.collectives.base import CollectiveError
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import ManifestAgreement
from lowcomm.collectives.round_reads import RoundReads
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import RoundPosts
from lowcomm.transport.signing import Signer
from lowcomm.transport.wakeups import Wakes, Wakeups
from unit.test_round_posts import Delivery, PostingControl
from unit.test_who_counts import MemoryControl

GROUP = "0-0"
WAIT_S = 60.0  # a bound only a lost announcement reaches; never asserted as a duration


def training(*ids: str, round_: int = 7) -> dict[str, PeerRecord]:
    return {p: PeerRecord(p, f"{p}:1", state="training", round=round_) for p in ids}


def test_a_read_without_the_own_record_keeps_the_peers_of_the_last_one_that_had_it():
    live, events = {}, []
    reads = RoundReads(MemoryControl("a", {}, live), Wakes.polling(0.0), lambda kind, **f: events.append((kind, f)),
                       keep_s=WAIT_S)
    live.update(training("b"))
    assert set(reads.live()) == {"b"}  # before its first record lands, a read is taken as it is
    live.update(training("a", "b"))
    assert set(reads.live()) == {"a", "b"}
    live.clear()  # the DHT answered nothing
    assert set(reads.live()) == {"a", "b"} and set(reads.live()) == {"a", "b"}
    live.update(training("c", round_=9), b=PeerRecord("b", "b:1", state="joining", round=9))  # still not its own
    view = reads.live()
    assert set(view) == {"a", "b", "c"} and view["b"].state == "joining"  # what the read has is taken
    assert reads.own_record_missing == 3
    assert events == [("own_record_missing", {"seen": [], "kept": ["a", "b"]})]  # one event per run of them
    live.update(training("a", "c"))
    assert set(reads.live()) == {"a", "b", "c"}  # a read with its record is taken as it is
    live.clear()
    assert set(reads.live()) == {"a", "c"}  # b, resyncing in the last read with a's record, is not kept
    assert [kind for kind, _ in events] == ["own_record_missing"] * 2


def test_the_peers_are_kept_for_keep_s_from_the_first_read_without_the_own_record(monkeypatch):
    clock, events = SimpleNamespace(now=100.0), []
    monkeypatch.setattr(round_reads, "time", SimpleNamespace(monotonic=lambda: clock.now))
    live = {**training("a", "b"), "j": PeerRecord("j", "j:1", state="joining", round=7)}
    reads = RoundReads(MemoryControl("a", {}, live), Wakes.polling(0.0), lambda kind, **f: events.append(f),
                       keep_s=10.0)
    assert set(reads.live()) == {"a", "b", "j"}
    live.clear()
    clock.now = 200.0  # (a round later)
    assert set(reads.live()) == {"a", "b"}  # a resyncing peer is not kept: it would let a take a round alone
    clock.now = 210.0
    assert set(reads.live()) == {"a", "b"}
    clock.now = 210.5  # more than keep_s after the first read without its record
    assert reads.live() == {} and reads.live() == {} and reads.own_record_missing == 2
    assert events == [{"seen": [], "kept": ["a", "b"]}, {"seen": [], "kept": [], "after_s": 10.0}]


class SignalledDelivery(Delivery):
    """Delivers posts as the service does; ``sent`` is set once any peer sent one."""

    def __init__(self, boards):
        super().__init__(boards)
        self.sent = threading.Event()

    def send(self, endpoints, request, on_failed=None):
        super().send(endpoints, request, on_failed)
        self.sent.set()


def test_two_peers_whose_reads_come_back_empty_still_form_their_rounds_together():
    """The chaos test's failure: once every read of the records came back empty (round 7's, whose
    announcements still went to the peers of the last read), each peer posted its announcement of
    round 8 to nobody, gathered alone and failed its quorum ("this peer alone reached the round")."""
    signers = sorted((Signer.generate() for _ in range(2)), key=lambda s: s.peer_id)
    a, b = (s.peer_id for s in signers)
    boards = {f"{p}:1": (RoundPosts("run"), Wakeups()) for p in (a, b)}
    delivery = SignalledDelivery(boards)
    store, live = {}, training(a, b)
    sync = SyncConfig(announce_s=WAIT_S, manifest_s=2.0, heartbeat_s=0.2, record_ttl_s=1.0)
    events = {p: [] for p in (a, b)}
    agreements = {s.peer_id: ManifestAgreement(  # polls of 0: every look reads the records again
        PostingControl(s.peer_id, store, live), sync, f"{s.peer_id}:1", quorum=True,
        wakes=Wakes(boards[f"{s.peer_id}:1"][1], delivery, poll_s=0.0, posts=boards[f"{s.peer_id}:1"][0],
                    signer=s, dht_poll_s=0.0),
        on_event=lambda kind, p=s.peer_id, **f: events[p].append(kind)) for s in signers}
    for agreement in agreements.values():
        agreement.reads.keep_s = WAIT_S  # (its record_ttl_s is short: the quorum's wait without the keep)
        agreement.learn(GROUP, 6, [a, b])  # round 6 had both
        assert set(agreement.reads.live()) == {a, b}
    live.clear()  # from here every read of the records comes back empty
    results = {}

    def agree(p, round_):
        try:
            results[p, round_] = agreements[p].agree(GROUP, round_, 1, "fp32").members
        except CollectiveError as e:
            results[p, round_] = str(e)

    both = [threading.Thread(target=agree, args=(p, 7)) for p in (a, b)]
    for t in both:
        t.start()
    for t in both:
        t.join(WAIT_S)
    delivery.sent.clear()
    first = threading.Thread(target=agree, args=(a, 8))
    first.start()
    assert delivery.sent.wait(WAIT_S)  # a announced round 8 before b did
    second = threading.Thread(target=agree, args=(b, 8))
    second.start()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert results == {(p, r): [a, b] for p in (a, b) for r in (7, 8)}
    for p in (a, b):
        assert "own_record_missing" in events[p] and "timeout" not in events[p], events[p]
