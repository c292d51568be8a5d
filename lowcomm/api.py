"""lowcomm from Python: your own torch model, inner optimizer and batches, under any algorithm.

    import lowcomm
    result = lowcomm.train(model, config={"run.algo": "sparseloco", "run.steps": 300}, peers=4,
                           optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                           batches=lambda peer, peers: my_batches(peer, peers), heldout=my_heldout)
    result.initial_loss, result.final_loss, result.model

    lowcomm.join("/ip4/203.0.113.7/tcp/31337/p2p/Qm...", run_key="...", model=model,
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), batches=my_batches(), heldout=my_heldout)

`train` runs N replicas in this process, each in its own thread, through the runtime's own loop,
trainers and replicas, with an in-process sharded reduce (runtime.in_process): every algorithm but
NoLoCo, whose pairs need real peers. `join` is `lowcomm peer join` with your parts: the run's
algorithm and hyper-parameters are the coordinator's signed run config.

The algorithm and its hyper-parameters come from a run config: a `RunConfig`, the path of a TOML
file layered on the embedded default, or a dict of dotted overrides of the default
({"run.algo": "diloco", "diloco.inner_steps": 50}). Every part left out comes from that config:
the [model] (the built-in GPT or `factory`), the [data] corpus (each peer its own shard), lowcomm's
AdamW with the [inner] warm-up. A model is a `torch.nn.Module` whose forward takes token ids x
[B, T] and returns logits [B, T, V] (or a tuple, logits first); the loss is their cross-entropy
against y unless `loss_fn(model, x, y)` is given. Batches are (x, y) pairs of int64 (torch.long)
tensors. Both calls leave the caller's process as they found it: torch's thread count, the SIGINT
and SIGTERM handlers (join) and torch's global RNG (the config's model is built on a forked RNG).
If one replica of `train` fails, the others stop at once and its error is raised.
"""

from __future__ import annotations

import copy
import itertools
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowcomm.algorithms.inner import InnerOptimizer, TorchInner
from lowcomm.algorithms.registry import REDUCE, NAMES, algorithm
from lowcomm.config import ConfigError, RunConfig, default_config, load_config
from lowcomm.data.corpus import Corpus, load_corpus
from lowcomm.data.loader import Batch, LossFn
from lowcomm.runtime.trainer import Trainer, config_data, config_model, config_tokens_per_step, resolve_device

ConfigLike = RunConfig | str | Path | Mapping[str, Any] | None
# what `optimizer` may be: a function of the parameters returning a torch optimizer, or (optimizer,
# LR scheduler); `join` also takes an optimizer already built over the model it is given
OptimizerLike = Callable[[Iterable[nn.Parameter]], Any] | torch.optim.Optimizer | None


@dataclass
class Trained:
    """What `train` returns."""

    initial_loss: float  # held-out loss of the model before any step
    final_loss: float  # held-out loss of the final global model
    model: nn.Module  # the final global model (φ for the round-based algorithms), a copy on its device
    rounds: list[dict] = field(default_factory=list)  # peer 0's applied rounds: round, step, contributors
    run: Any = None  # runtime.in_process.InProcessRun: every replica and trainer, for a closer look


@dataclass
class Joined:
    """What `join` returns once the peer leaves."""

    exit_code: int
    final_loss: float | None  # the last held-out loss this peer computed (None: it never evaluated)
    steps: int  # inner steps this peer trained
    rounds: int  # the round its state is labelled with (rounds applied, with those it downloaded)
    model: nn.Module | None  # the global model as this peer holds it at the end


def run_config(config: ConfigLike = None) -> RunConfig:
    """A RunConfig from what `train` accepts: None (the embedded default), a RunConfig, a TOML (or JSON)
    path, or a dict of dotted overrides of the default."""
    if config is None:
        return default_config()
    if isinstance(config, RunConfig):
        config.validate()
        return config
    if isinstance(config, (str, Path)):
        return load_config(config)
    if isinstance(config, Mapping):
        return default_config().override(dict(config))
    raise ConfigError(f"config is a {type(config).__name__}; pass a RunConfig, a TOML path or a dict such as "
                      "{'run.algo': 'diloco'}")


