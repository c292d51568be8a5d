"""A run of the production path in one process: N training peers' loops, with no network.

Each peer is the runtime's own parts minus the transport: its `LocalTrainer` (model, data shard
i of N, the inner optimizer, the held-out set), the algorithm's replica from the registry, and a
member of one `LocalGroup` that runs the sharded reduce's exact combiner calls (the algorithm's
codec or sparse combiner). Every peer's loop runs in its own thread and is the training peer's loop
(runtime.peer.TrainingPeer._train): forward and backward, ``on_gradients``, the inner step,
``after_inner_step``, and ``finish`` at the end. Rounds always have every peer (no stragglers, no
churn), so the run is the algorithm's math on the runtime's code, at the speed of the compute alone.
The first error in any peer's thread (its step, ``on_step``, the batches) stops the run: the group's
rounds fail at once (``LocalGroup.abort``), every loop leaves at its next step, and the error is
raised in the caller's thread.

    result = run_in_process(config, peers=4)    # config: a RunConfig (lowcomm.config)
    result.final_loss, result.rounds, result.replicas[0].global_model()

Each peer's trainer is the run config's (`LocalTrainer(config, i, peers, device)`) unless the caller
passes ``trainer(i)``, a factory of peer i's `Trainer` (the Python API, lowcomm.api: a user's model,
optimizer and batches); the algorithm and its hyper-parameters always come from ``config``.

The experiments use it to compare the runtime with a plain reference (experiments/diloco_gap.py)
and the unit tests to hold the two together; NoLoCo's pair exchange has no in-process group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lowcomm.algorithms.base import ReplicaSpec, SyncHooks
from lowcomm.algorithms.registry import REDUCE, algorithm
from lowcomm.collectives.base import GroupKey, RoundResult
from lowcomm.collectives.combiners import DenseMean
from lowcomm.collectives.local import LocalGroup
from lowcomm.runtime.trainer import LocalTrainer, Trainer

ROUND_TIMEOUT_S = 600.0  # every peer is in every round; only a broken loop reaches it
JOIN_S = 24 * 3600.0  # a bound on the whole run's threads
STOP_S = 30.0  # after a peer's error: how long the others get to leave their step before it is raised


@dataclass
class InProcessRun:
    final_loss: float  # held-out loss of peer 0's global model at the end (runtime.evaluation's final)
    rounds: list[dict] = field(default_factory=list)  # peer 0's applied rounds: round, step, contributors
    replicas: list = field(default_factory=list)  # `with replicas[i].global_model() as model:` peer i's φ
    trainers: list[Trainer] = field(default_factory=list)


def run_in_process(config, peers: int, device: str = "cpu",
                   on_step: Callable[[int, int], None] | None = None,
                   trainer: Callable[[int], Trainer] | None = None) -> InProcessRun:
    """``config.run.steps`` inner steps on each of ``peers`` peers of ``config.run.algo``, in threads.

    ``on_step(peer, step)`` is called after each of a peer's inner steps (progress reports);
    ``trainer(i)`` builds peer i's trainer (default: the run config's, on ``device``)."""
    if peers < 1:
        raise ValueError(f"peers = {peers}: a run needs at least one")
    algo = algorithm(config.run.algo)
    if algo.exchange != REDUCE:
        raise ValueError(f"{algo.name} exchanges in pairs; the in-process run has only the sharded reduce")
    torch.set_num_threads(1)  # one thread per peer, as the peer processes
    if trainer is None:
        trainer = lambda i: LocalTrainer(config, i, peers, torch.device(device))  # noqa: E731
    trainers = [trainer(i) for i in range(peers)]
    shapes = [tuple(p.shape) for p in trainers[0].model.parameters()]
    group = LocalGroup(peers, combiner=algo.combiner(config, shapes) or DenseMean(algo.codec(config),
                                                                                 config.sync.zstd_level),
                       timeout_s=ROUND_TIMEOUT_S)
    key = GroupKey(config.run.name)
    steps = [0] * peers
    rounds: list[dict] = []

    def landed(i: int):
        def record(result: RoundResult) -> None:
            if i == 0:
                rounds.append({"round": result.info["round"], "step": steps[0],
                               "contributors": list(result.contributors)})
        return record

    replicas = []
    for i, t in enumerate(trainers):
        hooks = SyncHooks(landed=landed(i), timeout_s=ROUND_TIMEOUT_S, total_steps=config.run.steps)
        replicas.append(algo.replica(ReplicaSpec(t.model, config, group.member(i), key, t.tokens_per_step,
                                                 t.optimizer, t.lr_schedule, lambda round_: None, hooks)))

    stopped = threading.Event()

    def stop(reason: str) -> None:
        stopped.set()
        group.abort(reason)

    def loop(i: int) -> None:
        trainer, replica = trainers[i], replicas[i]
        while steps[i] < config.run.steps and not stopped.is_set():
            trainer.forward_backward()
            replica.on_gradients(steps[i])
            if replica.steps_inner_optimizer:
                trainer.optimizer_step(steps[i])
            steps[i] += 1
            replica.after_inner_step(steps[i])
            if on_step is not None:
                on_step(i, steps[i])
        if not stopped.is_set():
            replica.finish()

    _in_threads(loop, peers, stop)
    with replicas[0].global_model():
        final = trainers[0].evaluate()
    return InProcessRun(final, rounds, replicas, trainers)


def _in_threads(work: Callable[[int], None], count: int, stop: Callable[[str], None]) -> None:
    """``work(i)`` in thread i; the first error calls ``stop(reason)`` (the others must leave) and is
    raised here once every thread ended, or after STOP_S when one is still inside its step."""
    errors: list[BaseException] = []
    lock = threading.Lock()
    settled = threading.Event()  # every thread ended, or one failed
    ended = [0]

    def fail(who: str, error: BaseException) -> None:
        with lock:
            errors.append(error)
            first = len(errors) == 1
        if first:
            stop(f"{who} failed: {type(error).__name__}: {error}")
            settled.set()

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            fail(f"peer {i}", e)
        finally:
            with lock:
                ended[0] += 1
                if ended[0] == count:
                    settled.set()

    threads = [threading.Thread(target=run, args=(i,), name=f"peer-{i}", daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    try:
        settled.wait(JOIN_S)
    except BaseException as e:  # Ctrl-C in the caller: the peers' threads stop too
        fail("the caller", e)
        raise
    if errors:
        deadline = time.monotonic() + STOP_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("an in-process peer never finished its loop")
