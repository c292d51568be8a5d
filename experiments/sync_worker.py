"""One process of experiments/sync_efficiency.py: a DHT bootstrap node, or a worker that averages S bytes.

    python experiments/sync_worker.py boot   --system lowcomm|hivemind --dir CELL_DIR --host CONTROL_IP
    python experiments/sync_worker.py worker --system lowcomm|hivemind --dir CELL_DIR --index I --peers N
           --numel M --rounds R --host DATA_IP --control-host CONTROL_IP [--zstd-level 0] [--seed 0]

System `lowcomm-pairs` (experiments/noloco_vs_allreduce.py) is NoLoCo's pair exchange instead of the
all-reduce: each worker's result is the mean of its group of noloco.groups (pairs), not of all N.

The launcher runs each process inside its own NetnsLab node, in its own process group. Everything
between the launcher and the processes goes through files in CELL_DIR:

    boot.json              the bootstrap node's multiaddrs (written by boot)
    id-I                   worker I's peer id (lowcomm: maps contributors to worker indices)
    ready-R-I              worker I has its round-R input in memory and waits
    go-R                   the launcher releases round R (its content: the release time, time.time())
    done-R-I               worker I holds round R's result (timing in result-I.json)
    alldone-R              every worker holds it: checking and the next input may use the CPU now
    result-I.json          worker I's rounds: timing, group, correctness
    stop                   the bootstrap node may exit

Inputs are float32 N(0, 1) in blocks of BLOCK elements, each block seeded by (seed, worker, round,
block), so any process can rebuild any worker's block to check the average without holding all
N inputs. The check covers every block up to CHECK_BLOCKS blocks (S <= 64 MB: all of them), and
a hash of the whole result tells whether all workers hold the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowcomm.collectives.allocator import heap_stats, release_free_memory, resident_bytes, trimming  # noqa: E402
from experiments.worker_stats import PeakRss, thread_cpu  # noqa: E402

BLOCK = 1 << 20  # elements per seeded block (4 MB)
CHECK_BLOCKS = 16  # blocks checked against the true mean, at most (64 MB of float32)
ATOL = 1e-5  # values are N(0, 1); a float32 mean of <= 8 of them is off by ~1e-7
POLL_S = 0.002
WAIT_S = 3600.0


# ---- inputs and checks -----------------------------------------------------------------------

def _block_seed(seed: int, worker: int, round_: int, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{worker}/{round_}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def input_block(seed: int, worker: int, round_: int, block: int, numel: int) -> torch.Tensor:
    start = block * BLOCK
    generator = torch.Generator().manual_seed(_block_seed(seed, worker, round_, block))
    return torch.randn(min(BLOCK, numel - start), generator=generator)


def make_input(seed: int, worker: int, round_: int, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float32)
    for block in range(blocks_of(numel)):
        out[block * BLOCK:(block + 1) * BLOCK] = input_block(seed, worker, round_, block, numel)
    return out


def blocks_of(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def blocks_to_check(numel: int, seed: int, round_: int) -> list[int]:
    total = blocks_of(numel)
    if total <= CHECK_BLOCKS:
        return list(range(total))
    generator = torch.Generator().manual_seed(_block_seed(seed, -1, round_, 0))
    return sorted(torch.randperm(total, generator=generator)[:CHECK_BLOCKS].tolist())


def check_mean(result: torch.Tensor, workers: list[int], seed: int, round_: int) -> dict:
    """Max abs error of `result` against the true mean of `workers`' inputs, on the checked blocks."""
    numel = result.numel()
    checked = blocks_to_check(numel, seed, round_)
    worst = 0.0
    for block in checked:
        truth = sum(input_block(seed, w, round_, block, numel).double() for w in workers) / len(workers)
        got = result[block * BLOCK:(block + 1) * BLOCK].double()
        worst = max(worst, float((got - truth).abs().max()))
    return {"max_abs_err": worst, "correct": worst <= ATOL and bool(torch.isfinite(result).all()),
            "checked_fraction": min(1.0, len(checked) * BLOCK / numel),
            "result_hash": hashlib.blake2b(result.numpy().data, digest_size=12).hexdigest()}  # no copy of S


