"""A model and data of one's own, end to end: `lowcomm simulate` with a config file whose [model] factory
names a module this test writes (its folder on the children's PYTHONPATH) and whose [data] is a token
file this test writes. NoLoCo (pairs: not covered in process) and DiLoCo, 2 peer processes each, run
to the end with a final held-out loss below the untrained model's. And `lowcomm.join` from Python:
two processes join a coordinator's run with the model, optimizer and batches they build themselves."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from children import wait_until

from lowcomm.config import default_config
from lowcomm.runtime.processes import Process
from lowcomm.runtime.sim import Simulation

REPO = Path(__file__).resolve().parents[2]
STEPS, H, CONTEXT, VOCAB = 30, 10, 32, 64

MODULE = textwrap.dedent('''
    """A model that is not lowcomm's GPT: token embedding, the previous token's, an MLP, a head."""
    import torch
    from torch import nn


    class PairLM(nn.Module):
        def __init__(self, vocab, width):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.mix = nn.Sequential(nn.Linear(2 * width, 64), nn.GELU(), nn.Linear(64, width))
            self.out = nn.Linear(width, vocab)

        def forward(self, x):
            e = self.embed(x)
            before = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], dim=1)
            return self.out(self.mix(torch.cat([e, before], dim=-1)))


    def build(config):
        return PairLM(config.vocab_size, 32)
''')


JOINER = textwrap.dedent('''
    """One peer of a real run, joined from Python with its own model, optimizer and batches."""
    import json
    import sys

    import numpy as np
    import torch

    import lowcomm
    from ownlab_models import PairLM

    maddr, run_key, run_name, nanogpt, run_dir, start_file, out = sys.argv[1:]
    train, heldout_tokens = (torch.from_numpy(np.fromfile(f"{nanogpt}/{name}.bin", dtype="<u2").astype(np.int64))
                             for name in ("train", "val"))


    def windows(stream, starts):
        rows = torch.stack([stream[s:s + 33] for s in starts])
        return rows[:, :-1], rows[:, 1:]


    def batches(shard, num_shards):
        part = len(train) // num_shards
        generator = torch.Generator().manual_seed(shard)
        while True:
            yield windows(train, shard * part + torch.randint(0, part - 33, (8,), generator=generator))


    heldout = [windows(heldout_tokens, range(i, i + 8 * 40, 40)) for i in range(0, 2_400, 600)]
    torch.manual_seed(0)  # every peer builds the same initial weights
    model = PairLM(256, 32)
    joined = lowcomm.join(maddr, run_key=run_key, run_name=run_name, model=model,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), batches=batches,
                          heldout=heldout, device="cpu", run_dir=run_dir, num_shards=2, start_file=start_file,
                          host="127.0.0.1")  # the test's coordinator listens on loopback only
    with open(out, "w") as f:
        json.dump({"exit_code": joined.exit_code, "final_loss": joined.final_loss, "steps": joined.steps,
                   "rounds": joined.rounds, "model": type(joined.model).__name__}, f)
''')


def markov_tokens(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    noise, drawn = rng.random(n) < 0.1, rng.integers(0, VOCAB, n)
    out = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        out[i] = drawn[i] if noise[i] else (out[i - 1] * 5 + 3) % VOCAB
    return out


def run_toml(data_path: Path, dtype: str) -> str:
    return textwrap.dedent(f'''
        [run]
        steps = {STEPS}
        [model]
        factory = "ownlab_models:build"
        vocab_size = 256
        context = {CONTEXT}
        [data]
        corpus = "tokens"
        path = "{data_path}"
        dtype = "{dtype}"
        eval_batches = 4
        eval_every_tokens = 1000000
        [inner]
        lr = 1e-2
        warmup_steps = 0
        batch_size = 8
        [diloco]
        inner_steps = {H}
        [noloco]
        inner_steps = {H}
        [sync]
        announce_s = 2.0
        manifest_s = 3.0
        reduce_timeout_s = 8.0
        [checkpoint]
        every_rounds = 0
    ''')


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """The module on disk, a nanoGPT folder (train.bin + val.bin, uint16) and a single uint32 file."""
    root = tmp_path_factory.mktemp("own")
    (root / "mods").mkdir()
    (root / "mods" / "ownlab_models.py").write_text(MODULE)
    tokens = markov_tokens(30_000)
    (root / "nanogpt").mkdir()
    tokens[:27_000].astype("<u2").tofile(root / "nanogpt" / "train.bin")
    tokens[27_000:].astype("<u2").tofile(root / "nanogpt" / "val.bin")
    tokens.astype("<u4").tofile(root / "tokens32.bin")
    return root


@pytest.mark.parametrize("algo, data, dtype", [("noloco", "tokens32.bin", "uint32"), ("diloco", "nanogpt", "uint16")])
def test_simulate_trains_a_factory_model_on_a_token_file(own, tmp_path, algo, data, dtype):
    config = tmp_path / "run.toml"
    config.write_text(run_toml(own / data, dtype))
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(own / "mods"), os.environ.get("PYTHONPATH", "")]),
           "LOWCOMM_CACHE": str(tmp_path / "cache")}
    launcher = subprocess.Popen([sys.executable, "-m", "lowcomm.cli", "simulate", "--config", str(config),
                                 "--peers", "2", "--algo", algo, "--report", str(report)],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:  # on SIGTERM the launcher kills its peers' process groups, then exits
            os.killpg(launcher.pid, signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    assert launcher.returncode == 0, output[-3000:]
    result = json.loads(report.read_text())
    assert result["algo"] == algo and not result["failed_peers"]
    assert result["model_params"] == 256 * 32 + (64 * 64 + 64) + (64 * 32 + 32) + (32 * 256 + 256)  # PairLM's
    assert len(result["rounds"]) == STEPS // H
    assert result["final_loss"] < math.log(256) - 1.0, result["final_loss"]  # untrained: about log(vocab)


def test_join_from_python_trains_ones_own_model_in_a_real_run(own, tmp_path):
    (tmp_path / "joiner.py").write_text(JOINER)
    config = default_config().override({
        "run.steps": STEPS, "diloco.inner_steps": H, "data.eval_every_tokens": 10 ** 6, "checkpoint.every_rounds": 0,
        "sync.announce_s": 2.0, "sync.manifest_s": 3.0, "sync.reduce_timeout_s": 8.0})
    sim = Simulation(config, 2, tmp_path / "run", progress=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(own / "mods"), str(REPO)])}
    try:
        info = sim.start_coordinator()
        joiners = []
        for i in range(2):
            log = tmp_path / f"joiner-{i}.log"
            with open(log, "wb") as out:
                popen = subprocess.Popen(
                    [sys.executable, str(tmp_path / "joiner.py"), info["maddrs"][0], info["run_key"], info["run"],
                     str(own / "nanogpt"), str(sim.run_dir), str(sim.start_file),
                     str(tmp_path / f"joined-{i}.json")],
                    cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            joiners.append(Process(f"joiner-{i}", popen, log))
            sim.processes.append(joiners[-1])  # sim.close() ends their process groups whatever happens
        # the joiners pick their own data shards: both are parked once both wrote their ready events
        wait_until(lambda: len(sim.ready_ids(sim.records())) == 2 or any(p.popen.poll() is not None for p in joiners),
                   120, "both joiners parked at the start barrier")
        sim.start_file.touch()
        for p in joiners:
            p.popen.wait(timeout=180)
    finally:
        assert sim.close() == []
    for i in range(2):
        assert joiners[i].popen.returncode == 0, joiners[i].log_path.read_text()[-3000:]
        joined = json.loads((tmp_path / f"joined-{i}.json").read_text())
        assert joined["exit_code"] == 0 and joined["model"] == "PairLM"
        assert joined["steps"] == STEPS and joined["rounds"] == STEPS // H
        assert joined["final_loss"] < math.log(256) - 1.0, joined
