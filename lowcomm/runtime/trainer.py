"""The local half of a training peer: model, batches, the inner optimizer, the loss, evaluation.

`Trainer` runs whatever parts it is given: a torch model, an inner step (algorithms.inner:
lowcomm's AdamW or a user's torch optimizer), an iterator of (x, y) int64 batches, fixed held-out
batches, the tokens one step trains on, a device and a loss rule (data.loader.next_token_loss:
cross-entropy of ``model(x)``'s logits against y, unless the caller passes its own
``loss_fn(model, x, y)``). `LocalTrainer(config, shard, num_shards, device)` builds the run
config's parts: the [model] (the GPT or the factory's model, models.factory), shard `shard` of
the [data] corpus, AdamW from [inner].

One torch thread per peer process (oversubscribed cores make every deadline flaky).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from lowcomm.algorithms.inner import InnerOptimizer, NonFiniteGradient
from lowcomm.config import ConfigError
from lowcomm.data.corpus import Corpus, load_corpus
from lowcomm.data.loader import Batch, LossFn, TokenShard, evaluate, heldout_batches, logits_of, next_token_loss
from lowcomm.models.factory import build_model


def resolve_device(requested: str) -> torch.device:
    """The device `--device REQUESTED` names, with its index: auto (the current CUDA device if torch sees
    one, else the CPU), cpu, cuda (the current CUDA device) or cuda:N. ConfigError, one line saying what to
    do, for anything torch cannot train on here. Reads torch's CUDA state only: nothing is set."""
    text = str(requested).strip()
    kind, colon, index = text.partition(":")
    if text == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    elif not (text == "cpu" or kind == "cuda" and (not colon or index.isdigit())):
        raise ConfigError(f"--device {text}: not a device; use auto, cpu, cuda or cuda:N")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {text}: torch sees no CUDA device here (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda or 'none'}); use --device cpu or auto")
    count = torch.cuda.device_count()
    n = int(index) if colon and index else torch.cuda.current_device()
    if n >= count:
        last = f"..cuda:{count - 1}" if count > 1 else ""
        raise ConfigError(f"--device {text}: torch sees {count} CUDA device(s), numbered from 0; use --device "
                          f"cuda:0{last} or cpu (CUDA_VISIBLE_DEVICES renumbers them)")
    return torch.device("cuda", n)


def pick_device(requested: str) -> torch.device:
    """`resolve_device`, and a CUDA device made the process's current one, so that anything that uses
    "the" CUDA device (an unindexed "cuda", torch.cuda.synchronize(), the caching allocator) means it."""
    device = resolve_device(requested)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def device_label(device: torch.device) -> str:
    """What a peer says it trains on, in its record, its start event and on the status page: `cpu`, or
    `cuda:N` and the GPU's name."""
    if device.type != "cuda":
        return device.type
    return f"{device} {torch.cuda.get_device_name(device)}"[:64]


