"""A live record that never announces (a dead peer's until it expires, a sybil's forged `training`
record, a cut-off peer's from before the cut) costs the rounds one wait of `announce_s`, not one per
round; its peer is waited for again once it posts an announcement, or once its record changes if it
was seen taking part or missed fewer than two rounds (collectives.silent_records). Over
test_who_counts' in-memory control plane; assertions are on the `timeout` events that name who a
round waited for, never on durations."""

from __future__ import annotations

import threading

from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.base import CollectiveError, NotInRound
from lowcomm.collectives.manifest import Manifest, ManifestAgreement
from lowcomm.collectives.silent_records import SilentRecords
from lowcomm.transport.control import PeerRecord
from lowcomm.transport.round_posts import ANNOUNCE, MANIFEST, RoundPosts
from lowcomm.transport.wakeups import Wakes
from unit.test_who_counts import MemoryControl

GROUP = "0-0"
SYNC = SyncConfig(announce_s=0.2, manifest_s=0.2)
NEVER_S = 3600.0  # a wait that never ends within the test
WAIT_S = 60.0  # a bound only a wait that did not end reaches; never asserted as a duration


class PostedControl(MemoryControl):
    """Takes the manifests posted to this peer as they are (the real control plane checks their records)."""

    def parse_manifests(self, records):
        return dict(records)


def waited_for(events: list, round_: int) -> list[str]:
    """The peers round ``round_`` waited `announce_s` for and went on without."""
    return [p for kind, f in events if kind == "timeout" and f.get("stage") == "announce" and f["round"] == round_
            for p in f["missing"]]


def lone_peer(live: dict) -> tuple[ManifestAgreement, list]:
    """Peer "a"'s agreement; it reads the live records at every look (no poll interval: none is cached)."""
    events = []
    agreement = ManifestAgreement(MemoryControl("a", {}, live), SYNC, "a:1", wakes=Wakes.polling(0.0),
                                  on_event=lambda kind, **f: events.append((kind, f)))
    return agreement, events


def test_a_record_that_never_announces_costs_one_wait_until_it_changes():
    live = {"a": PeerRecord("a", "a:1", state="training", round=5),
            "s": PeerRecord("s", "s:1", state="training", round=5)}  # refreshed, never announcing
    agreement, events = lone_peer(live)
    for round_ in (5, 6, 7):
        assert agreement.agree(GROUP, round_, 1, "fp32").members == ["a"]
    assert [waited_for(events, r) for r in (5, 6, 7)] == [["s"], [], []]
    live["s"] = PeerRecord("s", "s:1", state="training", round=8)  # it moved on: due again
    agreement.agree(GROUP, 8, 1, "fp32")
    assert waited_for(events, 8) == ["s"]


def test_a_record_that_names_each_next_round_but_never_announces_costs_two_waits():
    """A sybil's forged `training` record that moves to each next round and never announces: a changed
    record makes a peer never seen taking part due again only until it missed two rounds; then only a
    posted announcement does (or a followed manifest naming it)."""
    live = {"a": PeerRecord("a", "a:1", state="training", round=5)}
    agreement, events = lone_peer(live)
    for round_ in range(5, 10):
        live["s"] = PeerRecord("s", "s:1", state="training", round=round_)
        agreement.agree(GROUP, round_, 1, "fp32")
    assert [waited_for(events, r) for r in range(5, 10)] == [["s"], ["s"], [], [], []]
    posted = {(ANNOUNCE, GROUP, 9): {"s": {"endpoint": "s:1"}}}  # it announced a round: a peer after all
    agreement.wakes.posted = lambda kind, group, round_: posted.get((kind, group, round_), {})
    live["s"] = PeerRecord("s", "s:1", state="training", round=10)
    agreement.agree(GROUP, 10, 1, "fp32")
    assert waited_for(events, 10) == ["s"]


def test_a_peer_seen_taking_part_is_waited_for_whenever_its_record_moves_on():
    """A member that missed rounds (slow, resyncing) while no announcement post reaches this peer (a
    client-mode peer gets none): its record naming each next round makes it due in every round."""
    live = {"a": PeerRecord("a", "a:1", state="training", round=5)}
    agreement, events = lone_peer(live)
    agreement.learn(GROUP, 4, ["a", "m"])  # m took part in round 4
    for round_ in range(5, 9):
        live["m"] = PeerRecord("m", "m:1", state="training", round=round_)
        agreement.agree(GROUP, round_, 1, "fp32")
    assert [waited_for(events, r) for r in range(5, 9)] == [["m"]] * 4


