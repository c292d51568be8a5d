"""When a round's exclusion ends a membership epoch (collectives.sharded_reduce): with no lag the next
round agrees afresh; with a lag of one (DeMo one step late, whose next round may already have
started on the old manifest, on some peers and not others) every peer runs that next round on the
old manifest and agrees at the one after; an exclusion from a round before the current epoch (a
round left in flight across a resync) ends nothing."""

from __future__ import annotations

from lowcomm.collectives.base import GroupKey
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.manifest import Manifest
from lowcomm.collectives.sharded_reduce import ShardedReduce
from lowcomm.transport.service import PeerService
from lowcomm.transport.signing import Signer
from lowcomm.transport.wire import Channels, Traffic

KEY = GroupKey("run")
EPOCH = 50


class CountingAgreement:
    """Agrees instantly on a manifest of EPOCH rounds from the asked round; counts the agreements."""

    def __init__(self):
        self.agreed: list[int] = []

    def agree(self, group, round_, epoch_rounds, codec, suspects):
        self.agreed.append(round_)
        return Manifest("run", group, round_, EPOCH, "a", ["a", "b"], {"a": "a:1", "b": "b:1"}, ["a", "b"], codec)


def reduce(lag: int) -> tuple[ShardedReduce, CountingAgreement]:
    agreement = CountingAgreement()
    signer = Signer.generate()
    service = PeerService(signer.peer_id, Traffic(None), Channels(1 << 16))
    return ShardedReduce(signer, service, Channels(1 << 16), Traffic(None), agreement, SyncConfig(), "fp32",
                         EPOCH, lag=lag), agreement


def test_without_a_lag_the_round_after_an_exclusion_agrees_afresh():
    collective, agreement = reduce(lag=0)
    for round_ in range(6):
        collective._manifest_for(KEY, round_)
    collective.end_epoch(KEY, 5)
    collective._manifest_for(KEY, 6)
    assert agreement.agreed == [0, 6]


def test_with_a_lag_the_next_round_keeps_the_manifest_and_the_one_after_agrees():
    collective, agreement = reduce(lag=1)
    for round_ in range(6):
        collective._manifest_for(KEY, round_)
    collective.end_epoch(KEY, 5)
    collective._manifest_for(KEY, 6)  # may have started before round 5 ended, anywhere: the same manifest
    assert agreement.agreed == [0]
    collective._manifest_for(KEY, 7)
    assert agreement.agreed == [0, 7]
    collective.end_epoch(KEY, 6)  # round 6, in flight across the new epoch's start: ends nothing
    collective._manifest_for(KEY, 9)
    assert agreement.agreed == [0, 7]
    collective.end_epoch(KEY)  # a resync: at once
    collective._manifest_for(KEY, 9)
    assert agreement.agreed == [0, 7, 9]
