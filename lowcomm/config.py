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
import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from lowcomm.algorithms.ddp import DdpConfig
from lowcomm.algorithms.demo import OVERLAP_UPDATES as DEMO_OVERLAP_UPDATES
from lowcomm.algorithms.demo import DemoConfig
from lowcomm.algorithms.diloco import CODECS as DILOCO_CODECS
from lowcomm.algorithms.diloco import DilocoConfig
from lowcomm.algorithms.inner import InnerConfig
from lowcomm.algorithms.noloco import NoLoCoConfig
from lowcomm.algorithms.overlap import UPDATES as OVERLAP_UPDATES
from lowcomm.algorithms.overlapped import APPLY as OVERLAP_APPLY
from lowcomm.algorithms.sparseloco import SparseLoCoConfig
from lowcomm.algorithms.streaming import CODECS as STREAMING_CODECS
from lowcomm.algorithms.streaming import StreamingConfig, check_one_in_flight, rounds_started_by, step_after_rounds
from lowcomm.collectives.config import SyncConfig
from lowcomm.collectives.pair_payload import WIRE_CODECS as NOLOCO_CODECS
from lowcomm.collectives.robust import AGGREGATES
from lowcomm.compress.base import MAX_ZSTD_LEVEL
from lowcomm.compress.sparse import MAX_CHUNK
from lowcomm.compress.topk import VALUE_CODECS
from lowcomm.config_values import ConfigError, apply_values
from lowcomm.data.corpus import BYTE_LEVEL, CORPORA, TOKEN_DTYPES, DataConfig
from lowcomm.models.factory import factory_spec_error
from lowcomm.models.gpt import ModelConfig
from lowcomm.pipeline.config import RECOVERIES, STAGE_SYNC_ALGOS, PipelineConfig
from lowcomm.runtime.checkpoint import CheckpointConfig
from lowcomm.runtime.churn import ChurnConfig, parse_churn
from lowcomm.transport.shaper import LinkConfig, parse_link_option


ALGOS = ("diloco", "streaming-diloco", "sparseloco", "demo", "noloco", "ddp")
PER_STEP_ALGOS = ("ddp", "demo")  # sync every optimizer step, in membership epochs
UNHASHED_SECTIONS = ("link", "churn")  # the emulated network: not part of what makes two runs the same
UNHASHED_RUN_KEYS = ("mode", "allowlist")  # who may join: a run may admit more peers and resume the same training
RUN_MODES = ("open", "allowlist", "token")  # who may join (runtime.admission)
PEER_ID = re.compile(r"^[0-9a-f]{20}$")  # transport.identity.peer_id_of
BYTE_VOCAB = 256  # the stdlib and text corpora are byte-level: every token id is < 256

_AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
_AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
_POSITIVE = (lambda v: v > 0, "> 0")
_UNIT = (lambda v: 0 <= v <= 1, "in [0, 1]")
_UNIT_OPEN = (lambda v: 0 <= v < 1, "in [0, 1)")
# Every numeric field of the run config and what it may hold (floats must also be finite). Rules
# that involve two fields (topk and chunk, stages and n_layers, ...) are in RunConfig.validate.
RANGES: dict[str, tuple[Any, str]] = {
    "run.steps": _AT_LEAST_1, "run.seed": _AT_LEAST_0,
    **{f"model.{k}": _AT_LEAST_1 for k in ("vocab_size", "d_model", "n_layers", "n_heads", "context")},
    "data.holdout_fraction": (lambda v: 0 < v < 1, "in (0, 1)"),
    "data.eval_batches": _AT_LEAST_1, "data.eval_every_tokens": _AT_LEAST_1,
    "inner.lr": _POSITIVE, "inner.warmup_steps": _AT_LEAST_0, "inner.beta1": _UNIT_OPEN, "inner.beta2": _UNIT_OPEN,
    "inner.weight_decay": _AT_LEAST_0, "inner.batch_size": _AT_LEAST_1,
    "inner.grad_clip": (lambda v: v >= 0, ">= 0 (0: no clipping)"),
    "diloco.inner_steps": _AT_LEAST_1, "diloco.outer_lr": _POSITIVE, "diloco.outer_momentum": _UNIT_OPEN,
    "diloco.trim_fraction": (lambda v: 0 <= v < 0.5, "in [0, 0.5)"), "diloco.clip_tau": _POSITIVE,
    "streaming.fragments": _AT_LEAST_1, "streaming.fragment_sync_delay": _AT_LEAST_0, "streaming.alpha": _UNIT,
    "sparseloco.inner_steps": _AT_LEAST_1, "sparseloco.outer_lr": _POSITIVE, "sparseloco.beta": _UNIT,
    "sparseloco.chunk": (lambda v: 2 <= v <= MAX_CHUNK, f"in [2, {MAX_CHUNK}]"),
    "demo.lr": _POSITIVE, "demo.beta": _UNIT, "demo.chunk": (lambda v: 1 <= v <= MAX_CHUNK, f"in [1, {MAX_CHUNK}]"),
    "demo.weight_decay": _AT_LEAST_0, "demo.zero_band": _UNIT_OPEN,
    "noloco.inner_steps": _AT_LEAST_1, "noloco.group_size": _AT_LEAST_1, "noloco.outer_lr": _POSITIVE,
    "noloco.momentum": _UNIT_OPEN,
    "ddp.epoch_steps": _AT_LEAST_1,
    **{f"{s}.overlap_lead": (lambda v: 0 < v <= 1, "in (0, 1]") for s in ("diloco", "sparseloco")},
    **{f"sync.{k}": _POSITIVE for k in ("announce_s", "manifest_s", "reduce_timeout_s", "heartbeat_s")},
    "sync.record_ttl_s": _POSITIVE, "sync.chunk_bytes": _AT_LEAST_1,
    "sync.zstd_level": (lambda v: 0 <= v <= MAX_ZSTD_LEVEL, f"in [0, {MAX_ZSTD_LEVEL}] (0: off)"),
    "sync.max_contributors": (lambda v: v >= 0, ">= 0 (0: every member)"),
    "pipeline.stages": _AT_LEAST_1, "pipeline.round_s": _POSITIVE, "pipeline.hop_timeout_s": _POSITIVE,
    "pipeline.stage_wait_s": _POSITIVE, "pipeline.hysteresis": _AT_LEAST_0,
    "pipeline.checkpoint_every_rounds": (lambda v: v >= 0, ">= 0 (0: none)"),
    "pipeline.rebalance_every_rounds": (lambda v: v >= 0, ">= 0 (0: only on the test hook)"),
    "checkpoint.every_rounds": (lambda v: v >= 0, ">= 0 (0: none)"), "checkpoint.keep": _AT_LEAST_1,
    "checkpoint.every_s": _AT_LEAST_0,
    "checkpoint.max_share": (lambda v: 0 <= v < 1, "in [0, 1) (0: no cap)"),
}


