"""The quorum a manifest needs (training peers; docs/round-protocol.md, Decision 27): who may write, and
follow, the manifest of a round, from the previous manifest's members and the live peer records.

The previous manifest's members still training in the DHT (this peer counts) must be a majority among
the round's members: a member that left, or that is resyncing (its record `joining`: it comes back
through a state download from the others), does not count. A member known only from its announcement
ahead does not count either: it may be far behind, or gone. A peer that was a member of a previous
manifest with others never takes a round alone, unless every other one of them is visibly resyncing
(a cut-off peer never sees that: it sees their records as they were, then none). When none of the
previous members is training any more, the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from lowcomm.transport.control import PeerRecord


def short_of_quorum(me: str, previous: frozenset[str], members: Iterable[str],
                    records: Mapping[str, PeerRecord]) -> str | None:
    """Why ``me`` must not write a manifest whose ``members`` reached the round after a manifest with
    ``previous`` members, given the live ``records``; None if it may."""
    members = set(members)
    if solo_after_others(me, previous, members, records):
        return "this peer alone reached the round, and the previous round had other members"
    live = {p for p, rec in records.items() if rec.state == "training"} | {me}
    standing = previous & live
    present = standing & members
    if standing and 2 * len(present) <= len(standing):
        return f"{len(present)} of the previous round's {len(standing)} live members reached it, not a majority"
    return None


def short_of_quorum_read(me: str, previous: frozenset[str], members: Iterable[str],
                         cached: Mapping[str, PeerRecord], fresh: Callable[[], Mapping[str, PeerRecord]]) -> str | None:
    """`short_of_quorum` on the ``cached`` records where they count every previous member as training and
    give the quorum (a newer read can only count fewer), else on the records ``fresh()`` reads."""
    members = set(members)
    if all(p == me or (p in cached and cached[p].state == "training") for p in previous):
        if short_of_quorum(me, previous, members, cached) is None:
            return None
    return short_of_quorum(me, previous, members, fresh())


def solo_after_others(me: str, previous: frozenset[str], members: Iterable[str],
                      records: Mapping[str, PeerRecord]) -> bool:
    """Whether ``members`` is ``me`` alone after a round with others that are not all resyncing."""
    others = previous - {me}
    resyncing = {p for p, rec in records.items() if rec.state == "joining"}
    return me in previous and bool(others - resyncing) and set(members) <= {me}
