"""Typed run configuration: one dataclass per component, loaded from TOML, overridden by flags.

The embedded default (`lowcomm/configs/default.toml`) is the reference setup of BENCHMARKS.md.
A run config is hashed (sha256 of its canonical JSON) so checkpoints and peers can tell whether
they belong to the same run. The [link] and [churn] sections describe the emulated network and
its failures, not the training run, so they are left out of the hash: the same run may be
replayed under other links and other churn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from lowcomm.algorithms.demo import DemoConfig
from lowcomm.algorithms.noloco import NoLoCoConfig
from lowcomm.algorithms.sparseloco import SparseLoCoConfig
from lowcomm.algorithms.streaming import CODECS as STREAMING_CODECS
from lowcomm.algorithms.streaming import StreamingConfig, check_one_in_flight, rounds_started_by, step_after_rounds
from lowcomm.compress.topk import VALUE_CODECS
from lowcomm.runtime.churn import parse_churn
from lowcomm.transport.shaper import parse_link_option


ALGOS = ("diloco", "streaming-diloco", "sparseloco", "demo", "noloco", "ddp")
NOLOCO_CODECS = ("fp32", "bf16", "uint8")  # collectives.pair_payload.WIRE_CODECS
PER_STEP_ALGOS = ("ddp", "demo")  # sync every optimizer step, in membership epochs
UNHASHED_SECTIONS = ("link", "churn")  # the emulated network: not part of what makes two runs the same


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which key and what is allowed."""


@dataclass
class RunSection:
    name: str = "lowcomm-default"
    algo: str = "diloco"
    steps: int = 600
    seed: int = 0


@dataclass
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 64


@dataclass
class DataConfig:
    corpus: str = "stdlib"
    holdout_fraction: float = 0.02
    eval_batches: int = 16
    eval_every_tokens: int = 61440


@dataclass
class InnerConfig:
    lr: float = 1e-3
    warmup_steps: int = 50
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    batch_size: int = 16
    grad_clip: float = 0.0


@dataclass
class DilocoConfig:
    inner_steps: int = 30
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    codec: str = "uint8"
    overlap: bool = False  # one-step-delay overlap (ALGORITHMS.md §1)


@dataclass
class DdpConfig:
    epoch_steps: int = 50


@dataclass
class SyncConfig:
    announce_s: float = 2.0
    manifest_s: float = 5.0
    reduce_timeout_s: float = 20.0
    chunk_bytes: int = 1 << 20
    zstd_level: int = 1
    max_contributors: int = 0  # G: the most members that send contributions in one round (0: all)
    heartbeat_s: float = 2.0
    record_ttl_s: float = 10.0


@dataclass
class PipelineConfig:
    """The model cut into stages served by changing sets of peers (pipeline, runtime.stage_peer)."""

    stages: int = 1  # S > 1: pipeline mode (`simulate --stages`); must divide model.n_layers
    round_s: float = 15.0  # a stage's replicas sync every round_s seconds of DHT time (weighted by steps)
    checkfree_plus: bool = True  # S >= 4: swap the end stages' blocks on odd microbatches, replicate embed/head
    recovery: str = "checkfree"  # checkfree | checkpoint (the restart baseline: every stage back to its checkpoint)
    checkpoint_every_rounds: int = 0  # K > 0: every K rounds each stage's leader writes the stage (run_stage_checkpoints)
    hop_timeout_s: float = 30.0  # one forward or backward call; a timeout retries on another replica
    stage_wait_s: float = 180.0  # how long a driver waits for a stage with no replica before dropping a microbatch
    rebalance_every_rounds: int = 2  # a rebalancing check after every such round (0: only the test hook)
    hysteresis: float = 0.1  # a move must lift the weaker of its two stages above (1 + this) x the target's total

    @property
    def replicate_ends(self) -> bool:
        return self.checkfree_plus and self.stages >= 4


@dataclass
class CheckpointConfig:
    every_rounds: int = 5
    keep: int = 3