@dataclass
class RunSection:
    """The [run] section: which algorithm, for how long, from which seed."""

    name: str = "lowcomm-default"
    algo: str = "diloco"  # one of ALGOS
    steps: int = 600  # inner steps per peer
    seed: int = 0
    mode: str = "open"  # who may join: one of RUN_MODES
    allowlist: list[str] = field(default_factory=list)  # mode "allowlist": the admitted peer ids


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
                or (self.run.algo == "sparseloco" and self.sparseloco.overlap)
                or (self.run.algo == "demo" and self.demo.overlap))

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
        """Identifies the training run: every section but [link] and [churn] (the emulated network), and
        without who may join (run.mode, run.allowlist)."""
        training = {k: v for k, v in self.to_dict().items() if k not in UNHASHED_SECTIONS}
        training["run"] = {k: v for k, v in training["run"].items() if k not in UNHASHED_RUN_KEYS}
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
            apply_values(getattr(config, section_name), section_name, values)
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
        """Refuses what cannot run, with a one-line ConfigError naming the key and what is allowed."""
        for key, (allowed, description) in RANGES.items():
            section, _, name = key.partition(".")
            value = getattr(getattr(self, section), name)
            if isinstance(value, float) and not math.isfinite(value) or not allowed(value):
                raise ConfigError(f"{key} = {value!r}: must be {description}")
        for key, value, choices in self._choices():
            if value not in choices:
                raise ConfigError(f"{key} = {value!r}: use one of {', '.join(choices)}")
        if self.model.d_model % self.model.n_heads:
            raise ConfigError(f"model.d_model = {self.model.d_model}: must be divisible by model.n_heads = "
                              f"{self.model.n_heads}")
        self._validate_admission()
        self._validate_model_and_data()
        self._validate_topk()
        self._validate_noloco()
        self._validate_streaming()
        self._validate_pipeline()
        self._validate_links()
        try:
            parse_churn(self.churn.spec)
        except ValueError as e:
            raise ConfigError(f"churn.spec = {self.churn.spec!r}: {e}") from None

    def _choices(self) -> list[tuple[str, str, Any]]:
        return [("run.algo", self.run.algo, ALGOS), ("run.mode", self.run.mode, RUN_MODES), ("data.corpus", self.data.corpus, CORPORA),
                ("data.dtype", self.data.dtype, TOKEN_DTYPES),
                ("diloco.codec", self.diloco.codec, DILOCO_CODECS),
                ("diloco.aggregate", self.diloco.aggregate, AGGREGATES),
                ("diloco.overlap_update", self.diloco.overlap_update, OVERLAP_UPDATES),
                ("diloco.overlap_apply", self.diloco.overlap_apply, OVERLAP_APPLY),
                ("demo.overlap_update", self.demo.overlap_update, DEMO_OVERLAP_UPDATES),
                ("sparseloco.overlap_apply", self.sparseloco.overlap_apply, OVERLAP_APPLY),
                ("streaming.codec", self.streaming.codec, STREAMING_CODECS),
                ("sparseloco.values", self.sparseloco.values, VALUE_CODECS),
                ("noloco.codec", self.noloco.codec, NOLOCO_CODECS),
                ("pipeline.recovery", self.pipeline.recovery, RECOVERIES)]

    def _validate_admission(self) -> None:
        r = self.run
        bad = next((p for p in r.allowlist if not PEER_ID.match(p)), None)
        if bad is not None:
            raise ConfigError(f"run.allowlist: {bad[:60]!r} is not a peer id (20 hex digits, as "
                              "`lowcomm peer id --key-file PATH` prints)")
        if r.mode == "allowlist" and not r.allowlist:
            raise ConfigError("run.mode = 'allowlist' with an empty run.allowlist: list the peer ids that may join")
        if r.mode != "allowlist" and r.allowlist:
            raise ConfigError(f"run.allowlist lists peers but run.mode = {r.mode!r}: set run.mode = \"allowlist\" "
                              "or remove the list")

    def _validate_model_and_data(self) -> None:
        """The factory's form (it is imported where the model is built), the vocabulary a byte-level corpus
        needs, a path for the corpora read from disk. The data's own checks run when it is loaded."""
        m, d = self.model, self.data
        problem = factory_spec_error(m.factory)
        if problem:
            raise ConfigError(problem)
        if d.corpus in BYTE_LEVEL and m.vocab_size < BYTE_VOCAB:
            raise ConfigError(f"model.vocab_size = {m.vocab_size}: must be >= {BYTE_VOCAB} "
                              f"(data.corpus {d.corpus!r} is byte-level)")
        if d.corpus in ("tokens", "text") and not d.path:
            what = "a .bin token file or a folder holding train.bin and val.bin" if d.corpus == "tokens" else \
                "a folder of text files"
            raise ConfigError(f"data.corpus = {d.corpus!r} needs data.path: {what}")

    def _validate_topk(self) -> None:
        """k per chunk must fit a full chunk (chunk x chunk entries); SparseLoCo's k is also even (§3)."""
        s, d = self.sparseloco, self.demo
        if s.topk % 2 or not 2 <= s.topk <= s.chunk ** 2:
            raise ConfigError(f"sparseloco.topk = {s.topk}: must be even and in [2, sparseloco.chunk² = "
                              f"{s.chunk ** 2}] (k per {s.chunk}x{s.chunk} chunk; 12-bit indices pair up)")
        if not 1 <= d.topk <= d.chunk ** 2:
            raise ConfigError(f"demo.topk = {d.topk}: must be in [1, demo.chunk² = {d.chunk ** 2}] "
                              f"(k per {d.chunk}x{d.chunk} chunk)")

    def _validate_noloco(self) -> None:
        n = self.noloco
        if n.consensus is not None and (isinstance(n.consensus, bool) or not isinstance(n.consensus, (int, float))
                                        or not 0 <= n.consensus < math.inf):
            raise ConfigError(f"noloco.consensus = {n.consensus!r}: a number ≥ 0 (γ), or leave it out for γ = α")

    def _validate_streaming(self) -> None:
        s = self.streaming
        if self.diloco.overlap and self.streaming_run:
            raise ConfigError("diloco.overlap with run.algo = 'streaming-diloco': Streaming DiLoCo overlaps "
                              "through streaming.fragment_sync_delay; set diloco.overlap = false")
        if not self.streaming_run:
            return  # the schedule only has to fit the model and H when it runs
        if not self.model.factory and not 1 <= s.fragments <= self.model.n_layers:
            raise ConfigError(f"streaming.fragments = {s.fragments}: must be in [1, model.n_layers = "
                              f"{self.model.n_layers}] (fragments are strided over transformer blocks)")
        try:
            check_one_in_flight(self.diloco.inner_steps, s.fragments, s.fragment_sync_delay)
        except ValueError as e:
            raise ConfigError(f"streaming.fragment_sync_delay / streaming.fragments with diloco.inner_steps = "
                              f"{self.diloco.inner_steps}: {e}") from None

    def _validate_pipeline(self) -> None:
        p = self.pipeline
        if self.model.n_layers % p.stages:
            raise ConfigError(f"pipeline.stages = {p.stages}: must divide model.n_layers = "
                              f"{self.model.n_layers} (every stage holds the same number of blocks)")
        if p.stages > 1 and self.model.factory:
            raise ConfigError(f"pipeline.stages = {p.stages} with model.factory = {self.model.factory!r}: pipelines "
                              "cut the built-in GPT only; set pipeline.stages = 1 or model.factory = \"\"")
        if p.recovery == "checkpoint" and p.checkpoint_every_rounds < 1:
            raise ConfigError("pipeline.recovery = 'checkpoint' needs pipeline.checkpoint_every_rounds >= 1")
        if p.stages > 1 and (self.run.algo not in STAGE_SYNC_ALGOS or self.overlap):
            raise ConfigError(f"pipeline.stages = {p.stages} with run.algo = {self.run.algo!r}"
                              f"{' and overlap' if self.overlap else ''}: a stage's replicas sync with diloco or "
                              "sparseloco (no overlap); pick one of those or pipeline.stages = 1")

    @property
    def pipelined(self) -> bool:
        return self.pipeline.stages > 1

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