def train(model: nn.Module | None = None, *, config: ConfigLike = None, peers: int = 2,
          optimizer: OptimizerLike = None, batches: Callable[[int, int], Iterable[Batch]] | None = None,
          heldout: Iterable[Batch] | None = None, loss_fn: LossFn | None = None, device: str = "cpu",
          on_step: Callable[[int, int], None] | None = None) -> Trained:
    """`peers` replicas of `model` trained `run.steps` inner steps each with `run.algo`, in this process.

    model: every replica starts from a copy of it (it is not changed); None: the config's [model].
    optimizer(params): each replica's inner optimizer, or (optimizer, scheduler); None: AdamW from [inner].
    batches(peer, peers): peer's iterator of (x, y); None: shard `peer` of the [data] corpus.
    heldout: the (x, y) batches every evaluation scores (a list, or any iterable: read once); None: the
    [data] corpus's (only with batches=None).
    on_step(peer, step): called after each inner step of each peer.
    The first error in any replica's thread (its step, on_step, loss_fn, batches) stops every replica and
    is raised here."""
    from lowcomm.runtime.in_process import run_in_process  # loaded on use: `import lowcomm` stays light

    config = run_config(config)
    if peers < 1:
        raise ValueError(f"peers = {peers}: train at least one replica")
    algo = algorithm(config.run.algo)
    if algo.exchange != REDUCE:
        raise ConfigError(f"run.algo = {algo.name!r} exchanges in pairs between real peers; train it with "
                          f"`lowcomm simulate` or join(); in process: "
                          f"{', '.join(n for n in NAMES if algorithm(n).exchange == REDUCE)}")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer is one optimizer, but every replica needs its own: pass a function, "
                        "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)")
    if batches is not None and not callable(batches):
        raise TypeError("batches must be a function batches(peer, peers) returning that peer's iterator of (x, y)")
    device = resolve_device(device)  # auto, cpu, cuda or cuda:N; ConfigError where there is no such device
    heldout = None if heldout is None else list(heldout)  # every replica scores the same batches
    initial: list[float] = []
    corpus: list[Corpus] = []  # the [data] corpus, loaded (and checked) once for every replica

    def data(current: RunConfig) -> Corpus:
        if not corpus:
            corpus.append(load_corpus(current.data, current.model.vocab_size, current.model.context))
        return corpus[0]

    def trainer(i: int) -> Trainer:
        own = None if batches is None else batches(i, peers)
        made = user_trainer(config, i, peers, device, copy.deepcopy(model) if model is not None else None,
                            optimizer, own, heldout, loss_fn, data)
        if i == 0:
            initial.append(made.evaluate())
        return made

    with _process_state_kept():  # the run sets one torch thread per replica thread, as a peer process has
        run = run_in_process(config, peers, str(device), on_step, trainer=trainer)
    with run.replicas[0].global_model():
        final_model = copy.deepcopy(run.trainers[0].model)
    return Trained(initial[0], run.final_loss, final_model, run.rounds, run)


def join(coordinator: str | Sequence[str], run_key: str, *, model: nn.Module | None = None,
         optimizer: OptimizerLike = None,
         batches: Iterable[Batch] | Callable[[int, int], Iterable[Batch]] | None = None,
         heldout: Iterable[Batch] | None = None, loss_fn: LossFn | None = None, run_name: str = "lowcomm-default",
         device: str = "auto", run_dir: str | Path | None = None, **options: Any) -> Joined:
    """Joins a real run as `lowcomm peer join` does, training `model` (None: the run config's) with your
    optimizer and batches, until the run's last step or SIGINT / SIGTERM.

    coordinator: the coordinator's (or any peer's) multiaddr(s); run_key and run_name: as the coordinator's
    join command prints them. batches: an iterator of (x, y), or batches(shard, num_shards) once the peer
    knows its data shard; None: its shard of the run's [data] corpus. run_dir: where the peer's records go
    (default runs/RUN_NAME). options: any other `peer join` option by its PeerOptions name (host, port,
    announce_addr, client_mode, data_shard, num_shards, ...). The peer's SIGINT / SIGTERM handlers and
    its one torch thread last as long as the call: the caller's are back when it returns."""
    from lowcomm.runtime.options import peer_options  # the network stack (hivemind) loads on use only
    from lowcomm.runtime.peer import Peer
    from lowcomm.runtime.preflight import check_peer

    addrs = [coordinator] if isinstance(coordinator, str) else list(coordinator)
    flags = {**options, "coordinator": addrs, "run_key": run_key, "run_name": run_name, "device": device,
             "run_dir": Path(run_dir) if run_dir is not None else Path("runs") / run_name}
    peer_opts = peer_options({}, flags)
    check_peer(peer_opts)
    heldout = None if heldout is None else list(heldout)  # read once: a generator has no second pass

    def trainer(config: RunConfig, shard: int, num_shards: int, on: torch.device) -> Trainer:
        own = batches(shard, num_shards) if callable(batches) else batches
        return user_trainer(config, shard, num_shards, on, model, optimizer, own, heldout, loss_fn)

    with _process_state_kept():
        peer = Peer(peer_opts, trainer=trainer)
        code = peer.run()
    training = peer.peer
    if training is None:
        return Joined(code, None, 0, 0, None)
    with training.replica.global_model():
        held = copy.deepcopy(training.trainer.model)
    return Joined(code, training.evaluation.last_loss, training.progress.steps_done, training.replica.round, held)


