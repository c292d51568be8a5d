"""A round's manifest as it is stored and posted, and who in it may contribute (collectives.manifest
says how peers agree on one)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from functools import cached_property

logger = logging.getLogger(__name__)


@dataclass
class Manifest:
    run: str
    group: str
    round: int  # first round of the epoch
    epoch_rounds: int
    leader: str
    members: list[str]
    endpoints: dict[str, str]
    owners: list[str]
    codec: str
    contributors: list[str] = field(default_factory=list)  # empty: every member contributes

    @property
    def senders(self) -> list[str]:
        """The members whose contributions the round's owners accept."""
        return self.contributors or self.members

    def covers(self, round_: int) -> bool:
        return self.round <= round_ < self.round + self.epoch_rounds

    def to_dict(self) -> dict:
        return asdict(self)

    @cached_property
    def digest(self) -> bytes:
        """What names this manifest on the data plane: the sha256 of its canonical JSON. Every part and
        shard request carries it, so two manifests of one round (a split) never mix their parts."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()).digest()

    @classmethod
    def from_dict(cls, raw: dict) -> "Manifest":
        manifest = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k != "contributors"},
                       contributors=list(raw.get("contributors") or []))
        if not set(manifest.contributors) <= set(manifest.members):
            raise ValueError("manifest names a contributor outside its members")
        if not manifest.owners or not set(manifest.owners) <= set(manifest.members):
            raise ValueError("manifest has no owners or an owner outside its members")
        if set(manifest.endpoints) != set(manifest.members):
            raise ValueError("manifest endpoints do not match its members")
        return manifest


def bounded_fan_in(run: str, group: str, round_: int, members: list[str], limit: int) -> list[str]:
    """The round's contributors when at most ``limit`` may send (0: no bound, returns [] = everyone)."""
    if limit <= 0 or len(members) <= limit:
        return []
    def key(peer: str) -> bytes:
        return hashlib.sha256(b"\x00".join(x.encode() for x in (run, group, str(round_), peer))).digest()
    return sorted(sorted(members, key=lambda peer: (key(peer), peer))[:limit])


def first_valid(manifests: dict[str, dict], group: str, round_: int,
                order: list[str] | None = None) -> Manifest | None:
    """The first well-formed manifest for (group, round_) in the writers' ``order`` (default: by id)."""
    for writer in (sorted(manifests or {}) if order is None else order):
        try:
            manifest = Manifest.from_dict(manifests[writer])
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("ignored a malformed manifest from %s: %s", writer, e)
            continue
        if manifest.round != round_ or manifest.group != group:
            continue
        return manifest
    return None


def first_outsider(writer: str, raw, admits) -> str | None:
    """The first of a raw manifest's ``writer`` and named members that ``admits(peer_id)`` refuses, if any."""
    members = raw.get("members") if isinstance(raw, dict) else None
    members = [m for m in members if isinstance(m, str)] if isinstance(members, list) else []
    return next((m for m in [writer, *members] if not admits(m)), None)