class Trainer:
    def __init__(self, model: nn.Module, inner, batches: Iterator[Batch], heldout: Sequence[Batch],
                 tokens_per_step: int, device: torch.device, loss_fn: LossFn | None = None):
        if not heldout:
            raise ValueError("the trainer needs held-out batches to evaluate on; pass at least one (x, y) batch")
        self.model = model
        self.inner = inner  # InnerOptimizer or TorchInner (algorithms.inner)
        self.optimizer = inner.optimizer
        self.batches = iter(batches)
        self.eval_batches = list(heldout)
        self.tokens_per_step = tokens_per_step
        self.device = torch.device(device)
        self.loss_fn = loss_fn or next_token_loss
        self.compute_s = 0.0
        self.skipped_steps = 0  # steps whose gradient was not finite (dropped before any sync or update)
        self.slowdown = 1.0  # emulation of a slower device: each computation takes this many times as long
        if loss_fn is None:  # the default rule: the logits must cover the targets' ids
            self._check_logits(*self.eval_batches[0])

    def lr_at(self, step: int) -> float:
        return self.inner.lr_at(step)

    @property
    def lr_schedule(self):
        """The run's inner lr schedule for the replica (DeMo follows its warm-up); None with a user's optimizer."""
        return self.inner.lr_at if self.inner.schedules_lr else None

    def forward_backward(self) -> float:
        t0 = time.perf_counter()
        try:
            x, y = next(self.batches)
        except StopIteration:
            raise RuntimeError("the batch iterator ran out before the run's last step; make it yield at least "
                               "run.steps batches (or loop over the data)") from None
        x, y = x.to(self.device), y.to(self.device)
        self.inner.zero_grad()
        loss = self.loss_fn(self.model, x, y)
        loss.backward()
        try:
            self.inner.clip()
        except NonFiniteGradient:  # the gradients are dropped: this step contributes nothing
            self.skipped_steps += 1
        value = loss.item()
        self._account(t0)
        return value

    def optimizer_step(self, step: int) -> None:
        t0 = time.perf_counter()
        self.inner.step(step)
        self._account(t0)

    def _account(self, t0: float) -> None:
        """Adds the computation begun at `t0` to compute_s, stretched `slowdown` times (a slower device).
        On CUDA it first waits for the kernels queued since: they are this computation's time, not the sync's
        that would otherwise wait for them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - t0))
        self.compute_s += time.perf_counter() - t0

    def evaluate(self) -> float:
        return evaluate(self.model, [(x.to(self.device), y.to(self.device)) for x, y in self.eval_batches],
                        self.loss_fn)

    @torch.no_grad()
    def _check_logits(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """On one held-out batch: the model takes the token ids and gives one logit per id the targets hold."""
        x, y = x.to(self.device), y.to(self.device)
        largest = int(max(x.max(), y.max()))
        try:
            logits = logits_of(self.model(x))
        except (IndexError, RuntimeError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise ValueError(f"the model fails on a batch of token ids up to {largest} ({type(e).__name__}: "
                             f"{first}); give it a vocabulary above {largest} ([model] vocab_size)") from None
        vocab = logits.shape[-1] if logits.dim() >= 2 else 0
        if vocab <= largest or logits.numel() != y.numel() * vocab:
            raise ValueError(f"the model's output for x of shape {tuple(x.shape)} is {tuple(logits.shape)}; the loss "
                             f"needs logits of shape {tuple(y.shape)} + (vocab,) with vocab > {largest} (the largest "
                             "token id): make the model cover [model] vocab_size, or pass your own loss_fn")


class LocalTrainer(Trainer):
    """The run config's parts: its model (seeded by run.seed), shard `shard_index` of its corpus, AdamW."""

    def __init__(self, config, shard_index: int, num_shards: int, device: torch.device):
        self.config = config
        model = config_model(config, device)
        self.shard, heldout = config_data(config, shard_index, num_shards)
        super().__init__(model, InnerOptimizer(model.parameters(), config.inner), self.shard, heldout,
                         config_tokens_per_step(config), device)


def config_model(config, device: torch.device) -> nn.Module:
    """The [model] section's model on `device`, built after torch.manual_seed(run.seed) (on a fork of torch's
    RNG: the caller's is left alone): every peer starts from the same φ_0."""
    return build_model(config.model, seed=config.run.seed).to(device)


def config_data(config, shard_index: int, num_shards: int,
                corpus: Corpus | None = None) -> tuple[TokenShard, list[Batch]]:
    """Shard `shard_index` of `num_shards` of the [data] corpus's train split, and its held-out batches;
    `corpus`: that corpus already loaded (by load_corpus with the [model]'s vocab_size and context)."""
    model = config.model
    if corpus is None:
        corpus = load_corpus(config.data, model.vocab_size, model.context)
    shard = TokenShard(corpus.train, shard_index, num_shards, model.context, config.inner.batch_size, config.run.seed)
    heldout = heldout_batches(corpus.heldout, model.context, config.inner.batch_size, config.data.eval_batches)
    return shard, heldout


def config_tokens_per_step(config) -> int:
    return config.inner.batch_size * config.model.context
