"""The [sync] section: deadlines, message sizes and fan-in of the collectives and the records they read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SyncConfig:
    announce_s: float = 2.0  # how long peers gather announcements for a round
    manifest_s: float = 5.0  # how long to wait for the leader's manifest before trying the next one
    reduce_timeout_s: float = 20.0  # deadline of one sharded reduce (noloco: pair exchange), from the manifest
    chunk_bytes: int = 1 << 20  # streamed gRPC message size
    zstd_level: int = 1  # zstd framing of payloads (0: off)
    max_contributors: int = 0  # G: the most members that send contributions in one round (0: all)
    heartbeat_s: float = 2.0  # how often a peer refreshes its record
    record_ttl_s: float = 30.0  # how long a record outlives its last heartbeat