# ---- the barrier --------------------------------------------------------------------------------

def touch(path: Path, text: str = "") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_for(path: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")
        time.sleep(POLL_S)


# ---- bootstrap --------------------------------------------------------------------------------

def boot(args) -> None:
    if args.system.startswith("lowcomm"):
        from lowcomm.transport.control import ControlPlane
        from lowcomm.transport.identity import Identity
        control = ControlPlane.start(Identity.generate(), "sync", host=args.host)
        maddrs = control.visible_maddrs()
    else:
        import hivemind
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
    touch(args.dir / "boot.json", json.dumps(maddrs))
    wait_for(args.dir / "stop")


# ---- workers ----------------------------------------------------------------------------------

class LowcommWorker:
    """What runtime.peer.Peer._connect builds, minus the trainer: DHT, gRPC service, sharded reduce."""

    def __init__(self, args, initial_peers: list[str]):
        from lowcomm.collectives.base import GroupKey
        from lowcomm.collectives.manifest import ManifestAgreement
        from lowcomm.collectives.config import SyncConfig
        from lowcomm.transport.control import ControlPlane, PeerRecord
        from lowcomm.transport.identity import Identity
        from lowcomm.transport.service import PeerService
        from lowcomm.transport.wire import Channels, Traffic, start_server

        from lowcomm.transport.round_posts import RoundPosts
        from lowcomm.transport.signing import Signer
        from lowcomm.transport.wakeups import Wakes, WakeSender

        identity = Identity.generate()
        self.me = identity.peer_id
        self.signer = Signer(identity)
        # a round of 256 MB at N=8 takes ~40 s on this link: the default 20 s would cut contributions
        self.sync = SyncConfig(zstd_level=args.zstd_level, reduce_timeout_s=args.reduce_timeout_s)
        self.control = ControlPlane.start(identity, "sync", initial_peers=initial_peers, host=args.control_host)
        self.channels = Channels(self.sync.chunk_bytes)
        self.traffic = Traffic(None)  # no application shaper: the netns caps shape every byte
        service = PeerService(self.me, self.traffic, self.channels)
        self.server, port = start_server(service, args.host, 0, self.sync.chunk_bytes)
        self.endpoint = f"{args.host}:{port}"
        # "training" at round 0 makes every worker due in every round, so agreement waits for all N
        self.record = PeerRecord(self.me, self.endpoint, "training", "cpu", round=0)
        # as a training peer's (runtime.context): the round's records posted to the waiting peers, which read
        # the DHT every 2 s (transport.round_posts, collectives.round_reads)
        service.posts = RoundPosts("sync")
        wakes = Wakes(service.wakeups, WakeSender(self.channels, self.traffic), posts=service.posts, signer=self.signer)
        agreement = ManifestAgreement(self.control, self.sync, self.endpoint, wakes=wakes)
        self.collective = self.make_collective(args, service, agreement)
        self.key = GroupKey("sync")
        self._stop = threading.Event()
        self._beat()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def make_collective(self, args, service, agreement):
        from lowcomm.collectives.sharded_reduce import ShardedReduce
        return ShardedReduce(self.signer, service, self.channels, self.traffic, agreement, self.sync,
                             "fp32", epoch_rounds=args.epoch_rounds)

    def _beat(self) -> None:
        self.control.publish_peer(self.record, self.sync.record_ttl_s)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.sync.heartbeat_s):
            try:
                self._beat()
            except Exception as e:  # a missed heartbeat shows up as a missing member, not a crash
                print(f"heartbeat failed: {e}", file=sys.stderr)

    def wait_connected(self, peers: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while len([r for r in self.control.live_peers().values() if r.state == "training"]) < peers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {peers} peer records visible after {timeout:.0f}s")
            time.sleep(0.2)

    def prepare(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def average(self, round_: int) -> tuple[torch.Tensor, dict]:
        bytes_before, trims_before, cpu_before = self.traffic.sent, trimming.trims, thread_cpu()
        t_start = time.time()
        handle = self.collective.start(self.key, round_, self.tensor, 1.0, donate=True)  # as a training peer's Δ
        result = handle.result(self.sync.reduce_timeout_s * 3 + 60)
        t_end = time.time()
        return result.aggregate, {
            "t_start": t_start, "t_end": t_end,
            "contributors": result.contributors, "participants": result.participants,
            "agreement_s": result.info["manifest_s"], "transfer_s": result.info["reduce_s"],
            "leader": result.info["leader"], "lost_shards": result.info["lost_shards"],
            "grpc_bytes_sent": self.traffic.sent - bytes_before, "trims": trimming.trims - trims_before,
            "thread_cpu_s": {name: [round(u - cpu_before.get(name, [0, 0])[0], 2),
                                    round(k - cpu_before.get(name, [0, 0])[1], 2)]
                             for name, (u, k) in thread_cpu().items()},
            "most_waiting_pieces": max((getattr(slot, "most_waiting", 0) for slot in self._slots(round_)), default=0)}

    def _slots(self, round_: int) -> list:
        """The owner slots of ``round_`` this worker opened (a diagnostic: how many pieces waited in them)."""
        return [slot for (_, r), slot in list(self.collective.slots._slots.items()) if r == round_]

    def close(self) -> None:
        self._stop.set()
        self.server.stop(grace=1.0).wait(2.0)
        self.channels.close()
        self.control.shutdown()


class PairWorker(LowcommWorker):
    """NoLoCo's pair exchange of the same S bytes, cut in two tensors as NoLoCo's (θ − φ, φ): each worker
    pushes them to its mate(s) of noloco.groups and holds the mean of its group (own included)."""

    def make_collective(self, args, service, agreement):
        from lowcomm.algorithms.noloco import group_of
        from lowcomm.collectives.pair_exchange import PairExchange
        self.half = args.numel // 2
        shapes = [(self.half,), (args.numel - self.half,)]
        return PairExchange(self.signer, service, self.channels, self.traffic, agreement, self.sync, "fp32", shapes,
                            lambda run, round_, members: group_of(run, round_, members, 2))

    def average(self, round_: int) -> tuple[torch.Tensor, dict]:
        bytes_before = self.traffic.sent
        t_start = time.time()
        handle = self.collective.start(self.key, round_, [self.tensor[:self.half], self.tensor[self.half:]])
        result = handle.result(self.sync.reduce_timeout_s * 3 + 60)
        t_end = time.time()
        parts = [self.tensor if p == self.me else torch.cat(result.received[p]) for p in result.contributors]
        mean = parts[0].clone()  # group order, as noloco.outer_step sums: every member gets the same bytes
        for part in parts[1:]:
            mean.add_(part)
        mean.div_(len(parts))
        return mean, {
            "t_start": t_start, "t_end": t_end,
            "contributors": result.contributors, "participants": result.participants,
            "agreement_s": result.info["manifest_s"], "transfer_s": result.info["exchange_s"],
            "leader": result.info["leader"], "lost_shards": [], "grpc_bytes_sent": self.traffic.sent - bytes_before}


class HivemindWorker:
    """hivemind's DecentralizedAverager over the same tensor, fp32 without compression."""

    def __init__(self, args, initial_peers: list[str]):
        import hivemind
        from hivemind import DecentralizedAverager
        from hivemind.compression import NoCompression

        self.dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=[f"/ip4/{args.control_host}/tcp/0"],
                                start=True)
        self.me = str(self.dht.peer_id)
        self.tensor = torch.zeros(args.numel)
        self.averager = DecentralizedAverager(
            [self.tensor], self.dht, start=True, prefix="sync", target_group_size=args.peers, min_group_size=2,
            min_matchmaking_time=args.matchmaking_s, request_timeout=min(3.0, args.matchmaking_s / 2),
            compression=NoCompression())
        self.index = args.index
        self.timeout = args.reduce_timeout_s * 3 + 60

    def wait_connected(self, peers: int, timeout: float = 300.0) -> None:
        pass  # the averager finds its group through the DHT at each step

    def prepare(self, tensor: torch.Tensor) -> None:
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(tensor)

    def average(self, round_: int) -> tuple[torch.Tensor, dict]:
        from hivemind.averaging.control import AveragingStage
        t0 = time.time()
        control = self.averager.step(gather={"worker": self.index}, timeout=self.timeout, wait=False)
        t_matched = None
        while not control.done():
            if t_matched is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                t_matched = time.time()
            time.sleep(POLL_S)
        gathered = control.result()
        t_end = time.time()
        with self.averager.get_tensors() as tensors:
            out = tensors[0].clone()
        workers = sorted(int(data["worker"]) for data in (gathered or {}).values()) if gathered else []
        t_matched = t_matched or t_end
        return out, {"t_start": t0, "t_end": t_end, "group_workers": workers, "group_size": len(workers),
                     "agreement_s": t_matched - t0, "transfer_s": t_end - t_matched}

    def close(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()


def work(args) -> None:
    if args.system.startswith("lowcomm"):
        from lowcomm.collectives.allocator import tune_allocator
        tune_allocator()  # as `lowcomm peer join` does, before any thread starts
    torch.set_num_threads(1)
    wait_for(args.dir / "boot.json")
    initial_peers = json.loads((args.dir / "boot.json").read_text())
    kind = PairWorker if args.system == "lowcomm-pairs" else LowcommWorker if args.system.startswith("lowcomm") \
        else HivemindWorker
    worker = kind(args, initial_peers)
    touch(args.dir / f"id-{args.index}", worker.me)
    worker.wait_connected(args.peers)
    for i in range(args.peers):
        wait_for(args.dir / f"id-{i}")
    index_of = {(args.dir / f"id-{i}").read_text(): i for i in range(args.peers)}
    rounds = []
    baseline = resident_bytes()  # set up, connected, no input yet: what the round's memory is counted above
    baseline_heap = heap_stats()
    for round_ in range(args.rounds):
        tensor = make_input(args.seed, args.index, round_, args.numel)
        worker.prepare(tensor)
        touch(args.dir / f"ready-{round_}-{args.index}")
        wait_for(args.dir / f"go-{round_}")
        with PeakRss() as memory:  # the input (S) included, which holds the result (donated)
            result, info = worker.average(round_)
        info["peak_mem_bytes"] = memory.peak - baseline
        info["malloc_at_peak"] = {k: v - baseline_heap.get(k, 0) for k, v in memory.at_peak.items()}
        touch(args.dir / f"done-{round_}-{args.index}")
        # checking and the next input are CPU work: not while other workers still transfer
        wait_for(args.dir / f"alldone-{round_}")
        if "contributors" in info:
            info["group_workers"] = sorted(index_of.get(p, -1) for p in info["contributors"])
            info["group_size"] = len(info["group_workers"])
        group = [w for w in info["group_workers"] if w >= 0] or [args.index]
        rounds.append({"round": round_, "round_s": info["t_end"] - info["t_start"], **info,
                       **check_mean(result, group, args.seed, round_)})
        print(f"worker {args.index} round {round_}: {rounds[-1]['round_s']:.2f}s group {info['group_size']} "
              f"err {rounds[-1]['max_abs_err']:.2e}", flush=True)
        del result, tensor
        release_free_memory()  # what this worker's checks freed: the next round's peak is the round's own
    touch(args.dir / f"result-{args.index}.json", json.dumps({"index": args.index, "peer_id": worker.me,
                                                               "rounds": rounds}))
    try:
        worker.close()
    finally:
        os._exit(0)  # hivemind's background threads can hold the interpreter; the launcher kills the group


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["boot", "worker"])
    parser.add_argument("--system", required=True, choices=["lowcomm", "lowcomm-zstd1", "lowcomm-pairs", "hivemind"])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--host", required=True, help="boot: the control address; worker: the data address")
    parser.add_argument("--control-host", help="worker: the control address (the DHT's p2pd)")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=BLOCK)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zstd-level", type=int, default=0)
    parser.add_argument("--reduce-timeout-s", type=float, default=60.0)
    parser.add_argument("--matchmaking-s", type=float, default=5.0)
    parser.add_argument("--epoch-rounds", type=int, default=1, help="lowcomm: rounds one manifest covers")
    args = parser.parse_args(argv)
    if args.role == "boot":
        boot(args)
    else:
        work(args)


if __name__ == "__main__":
    main()
