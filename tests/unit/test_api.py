"""The Python API (lowcomm.api): a model defined here, not the built-in GPT, trained in process by every
algorithm of the sharded reduce on token files and a text folder this test writes; the held-out
loss falls below the initial one. And the API's own errors, one line each."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest
import torch
from torch import nn

import lowcomm
from lowcomm.config import ConfigError, default_config

VOCAB = 64  # the token files' ids; the model's vocabulary is larger (256: the text folder is byte-level)
CONTEXT = 32


class PairLM(nn.Module):
    """A tiny next-token model: each position sees its own token and the one before, through an MLP."""

    def __init__(self, vocab: int = 256, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.Linear(2 * width, 64), nn.GELU(), nn.Linear(64, width))
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        before = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], dim=1)
        return self.out(self.mix(torch.cat([e, before], dim=-1)))


def markov_tokens(n: int, seed: int = 0) -> np.ndarray:
    """Mostly next = 5·prev + 3 mod VOCAB, one token in ten drawn at random: learnable in a few dozen steps."""
    rng = np.random.default_rng(seed)
    noise, drawn = rng.random(n) < 0.1, rng.integers(0, VOCAB, n)
    out = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        out[i] = drawn[i] if noise[i] else (out[i - 1] * 5 + 3) % VOCAB
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A uint16 file, a uint32 file, nanoGPT's train.bin + val.bin, and a folder of text files."""
    root = tmp_path_factory.mktemp("data")
    tokens = markov_tokens(40_000)
    tokens.astype("<u2").tofile(root / "tokens16.bin")
    tokens.astype("<u4").tofile(root / "tokens32.bin")
    (root / "nanogpt").mkdir()
    tokens[:36_000].astype("<u2").tofile(root / "nanogpt" / "train.bin")
    tokens[36_000:].astype("<u2").tofile(root / "nanogpt" / "val.bin")
    texts = root / "texts"
    for i in range(3):
        (texts / f"part{i}").mkdir(parents=True)
        (texts / f"part{i}" / "doc.txt").write_bytes(bytes(int(t) + 32 for t in markov_tokens(8_000, seed=i)))
    return root


def run_config(algo: str, corpus: str, path, dtype: str = "uint16"):
    return {"run.algo": algo, "run.steps": 40, "model.context": CONTEXT, "inner.batch_size": 8, "inner.lr": 1e-2,
            "inner.warmup_steps": 0, "data.corpus": corpus, "data.path": str(path), "data.dtype": dtype,
            "data.eval_batches": 4, "diloco.inner_steps": 5, "sparseloco.inner_steps": 5,
            "streaming.fragment_sync_delay": 1, "demo.lr": 3e-3, "ddp.epoch_steps": 10}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWCOMM_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("algo, corpus, source, dtype", [
    ("ddp", "tokens", "tokens16.bin", "uint16"),
    ("diloco", "tokens", "tokens32.bin", "uint32"),
    ("streaming-diloco", "text", "texts", "uint16"),
    ("sparseloco", "tokens", "nanogpt", "uint16"),
    ("demo", "tokens", "tokens16.bin", "uint16"),
])
def test_every_reduce_algorithm_trains_a_model_of_ones_own(data, algo, corpus, source, dtype):
    torch.manual_seed(0)
    model = PairLM()
    before = [p.detach().clone() for p in model.parameters()]
    result = lowcomm.train(model, config=run_config(algo, corpus, data / source, dtype), peers=2)
    assert result.final_loss < result.initial_loss - 0.5, (algo, result.initial_loss, result.final_loss)
    assert result.rounds and type(result.model) is PairLM
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))  # the caller's model is left alone
    replicas = result.run.replicas
    if replicas[0].shared_phi:  # every replica ends on the same global model
        with replicas[1].global_model():
            other = [p.detach().clone() for p in result.run.trainers[1].model.parameters()]
        assert all(torch.equal(p, q) for p, q in zip(result.model.parameters(), other))