def test_a_peer_seen_announcing_is_due_again_whenever_its_record_moves_on():
    """A peer a gather saw announcing (though the manifest followed left it out: it came too late for the
    leader) counts as taking part: its record naming each next round makes it due, however many it missed."""
    silent = SilentRecords(Wakes.polling(0.0))
    silent.close(GROUP, 5, {"s": PeerRecord("s", "s:1", state="training", round=5)}, {"s": {"endpoint": "s:1"}}, set())
    for round_ in range(6, 10):
        records = {"s": PeerRecord("s", "s:1", state="training", round=round_)}
        assert silent.silent(GROUP, round_, {"s"}, records) == set()
        silent.close(GROUP, round_, records, {}, {"s"})  # it missed the round


def test_a_record_not_due_in_a_round_keeps_its_misses():
    """A forged record that skips ahead of a round (not due in it) does not start its count again."""
    live = {"a": PeerRecord("a", "a:1", state="training", round=5)}
    agreement, events = lone_peer(live)
    for round_, at in ((5, 5), (6, 6), (7, 9), (8, 8), (9, 9)):  # at round 7 it names round 9: not due
        live["s"] = PeerRecord("s", "s:1", state="training", round=at)
        agreement.agree(GROUP, round_, 1, "fp32")
    assert [waited_for(events, r) for r in range(5, 10)] == [["s"], ["s"], [], [], []]


def test_a_peer_that_missed_a_round_and_announced_it_late_is_waited_for_again():
    live = {"a": PeerRecord("a", "a:1", state="training", round=5),
            "b": PeerRecord("b", "b:1", state="training", round=5)}  # its record lags behind it
    agreement, events = lone_peer(live)
    agreement.agree(GROUP, 5, 1, "fp32")
    posted = {(ANNOUNCE, GROUP, 5): {"b": {"endpoint": "b:1"}}}  # b's late announcement of round 5
    agreement.wakes.posted = lambda kind, group, round_: posted.get((kind, group, round_), {})
    agreement.agree(GROUP, 6, 1, "fp32")
    assert [waited_for(events, r) for r in (5, 6)] == [["b"], ["b"]]