@contextmanager
def _process_state_kept():
    """torch's thread count and the SIGINT / SIGTERM handlers as they were, whatever the body set."""
    threads = torch.get_num_threads()
    signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    handlers = {signum: signal.getsignal(signum) for signum in signals}
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            if handler is not None:  # None: a handler not set from Python, which Python cannot put back
                signal.signal(signum, handler)


def user_trainer(config: RunConfig, shard: int, num_shards: int, device: torch.device, model: nn.Module | None,
                 optimizer: OptimizerLike, batches: Iterable[Batch] | None, heldout: Iterable[Batch] | None,
                 loss_fn: LossFn | None, corpus: Callable[[RunConfig], Corpus] | None = None) -> Trainer:
    """A trainer of the parts given, the run config's where one is None (see `train`); `corpus(config)`:
    the [data] corpus when the caller holds it already (default: loaded here)."""
    if batches is None and heldout is not None or batches is not None and heldout is None:
        raise ValueError("pass batches and heldout together (your data), or neither (the run's [data] corpus)")
    if model is None:
        model = config_model(config, device)
    elif not isinstance(model, nn.Module):
        raise TypeError(f"model is a {type(model).__name__}; pass a torch.nn.Module")
    else:
        model = model.to(device)
    inner = _inner(model, optimizer, config)
    if batches is None:
        shard_batches, heldout = config_data(config, shard, num_shards, corpus(config) if corpus else None)
        return Trainer(model, inner, shard_batches, heldout, config_tokens_per_step(config), device, loss_fn)
    first, stream = _first_batch(iter(batches), "batches", int64=loss_fn is None)
    heldout = list(heldout)  # read once: a generator has no second pass
    _first_batch(iter(heldout), "heldout", int64=loss_fn is None)
    return Trainer(model, inner, stream, heldout, first[0].numel(), device, loss_fn)


def _inner(model: nn.Module, optimizer: OptimizerLike, config: RunConfig):
    if optimizer is None:
        return InnerOptimizer(model.parameters(), config.inner)
    made = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())
    made, scheduler = made if isinstance(made, tuple) else (made, None)
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"optimizer returned a {type(made).__name__}; return a torch.optim.Optimizer over the "
                        "parameters given (or a tuple (optimizer, lr scheduler))")
    owned = {id(p) for p in model.parameters()}
    if any(id(p) not in owned for group in made.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's; build it over the "
                         "parameters it is given (model.parameters() of the model passed)")
    return TorchInner(made, config.inner.grad_clip, scheduler)


def _first_batch(batches: Iterator[Batch], name: str, int64: bool = True) -> tuple[Batch, Iterator[Batch]]:
    """The first batch (checked to be a pair of integer tensors of one shape, int64 when `int64`: the default
    loss's targets) and the stream from it on."""
    try:
        first = next(batches)
    except StopIteration:
        raise ValueError(f"{name} yielded no batch; give at least one (x, y) pair of int64 tensors") from None
    ok = (isinstance(first, (tuple, list)) and len(first) == 2
          and all(isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() for t in first)
          and first[0].shape == first[1].shape and first[0].dim() == 2 and first[0].numel() > 0)
    if not ok:
        raise TypeError(f"{name} must yield (x, y) pairs of int64 tensors of one non-empty shape [B, T] (y: the "
                        "next token of each x); the first item was not one")
    if int64 and any(t.dtype != torch.long for t in first):
        raise TypeError(f"{name} must yield (x, y) pairs of int64 tensors (torch.long); the first held "
                        f"{first[0].dtype} and {first[1].dtype}: convert them with x.long(), y.long()")
    return first, itertools.chain([first], batches)
