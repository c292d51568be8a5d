"""The checkpoint downloads' share of the swarm's bytes (runtime.checkpoint_budget): a download is due
only once the downloads so far and the next one stay within `checkpoint.max_share` of every byte the
peers say they sent, the stats are read only when a read could change that, and the coordinator asks
no peer for its state while the budget holds it back."""

from __future__ import annotations

from types import SimpleNamespace

from lowcomm.config import RunConfig
from lowcomm.runtime.checkpoint_budget import STATS_READ_S, CheckpointBudget
from lowcomm.runtime.coordinator import Coordinator
from lowcomm.runtime.state_transfer import StateError
from lowcomm.transport.control import PeerRecord


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Stats:
    """The peers' stats as a read answers them (the pulls, or the DHT's); counts the reads."""

    def __init__(self):
        self.sent: dict[str, int] = {}
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return {p: {"sent": n} for p, n in self.sent.items()}


def test_a_download_waits_until_it_fits_the_share_and_the_stats_are_read_only_when_they_can_tell():
    clock, stats = Clock(), Stats()
    budget = CheckpointBudget(0.05, stats, first_bytes=1000, clock=clock)
    assert budget.needed() == 19_000  # 1000 <= 0.05 * (19000 + 1000)
    stats.sent = {"a": 5000, "b": 5000}
    assert not budget.allows() and stats.reads == 1
    clock.t += STATS_READ_S - 1
    assert not budget.allows() and stats.reads == 1  # not read again before STATS_READ_S
    clock.t += 1
    stats.sent = {"a": 7000, "b": 7000}  # 4000 in 30 s: 5000 more would take 37.5 s
    assert not budget.allows() and stats.reads == 2
    clock.t += 37
    assert not budget.allows() and stats.reads == 2  # the projection defers the read
    clock.t += 1
    stats.sent = {"a": 9500, "b": 9500}
    assert budget.allows() and stats.reads == 3
    budget.spent(3000)  # the real size sizes the next one: (3000 + 3000) / 0.05 - 6000
    assert budget.needed() == 114_000 and not budget.allows()


def test_a_peer_that_left_keeps_its_part_an_outsider_has_none_and_a_shrunk_figure_counts_at_its_largest():
    clock, stats = Clock(), Stats()
    budget = CheckpointBudget(0.5, stats, admits=lambda p: p != "outsider", first_bytes=100, clock=clock)
    stats.sent = {"a": 40, "b": 40, "outsider": 10 ** 12}
    assert not budget.allows() and budget.swarm_sent() == 80  # needs 100
    clock.t += STATS_READ_S
    stats.sent = {"a": 10}  # b left, a claims less than before
    assert not budget.allows() and budget.swarm_sent() == 80
    clock.t += 600
    stats.sent = {"a": 60}
    assert budget.allows() and budget.swarm_sent() == 100


def test_no_cap_reads_nothing_and_a_fast_swarm_is_read_at_most_most_wait_s_apart():
    clock, stats = Clock(), Stats()
    assert CheckpointBudget(0.0, stats, first_bytes=10 ** 9, clock=clock).allows() and stats.reads == 0
    budget = CheckpointBudget(0.05, stats, first_bytes=10 ** 9, most_wait_s=120.0, clock=clock)
    assert not budget.allows()
    clock.t += STATS_READ_S
    stats.sent = {"a": 1}  # a crawl: the projection is days away, the next read is not
    assert not budget.allows() and stats.reads == 2
    clock.t += 120
    assert not budget.allows() and stats.reads == 3


def test_the_coordinator_asks_no_peer_for_its_state_until_the_budget_allows(tmp_path, monkeypatch):
    config = RunConfig()
    config.checkpoint.every_rounds, config.checkpoint.every_s, config.checkpoint.max_share = 2, 0.0, 0.05
    stats = Stats()
    live = {"a": PeerRecord("a", "a:1", state="training", round=4)}
    coordinator = Coordinator(config, tmp_path)
    coordinator.control = SimpleNamespace(live_peers=lambda: live)
    coordinator.channels = coordinator.traffic = None
    pulled_for = []  # the records whose peers' stats were pulled (transport.stats_pulls.LiveStats)

    class Pulls:  # LiveStats, answering as Stats does
        def __init__(self, control, traffic, admits):
            assert admits == coordinator.admission.admits  # the run's admitted peers only

        def __call__(self, records):
            pulled_for.append(records)
            return stats()

        def close(self):
            pass
    monkeypatch.setattr("lowcomm.runtime.coordinator.LiveStats", Pulls)
    coordinator.follower = None  # no rounds to follow: only the checkpoint's own checks run
    asked = []

    def download(channels, traffic, endpoint, run, me, target, **kw):
        asked.append(endpoint)
        raise StateError("busy")  # the asking is what counts here, not the state

    monkeypatch.setattr("lowcomm.runtime.coordinator.download_state", download)
    coordinator._maybe_checkpoint()
    first = coordinator._budget.next_bytes
    assert asked == [] and stats.reads == 1 and first > 0  # the model's fp32 parameters
    assert pulled_for == [live]  # the stats of the live peers, pulled from them
    stats.sent = {"a": coordinator._budget.needed()}
    coordinator._budget._next_read = float("-inf")  # as if the projected read were due
    coordinator._maybe_checkpoint()
    assert asked == ["a:1"]
