"""The one place an algorithm's name (`--algo`, `run.algo`) maps to its config section and builder.

Each entry says how the runtime must build the algorithm's collective (``exchange``: a sharded
reduce of one payload, or NoLoCo's pair exchange; ``codec`` on the wire; ``combiner``, the payload
combiner of the sparse algorithms, or the dense mean with DiLoCo's robust rule, `diloco.aggregate`;
None: the plain mean, which ddp keeps to stay exact data parallelism; ``epoch_rounds``, rounds per
membership epoch) and builds the replica from a `ReplicaSpec`. The one-step-delay overlap
(`diloco.overlap`, `sparseloco.overlap`) wraps the replica the entry builds; DeMo's (`demo.overlap`)
is its replica's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lowcomm.algorithms.base import Replica, ReplicaSpec
from lowcomm.algorithms.ddp import DataParallel
from lowcomm.algorithms.demo_replica import Demo
from lowcomm.algorithms.demo_replica import combiner as demo_combiner
from lowcomm.algorithms.diloco import DiLoCo
from lowcomm.algorithms.noloco import group_of
from lowcomm.algorithms.noloco_replica import NoLoCo
from lowcomm.algorithms.overlapped import Overlapped
from lowcomm.algorithms.sparseloco_replica import SparseLoCo
from lowcomm.algorithms.sparseloco_replica import combiner as sparseloco_combiner
from lowcomm.algorithms.streaming_replica import StreamingDiLoCo
from lowcomm.collectives.combiners import DenseMean

REDUCE, PAIRS = "reduce", "pairs"


@dataclass(frozen=True)
class Algorithm:
    name: str
    section: str  # the run config's section of its hyper-parameters
    exchange: str  # REDUCE (collectives.sharded_reduce) or PAIRS (collectives.pair_exchange)
    codec: Callable[[object], str]  # run config -> the codec of its payload on the wire
    build: Callable[[ReplicaSpec], Replica]
    combiner: Callable[[object, list], object] = lambda config, shapes: None  # run config, shapes -> combiner
    per_step: bool = False  # syncs every optimizer step, in membership epochs of `ddp.epoch_steps`

    def epoch_rounds(self, config) -> int:
        return config.ddp.epoch_steps if self.per_step else 1

    def overlaps(self, config) -> bool:
        """Whether the round-based one-step-delay overlap wraps the replica (a per-step algorithm's own
        overlap, DeMo's one step late, is inside its replica)."""
        return not self.per_step and bool(getattr(getattr(config, self.section), "overlap", False))

    def replica(self, spec: ReplicaSpec) -> Replica:
        """The replica of ``spec``, wrapped in the one-step-delay overlap where the config asks for it."""
        replica = self.build(spec)
        if not self.overlaps(spec.config):
            return replica
        section = getattr(spec.config, self.section)
        return Overlapped(replica, spec.manifest_of, getattr(section, "overlap_update", "delayed"),
                          getattr(section, "overlap_apply", "arrival"), getattr(section, "overlap_lead", 1.0))


def _dense(codec: Callable[[object], str]) -> Callable[[object, list], DenseMean]:
    """The dense combiner of DiLoCo and Streaming DiLoCo: ``codec``, with the `[diloco]` robust aggregate."""
    return lambda c, shapes: DenseMean(codec(c), c.sync.zstd_level, c.diloco.robust_aggregate())


def _diloco_codec(c) -> str:
    return c.diloco.codec


def _streaming_codec(c) -> str:
    return c.streaming.codec


def _common(spec: ReplicaSpec) -> dict:
    return {"tokens_per_step": spec.tokens_per_step, "hooks": spec.hooks}


def _demo(spec: ReplicaSpec) -> Demo:
    config = spec.config
    # the run's warm-up schedule, scaled to DeMo's own lr
    lr_at = None if spec.lr_at is None else (lambda step: spec.lr_at(step) * config.demo.lr / config.inner.lr)
    return Demo(spec.model, config.demo, spec.collective, spec.key, lr_at, **_common(spec),
                overlap=config.demo.overlap_update if config.demo.overlap else "", epoch_steps=config.ddp.epoch_steps)


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("diloco", "diloco", REDUCE, _diloco_codec,
              lambda s: DiLoCo(s.model, s.config.diloco, s.collective, s.key, **_common(s)),
              combiner=_dense(_diloco_codec)),
    Algorithm("streaming-diloco", "streaming", REDUCE, _streaming_codec,
              lambda s: StreamingDiLoCo(s.model, s.config.diloco, s.config.streaming, s.collective, s.key,
                                        **_common(s)),
              combiner=_dense(_streaming_codec)),
    Algorithm("sparseloco", "sparseloco", REDUCE, lambda c: c.diloco.codec,
              lambda s: SparseLoCo(s.model, s.config.sparseloco, s.collective, s.key, **_common(s)),
              combiner=lambda c, shapes: sparseloco_combiner(c.sparseloco, shapes)),
    Algorithm("demo", "demo", REDUCE, lambda c: c.diloco.codec, _demo,
              combiner=lambda c, shapes: demo_combiner(c.demo, shapes), per_step=True),
    Algorithm("noloco", "noloco", PAIRS, lambda c: c.noloco.codec,
              lambda s: NoLoCo(s.model, s.config.noloco, s.collective, s.key, **_common(s))),
    Algorithm("ddp", "ddp", REDUCE, lambda c: "fp32",
              lambda s: DataParallel(s.model, s.optimizer, s.collective, s.key, **_common(s)), per_step=True),
)}
NAMES = tuple(ALGORITHMS)


def algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}: use one of {', '.join(NAMES)}") from None


def noloco_grouping(config) -> Callable:
    """NoLoCo's (run, round, members) -> {member: its group}, for the pair exchange."""
    return lambda run, round_, members: group_of(run, round_, members, config.noloco.group_size)