def test_a_posted_manifest_that_names_this_peer_ends_its_wait_on_announcements_it_never_saw():
    """A joiner none of its first round's announcement posts reached (the others' last reads of the
    records predate it) goes on once the leader's manifest naming it is posted, and waits for nobody:
    the members it never heard from are in the manifest. Its `announce_s` is an hour: only the
    manifest can end the wait within the test's bound."""
    ids = ["a", "b", "c"]
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ids}
    manifest = Manifest("run", GROUP, 5, 1, "b", ids, {p: f"{p}:1" for p in ids}, ids, "fp32").to_dict()
    events, result = [], []
    agreement = ManifestAgreement(PostedControl("a", {}, live), SyncConfig(announce_s=NEVER_S, manifest_s=0.2),
                                  "a:1", wakes=Wakes.polling(0.01), on_event=lambda kind, **f: events.append((kind, f)))
    agreement.wakes.posted = lambda kind, group, round_: {"b": manifest} if (kind, round_) == (MANIFEST, 5) else {}
    thread = threading.Thread(target=lambda: result.append(agreement.agree(GROUP, 5, 1, "fp32")), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert result and result[0].members == ids
    assert waited_for(events, 5) == []


def test_a_peer_missed_in_a_round_whose_manifest_names_it_is_waited_for_next_round():
    """A peer that missed a member's announcement of a round but follows the manifest naming it (the
    manifest stored only, landing after the gather gave up on the member) waits for it in the next
    round: its record lags a heartbeat behind its rounds, so unchanged it is not silent."""
    store = {}
    live = {"a": PeerRecord("a", "a:1", state="training", round=5),
            "b": PeerRecord("b", "b:1", state="training", round=5)}  # b's announcements of 5 never reach a
    written = Manifest("run", GROUP, 5, 1, "b", ["a", "b"], {"a": "a:1", "b": "b:1"}, ["a", "b"], "fp32")
    events = []

    def on_event(kind, **f):
        events.append((kind, f))
        if kind == "timeout" and f["round"] == 5:  # the gather gave up on b: b's manifest lands now
            MemoryControl("b", store, live).publish_manifest(GROUP, 5, written.to_dict(), 60)

    agreement = ManifestAgreement(MemoryControl("a", store, live), SYNC, "a:1", wakes=Wakes.polling(0.0),
                                  on_event=on_event)
    assert agreement.agree(GROUP, 5, 1, "fp32").members == ["a", "b"]
    assert agreement.agree(GROUP, 6, 1, "fp32").members == ["a"]  # b never reaches 6 here
    assert [waited_for(events, r) for r in (5, 6)] == [["b"], ["b"]]


def behind(j_learnt: bool, writer: str, sync: SyncConfig, posted: bool = False) -> tuple[list, list]:
    """Peer j, posting, its DHT poll never due: a and b (the previous members) posted their announcements of
    round 5 and are past it, and a manifest of round 5 by ``writer`` without j is stored (also posted to j
    if ``posted``); s, a sybil's record, is due and never announces. Answers j's events and what its agree
    of round 5 gave or raised (in a thread, up to WAIT_S); j knows a and b as its anchor's members if
    ``j_learnt``."""
    store, ids = {}, ["a", "b"]
    live = {p: PeerRecord(p, f"{p}:1", state="training", round=6) for p in ids}
    live |= {p: PeerRecord(p, f"{p}:1", state="training", round=5) for p in ("j", "s")}
    announced = {p: {"peer_id": p, "endpoint": f"{p}:1"} for p in ids}  # posted to j as well
    written = Manifest("run", GROUP, 5, 1, writer, ids, {p: f"{p}:1" for p in ids}, ids, "fp32").to_dict()
    MemoryControl(writer, store, live).publish_manifest(GROUP, 5, written, 60)
    events, outcome = [], []
    wakes = Wakes(None, None, 0.01, posts=RoundPosts("run"), dht_poll_s=NEVER_S)  # the DHT read only when fresh
    posts = {(ANNOUNCE, 5): announced, (MANIFEST, 5): {writer: written} if posted else {}}
    wakes.posted = lambda kind, group, round_: posts.get((kind, round_), {})
    agreement = ManifestAgreement(PostedControl("j", store, live), sync, "j:1", wakes=wakes,
                                  on_event=lambda kind, **f: events.append((kind, f)))
    if j_learnt:
        agreement.learn(GROUP, 4, ids)  # the anchor it joined from

    def agree():
        try:
            outcome.append(agreement.agree(GROUP, 5, 1, "fp32"))
        except CollectiveError as e:
            outcome.append(e)

    thread = threading.Thread(target=agree, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    return events, outcome


def announce_timeouts(events: list, round_: int) -> list[dict]:
    return [f for kind, f in events if kind == "timeout" and f.get("stage") == "announce" and f["round"] == round_]


def test_a_peer_a_round_behind_stops_waiting_once_a_previous_member_wrote_the_round():
    """A peer that reaches a round the others already settled (a joiner whose state arrived while the round
    was in flight) reads the DHT's manifests once it sees a previous member's record past the round, and
    goes straight on with the manifest that leaves it out (NotInRound: it catches the round up) instead of
    waiting `announce_s` for a record that never announces. Its `announce_s` and `manifest_s` are an hour:
    only the manifest can end the wait, only a fresh read finds it (the DHT's poll is never due), and only
    following it at once ends the round (its candidate turn, after a's and b's, never comes)."""
    events, outcome = behind(True, "a", SyncConfig(announce_s=NEVER_S, manifest_s=NEVER_S))
    assert outcome and isinstance(outcome[0], NotInRound) and outcome[0].manifest.members == ["a", "b"]
    assert announce_timeouts(events, 5) == [{"round": 5, "stage": "announce", "missing": ["s"], "settled": True}]


def test_a_strangers_manifest_of_the_round_does_not_end_the_wait():
    """The same, the stored manifest a stranger's (x), posted to j as well: no previous member wrote it, so
    the wait runs to its end and j never follows it."""
    events, outcome = behind(True, "x", SyncConfig(announce_s=0.3, manifest_s=0.2), posted=True)
    assert announce_timeouts(events, 5) == [{"round": 5, "stage": "announce", "missing": ["s"]}]
    assert any(kind == "reject" and f["sender"] == "x" for kind, f in events)
    followed = outcome[0].manifest if isinstance(outcome[0], NotInRound) else outcome[0] if outcome else None
    assert not isinstance(followed, Manifest) or followed.leader != "x"


def test_a_peer_that_knows_no_previous_manifest_waits_to_the_end():
    """Without an anchor every writer counts, so a manifest posted to this peer that leaves it out does not
    end its wait while a due peer is missing; it is followed only once the wait ran out."""
    events, outcome = behind(False, "a", SyncConfig(announce_s=0.3, manifest_s=0.2), posted=True)
    assert announce_timeouts(events, 5) == [{"round": 5, "stage": "announce", "missing": ["s"]}]
    assert outcome and isinstance(outcome[0], NotInRound) and outcome[0].manifest.leader == "a"