def test_ones_own_batches_optimizer_and_loss(data):
    tokens = torch.from_numpy(markov_tokens(20_000, seed=5))
    heldout_tokens = torch.from_numpy(markov_tokens(2_000, seed=6))

    def windows(stream, offsets):
        rows = torch.stack([stream[o:o + CONTEXT + 1] for o in offsets])
        return rows[:, :-1], rows[:, 1:]

    def batches(peer, peers):
        half = len(tokens) // peers
        generator = torch.Generator().manual_seed(peer)
        while True:
            yield windows(tokens, peer * half + torch.randint(0, half - CONTEXT - 1, (8,), generator=generator))

    heldout = [windows(heldout_tokens, range(i, i + 8 * 50, 50)) for i in range(0, 1600, 400)]
    calls = []

    def loss_fn(model, x, y):
        calls.append(x.shape)
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    result = lowcomm.train(PairLM(vocab=VOCAB), config={"run.algo": "diloco", "run.steps": 30,
                                                        "diloco.inner_steps": 10}, peers=2,
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
                           batches=batches, heldout=heldout, loss_fn=loss_fn)
    assert result.final_loss < result.initial_loss - 0.5
    assert calls[0] == (8, CONTEXT) and len(result.rounds) == 3
    assert isinstance(result.run.trainers[0].optimizer, torch.optim.SGD)