@dataclass
class LinkConfig:
    """Emulated access links for `simulate` (transport.shaper): RATE[:LATENCY] specs, "" = unshaped.

        [link]
        default = "100mbit:40ms"   # every peer's link (`simulate --link` overrides this)
        [link.peers]               # exceptions, by simulate peer index (0 .. peers-1)
        0 = "20mbit:80ms"

    A peer joining by hand sets its own link with `peer join --link`; the run's [link] does not
    shape volunteers. `netns = true` (`simulate --netns`) runs every process in its own network
    namespace: each RATE becomes the kernel's htb cap on that peer's link, LATENCY stays in the
    peer's application shaper (which then paces nothing), and a peer with no RATE is uncapped.
    """

    default: str = ""
    peers: dict[str, str] = field(default_factory=dict)
    netns: bool = False

    def spec_for(self, index: int) -> str:
        """The link spec of simulate's peer `index` ("" for an unshaped link)."""
        spec = self.peers.get(str(index), self.default).strip()
        return "" if spec.lower() in ("none", "off") else spec


@dataclass
class ChurnConfig:
    """Injected churn for `simulate` (runtime.churn); `simulate --churn` overrides it.

        [churn]
        spec = "kill:1@r3,leave:1@r4,join:2@t30s"   # or a rate: "0.25/round"; "" = none
    """

    spec: str = ""


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    sparseloco: SparseLoCoConfig = field(default_factory=SparseLoCoConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    noloco: NoLoCoConfig = field(default_factory=NoLoCoConfig)
    ddp: DdpConfig = field(default_factory=DdpConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    churn: ChurnConfig = field(default_factory=ChurnConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def steps_per_sync(self) -> int:
        """Inner steps between two syncs: 1 for ddp, H for the local-update algorithms."""
        if self.per_step:
            return 1
        return {"sparseloco": self.sparseloco.inner_steps,
                "noloco": self.noloco.inner_steps}.get(self.run.algo, self.diloco.inner_steps)

    @property
    def overlap(self) -> bool:
        """One-step-delay overlap: the run's DiLoCo or SparseLoCo reduces run during the next round."""
        return ((self.run.algo == "diloco" and self.diloco.overlap)
                or (self.run.algo == "sparseloco" and self.sparseloco.overlap))

    @property
    def streaming_run(self) -> bool:
        """Streaming DiLoCo: one fragment per round, P rounds per H steps (algorithms.streaming)."""
        return self.run.algo == "streaming-diloco"

    @property
    def total_rounds(self) -> int:
        """Rounds in a run of `run.steps` inner steps (for streaming: fragment syncs started by then)."""
        if self.streaming_run:
            return rounds_started_by(self.run.steps, self.diloco.inner_steps, self.streaming.fragments)
        return self.run.steps // self.steps_per_sync

    def step_after_rounds(self, completed: int) -> int:
        """The inner step a replica stands at once it has applied `completed` rounds (where a joiner starts)."""
        if self.streaming_run:
            s = self.streaming
            return step_after_rounds(completed, self.diloco.inner_steps, s.fragments, s.fragment_sync_delay)
        return completed * self.steps_per_sync

    @property
    def per_step(self) -> bool:
        """True for the algorithms that sync every step (ddp, DeMo): they run in membership epochs."""
        return self.run.algo in PER_STEP_ALGOS

    def config_hash(self) -> str:
        """Identifies the training run: every section but [link] and [churn] (the emulated network)."""
        training = {k: v for k, v in self.to_dict().items() if k not in UNHASHED_SECTIONS}
        text = json.dumps(training, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "RunConfig":
        config = cls()
        for section_name, values in raw.items():
            if not hasattr(config, section_name):
                raise ConfigError(f"unknown config section [{section_name}]; "
                                  f"known: {', '.join(f.name for f in dataclasses.fields(cls))}")
            if not isinstance(values, dict):
                raise ConfigError(f"[{section_name}] must be a table")
            _apply(getattr(config, section_name), section_name, values)
        config.validate()
        return config

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"run config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("run config must be a JSON object")
        return cls.from_dict(raw)

    def override(self, dotted: dict[str, Any]) -> "RunConfig":
        """Returns a copy with `section.key` values replaced (flags override the file)."""
        raw = self.to_dict()
        for key, value in dotted.items():
            if value is None:
                continue
            section, _, name = key.partition(".")
            raw.setdefault(section, {})[name] = value
        return RunConfig.from_dict(raw)

    def validate(self) -> None:
        if self.run.algo not in ALGOS:
            raise ConfigError(f"run.algo = {self.run.algo!r}: this version runs {', '.join(ALGOS)}")
        if self.sparseloco.values not in VALUE_CODECS:
            raise ConfigError(f"sparseloco.values = {self.sparseloco.values!r}: use one of {', '.join(VALUE_CODECS)}")
        for key in ("inner_steps", "topk", "chunk"):
            if getattr(self.sparseloco, key) < 1:
                raise ConfigError(f"sparseloco.{key} must be ≥ 1")
        if self.demo.topk < 1 or self.demo.chunk < 1 or not self.demo.lr > 0:
            raise ConfigError("demo.topk and demo.chunk must be ≥ 1 and demo.lr > 0")
        self._validate_noloco()
        if self.diloco.codec not in ("fp32", "uint8"):
            raise ConfigError(f"diloco.codec = {self.diloco.codec!r}: use 'fp32' or 'uint8'")
        if self.model.d_model % self.model.n_heads:
            raise ConfigError("model.d_model must be divisible by model.n_heads")
        for name, value in (("run.steps", self.run.steps), ("diloco.inner_steps", self.diloco.inner_steps),
                            ("ddp.epoch_steps", self.ddp.epoch_steps), ("inner.batch_size", self.inner.batch_size)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1 (got {value})")
        self._validate_streaming()
        if self.diloco.overlap and self.streaming_run:
            raise ConfigError("diloco.overlap with run.algo = 'streaming-diloco': Streaming DiLoCo overlaps "
                              "through streaming.fragment_sync_delay; set diloco.overlap = false")
        self._validate_pipeline()
        self._validate_links()
        try:
            parse_churn(self.churn.spec)
        except ValueError as e:
            raise ConfigError(f"churn.spec = {self.churn.spec!r}: {e}") from None

    def _validate_streaming(self) -> None:
        s = self.streaming
        if s.codec not in STREAMING_CODECS:
            raise ConfigError(f"streaming.codec = {s.codec!r}: use one of {', '.join(STREAMING_CODECS)}")
        if not 0.0 <= s.alpha <= 1.0:
            raise ConfigError(f"streaming.alpha = {s.alpha}: must be in [0, 1]")
        if not self.streaming_run:
            return  # the schedule only has to fit the model and H when it runs
        if not 1 <= s.fragments <= self.model.n_layers:
            raise ConfigError(f"streaming.fragments = {s.fragments}: must be in [1, model.n_layers = "
                              f"{self.model.n_layers}] (fragments are strided over transformer blocks)")
        try:
            check_one_in_flight(self.diloco.inner_steps, s.fragments, s.fragment_sync_delay)
        except ValueError as e:
            raise ConfigError(f"streaming.fragment_sync_delay / streaming.fragments with diloco.inner_steps = "
                              f"{self.diloco.inner_steps}: {e}") from None

    def _validate_pipeline(self) -> None:
        p = self.pipeline
        if p.stages < 1 or self.model.n_layers % p.stages:
            raise ConfigError(f"pipeline.stages = {p.stages}: must be >= 1 and divide model.n_layers = "
                              f"{self.model.n_layers} (every stage holds the same number of blocks)")
        if p.recovery not in ("checkfree", "checkpoint"):
            raise ConfigError(f"pipeline.recovery = {p.recovery!r}: use 'checkfree' or 'checkpoint'")
        if p.recovery == "checkpoint" and p.checkpoint_every_rounds < 1:
            raise ConfigError("pipeline.recovery = 'checkpoint' needs pipeline.checkpoint_every_rounds >= 1")
        if not p.round_s > 0 or not p.hop_timeout_s > 0 or not p.stage_wait_s > 0 or p.hysteresis < 0:
            raise ConfigError("pipeline.round_s, hop_timeout_s and stage_wait_s must be > 0, hysteresis >= 0")
        if p.stages > 1 and (self.run.algo not in ("diloco", "sparseloco") or self.overlap):
            raise ConfigError(f"pipeline.stages = {p.stages} with run.algo = {self.run.algo!r}"
                              f"{' and overlap' if self.overlap else ''}: a stage's replicas sync with diloco or "
                              "sparseloco (no overlap); pick one of those or pipeline.stages = 1")

    @property
    def pipelined(self) -> bool:
        return self.pipeline.stages > 1

    def _validate_noloco(self) -> None:
        n = self.noloco
        if n.codec not in NOLOCO_CODECS:
            raise ConfigError(f"noloco.codec = {n.codec!r}: use one of {', '.join(NOLOCO_CODECS)}")
        if n.inner_steps < 1 or n.group_size < 1:
            raise ConfigError("noloco.inner_steps and noloco.group_size must be ≥ 1")
        if not n.outer_lr > 0 or not 0 <= n.momentum < 1:
            raise ConfigError(f"noloco.outer_lr must be > 0 and noloco.momentum in [0, 1) "
                              f"(got {n.outer_lr}, {n.momentum})")
        if n.consensus is not None and (isinstance(n.consensus, bool) or not isinstance(n.consensus, (int, float))
                                        or n.consensus < 0):
            raise ConfigError(f"noloco.consensus = {n.consensus!r}: a number ≥ 0 (γ), or leave it out for γ = α")

    def _validate_links(self) -> None:
        specs = {"link.default": self.link.default}
        for index, spec in self.link.peers.items():
            if not index.isdigit():
                raise ConfigError(f"link.peers.{index}: [link.peers] keys are peer indices (0, 1, ...), "
                                  f"e.g. 0 = \"20mbit:80ms\"")
            specs[f"link.peers.{index}"] = spec
        for key, spec in specs.items():
            try:
                parse_link_option(spec)
            except ValueError as e:
                raise ConfigError(f"{key} = {spec!r}: {e}") from None


def _apply(target: Any, section: str, values: dict[str, Any]) -> None:
    fields = {f.name: f for f in dataclasses.fields(target)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(fields)}")
        current = getattr(target, key)
        try:
            if isinstance(current, dict):
                if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                    raise TypeError
                value = {str(k): v for k, v in value.items()}
            elif isinstance(current, bool):
                if not isinstance(value, bool):
                    raise TypeError
            elif isinstance(current, int):
                if isinstance(value, bool) or float(value) != int(value):
                    raise TypeError
                value = int(value)
            elif isinstance(current, float):
                value = float(value)
            elif isinstance(current, str):
                if not isinstance(value, str):
                    raise TypeError
        except (TypeError, ValueError):
            expected = "a table of strings" if isinstance(current, dict) else type(current).__name__
            raise ConfigError(f"{section}.{key} = {value!r}: expected {expected}") from None
        setattr(target, key, value)


def default_config() -> RunConfig:
    text = resources.files("lowcomm").joinpath("configs/default.toml").read_text()
    return RunConfig.from_dict(tomllib.loads(text))


def load_config(path: str | Path | None) -> RunConfig:
    """The embedded default, with the TOML file at `path` (if any) layered on top."""
    config = default_config()
    if path is None:
        return config
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML (or JSON): {e}") from None
    merged = config.to_dict()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [table]")
        merged.setdefault(section, {}).update(values)
    return RunConfig.from_dict(merged)
