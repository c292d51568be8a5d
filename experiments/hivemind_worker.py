"""One hivemind peer of experiments/vs_hivemind.py: lowcomm's reference model and data, trained with
`hivemind.Optimizer(use_local_updates=True)` (local AdamW steps, parameters averaged every epoch).

    python experiments/hivemind_worker.py --dir ROW_DIR --index I --peers N --steps STEPS --host IP
        [--config lowcomm.toml] [--matchmaking-s 3] [--averaging-timeout-s 60]

The model, its φ_0, the data shard, the held-out batches and the inner AdamW with its warm-up are
lowcomm's own (runtime.trainer.LocalTrainer), so only the synchronisation differs. An epoch is
N x batch x H samples, H = the config's diloco.inner_steps: hivemind averages as often as
lowcomm's DiLoCo syncs. hivemind's other settings are its defaults (fp32 state averaging, no
compression, delayed state averaging in the background).

Files in ROW_DIR: boot.json (the bootstrap node's multiaddrs, from sync_worker.py boot), ready-I
(this worker has joined), go (the launcher starts every worker at once), log-I.jsonl (this
worker's records: `eval` {t, step, tokens, loss}, `epoch` {t, step, epoch}, `done` {first_step_t,
last_step_t, compute_s, steps, final_loss}). Worker 0 evaluates every eval_every_tokens tokens of
the whole run (counted as N x its own tokens: every worker runs at the same pace), every worker at
the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from experiments.sync_worker import touch, wait_for  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--config", default=None)
    parser.add_argument("--matchmaking-s", type=float, default=3.0)  # hivemind's quickstart value
    parser.add_argument("--averaging-timeout-s", type=float, default=60.0)  # hivemind's default
    args = parser.parse_args()
    torch.set_num_threads(1)

    import hivemind

    from lowcomm.config import load_config
    from lowcomm.runtime.trainer import LocalTrainer

    config = load_config(args.config)
    trainer = LocalTrainer(config, args.index, args.peers, torch.device("cpu"))
    batch = config.inner.batch_size
    log = (args.dir / f"log-{args.index}.jsonl").open("a")

    def write(kind: str, **fields) -> None:
        log.write(json.dumps({"type": kind, "t": time.time(), **fields}) + "\n")
        log.flush()

    initial_peers = json.loads((args.dir / "boot.json").read_text())
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    optimizer = hivemind.Optimizer(
        dht=dht, run_id="vs_hivemind", optimizer=trainer.optimizer, use_local_updates=True,
        target_batch_size=args.peers * batch * config.diloco.inner_steps, batch_size_per_step=batch,
        matchmaking_time=args.matchmaking_s, averaging_timeout=args.averaging_timeout_s, verbose=False)
    touch(args.dir / f"ready-{args.index}")
    wait_for(args.dir / "go")

    every = config.data.eval_every_tokens
    tokens_per_step = trainer.tokens_per_step * args.peers  # the whole run's tokens per step of this worker
    first_step_t, epoch = time.time(), optimizer.local_epoch
    for step in range(args.steps):
        trainer.forward_backward()
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = trainer.lr_at(step)
        optimizer.step()
        trainer.compute_s += time.perf_counter() - t0  # the local AdamW step; averaging is in the background
        if optimizer.local_epoch != epoch:
            epoch = optimizer.local_epoch
            write("epoch", step=step + 1, epoch=epoch)
        tokens = (step + 1) * tokens_per_step
        if args.index == 0 and tokens // every != step * tokens_per_step // every:
            write("eval", step=step + 1, tokens=tokens, loss=trainer.evaluate())
    last_step_t = time.time()
    write("done", first_step_t=first_step_t, last_step_t=last_step_t, compute_s=trainer.compute_s,
          steps=args.steps, tokens=args.steps * trainer.tokens_per_step, final_loss=trainer.evaluate(),
          epoch=optimizer.local_epoch)
    log.close()
    optimizer.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