def test_the_config_chooses_the_model_when_none_is_given(data):
    result = lowcomm.train(config={**run_config("diloco", "tokens", data / "tokens16.bin"), "run.steps": 10,
                                   "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2}, peers=1)
    assert type(result.model).__name__ == "GPT" and result.final_loss < result.initial_loss


@pytest.mark.parametrize("kwargs, error, expected", [
    (dict(config={"run.algo": "noloco"}), ConfigError, "exchanges in pairs"),
    (dict(config={"run.algo": "adam"}), ConfigError, "run.algo = 'adam'"),
    (dict(config=3), ConfigError, "pass a RunConfig"),
    (dict(config="missing.toml"), ConfigError, "does not exist"),
    (dict(model=PairLM(), optimizer=torch.optim.SGD(PairLM().parameters(), lr=1)), TypeError, "its own"),
    (dict(model=PairLM(), optimizer=lambda params: "sgd"), TypeError, "returned a str"),
    (dict(model=PairLM(), optimizer=lambda params: torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
     ValueError, "not the model's"),
    (dict(model="gpt"), TypeError, "pass a torch.nn.Module"),
    (dict(model=PairLM(), batches=lambda peer, peers: iter([])), ValueError, "batches and heldout together"),
    (dict(model=PairLM(), batches=lambda peer, peers: iter([]), heldout=[(torch.zeros(1, 2), torch.zeros(1, 2))]),
     ValueError, "batches yielded no batch"),
    (dict(model=PairLM(), batches=lambda peer, peers: iter([(torch.zeros(1, 2), torch.zeros(1, 2))]),
          heldout=[(torch.zeros(1, 2), torch.zeros(1, 2))]), TypeError, "pairs of int64 tensors"),
    (dict(model=PairLM(vocab=16)), ValueError, "give it a vocabulary above"),
])
def test_what_the_api_refuses_is_one_line(data, kwargs, error, expected):
    config = kwargs.pop("config", {**run_config("diloco", "tokens", data / "tokens16.bin"), "run.steps": 2})
    with pytest.raises(error) as raised:
        lowcomm.train(config=config, peers=2, **kwargs)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_a_run_config_object_or_a_toml_path_chooses_the_algorithm(data, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\nalgo = "ddp"\nsteps = 3\n[data]\ncorpus = "tokens"\npath = "{data / "tokens16.bin"}"\n'
                    f"[model]\ncontext = {CONTEXT}\n")
    assert lowcomm.run_config(path).run.algo == "ddp"
    config = default_config().override({"run.steps": 3, "run.algo": "sparseloco", "sparseloco.inner_steps": 3,
                                        "model.context": CONTEXT, "data.corpus": "tokens",
                                        "data.path": str(data / "tokens16.bin")})
    assert len(lowcomm.train(PairLM(), config=config, peers=2).rounds) == 1
    assert len(lowcomm.train(PairLM(), config=path, peers=2).rounds) == 3


class StepFailed(RuntimeError):
    pass


@pytest.mark.timeout(60)  # a guard only: without the abort, the other replica waits out each round (600 s)
def test_a_failing_replica_stops_the_run_and_its_error_is_raised(data):
    def on_step(peer, step):
        if peer == 1 and step == 1:
            raise StepFailed("peer 1 broke at step 1")

    with pytest.raises(StepFailed, match="peer 1 broke at step 1"):
        lowcomm.train(PairLM(), config=run_config("diloco", "tokens", data / "tokens16.bin"), peers=2,
                      on_step=on_step)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("peer-")]  # every loop has left


def test_join_puts_back_the_callers_signal_handlers_and_torch_threads(monkeypatch):
    import lowcomm.runtime.peer
    import lowcomm.runtime.preflight

    class PeerThatSetsProcessState:  # what the peer's context does: its own handlers, one torch thread
        def __init__(self, options, trainer):
            self.peer = None

        def run(self) -> int:
            signal.signal(signal.SIGINT, lambda *_: None)
            signal.signal(signal.SIGTERM, lambda *_: None)
            torch.set_num_threads(1)
            return 0

    monkeypatch.setattr(lowcomm.runtime.peer, "Peer", PeerThatSetsProcessState)
    monkeypatch.setattr(lowcomm.runtime.preflight, "check_peer", lambda options: None)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        joined = lowcomm.join("/ip4/127.0.0.1/tcp/31337/p2p/QmPeer", run_key="00", model=PairLM())
        assert joined.exit_code == 0
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_train_leaves_the_callers_rng_alone_when_it_builds_the_model(data):
    config = {**run_config("diloco", "tokens", data / "tokens16.bin"), "run.steps": 2, "model.d_model": 32,
              "model.n_layers": 1, "model.n_heads": 2}
    torch.manual_seed(123)
    state = torch.get_rng_state()
    lowcomm.train(config=config, peers=2)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_generator_of_heldout_batches_is_read_once_for_every_replica():
    tokens = torch.from_numpy(markov_tokens(4_000, seed=7))

    def windows(offset):
        rows = torch.stack([tokens[o:o + CONTEXT + 1] for o in range(offset, offset + 4 * 40, 40)])
        return rows[:, :-1], rows[:, 1:]

    def batches(peer, peers):
        while True:
            yield windows(1000 * peer)

    heldout = (windows(2_500 + 200 * i) for i in range(3))
    result = lowcomm.train(PairLM(vocab=VOCAB), config={"run.algo": "diloco", "run.steps": 2,
                                                       "diloco.inner_steps": 2}, peers=2,
                           batches=batches, heldout=heldout)
    assert [len(t.eval_batches) for t in result.run.trainers] == [3, 3]
    assert torch.equal(result.run.trainers[1].eval_batches[0][0], windows(2_500)[0])


def test_int32_batches_are_refused_with_what_to_do():
    batch = torch.zeros(2, CONTEXT, dtype=torch.int32), torch.zeros(2, CONTEXT, dtype=torch.int32)
    with pytest.raises(TypeError) as raised:
        lowcomm.train(PairLM(), config={"run.steps": 2}, peers=2, batches=lambda peer, peers: iter([batch]),
                      heldout=[batch])
    assert "torch.int32" in str(raised.value) and "x.long()" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_train_loads_the_corpus_once_for_every_replica(data, monkeypatch):
    import lowcomm.data.corpus
    loads = []
    load = lowcomm.data.corpus.token_file_splits
    monkeypatch.setattr(lowcomm.data.corpus, "token_file_splits", lambda *args: loads.append(args) or load(*args))
    lowcomm.train(PairLM(), config={**run_config("diloco", "tokens", data / "tokens16.bin"), "run.steps": 2},
                  peers=3)
    assert len(loads) == 1
