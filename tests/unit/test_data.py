import hashlib
import json

import numpy as np
import pytest
import torch

from lowcomm.data.corpus import CorpusError, DataConfig, cache_dir, load_corpus, tokenize_stdlib
from lowcomm.data.loader import TokenShard, evaluate, heldout_batches
from lowcomm.models.gpt import GPT, ModelConfig


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWCOMM_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def corpus(corpus_cache):
    return load_corpus(DataConfig())


def test_corpus_loads_as_byte_tokens_with_a_fixed_holdout(corpus):
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.heldout, np.memmap)
    assert corpus.train.dtype == np.uint16 and corpus.heldout.dtype == np.uint16
    assert len(corpus.train) + len(corpus.heldout) == corpus.n_tokens > 1_000_000
    assert len(corpus.heldout) / corpus.n_tokens == pytest.approx(0.02, abs=1e-6)
    assert corpus.train.max() < 256 and corpus.heldout.max() < 256
    # the held-out part is the tail of the stream
    stream = tokenize_stdlib()
    assert np.array_equal(corpus.heldout, stream[-len(corpus.heldout):])


def test_corpus_sha_is_deterministic_and_cached(corpus):
    again = load_corpus(DataConfig())
    assert again.sha256 == corpus.sha256
    meta = json.loads((cache_dir() / "meta.json").read_text())
    assert meta["sha256"] == corpus.sha256 and meta["n_tokens"] == corpus.n_tokens
    assert hashlib.sha256(tokenize_stdlib().tobytes()).hexdigest() == corpus.sha256


def test_holdout_fraction_is_taken_from_the_config(corpus):
    other = load_corpus(DataConfig(holdout_fraction=0.1))
    assert len(other.heldout) == round(0.1 * corpus.n_tokens)


def test_unknown_corpus_is_a_clear_error(corpus_cache):
    with pytest.raises(CorpusError, match="stdlib"):
        load_corpus(DataConfig(corpus="wikipedia"))


def test_truncated_cache_is_rebuilt(monkeypatch, tmp_path, corpus):
    monkeypatch.setenv("LOWCOMM_CACHE", str(tmp_path))
    load_corpus(DataConfig())
    tokens_file = cache_dir() / "tokens.bin"
    tokens_file.write_bytes(tokens_file.read_bytes()[:1000])
    assert load_corpus(DataConfig()).n_tokens == corpus.n_tokens


def test_shards_are_disjoint_and_cover_the_train_split():
    tokens = np.arange(10_003, dtype=np.uint16)
    shards = [TokenShard(tokens, i, 4, context=8, batch_size=2, seed=0) for i in range(4)]
    assert [s.start for s in shards] == [0] + [s.stop for s in shards[:-1]]
    assert shards[-1].stop == len(tokens)
    assert np.array_equal(np.concatenate([s.tokens for s in shards]), tokens)
    for shard in shards:
        for _ in range(20):
            x, _ = shard.next_batch()
            assert shard.start <= x.min() and x.max() < shard.stop


def test_batches_are_next_token_pairs_and_deterministic(corpus):
    a = TokenShard(corpus.train, 1, 4, context=64, batch_size=16, seed=7)
    b = TokenShard(corpus.train, 1, 4, context=64, batch_size=16, seed=7)
    other_seed = TokenShard(corpus.train, 1, 4, context=64, batch_size=16, seed=8)
    other_shard = TokenShard(corpus.train, 2, 4, context=64, batch_size=16, seed=7)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert xa.shape == ya.shape == (16, 64) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    fresh = TokenShard(corpus.train, 1, 4, context=64, batch_size=16, seed=7).next_batch()[0]
    assert not torch.equal(other_seed.next_batch()[0], fresh)
    assert not torch.equal(other_shard.next_batch()[0], fresh)


def test_shard_too_small_for_a_window_is_rejected():
    with pytest.raises(ValueError, match="context"):
        TokenShard(np.zeros(100, dtype=np.uint16), 0, 10, context=64, batch_size=1, seed=0)


def test_heldout_batches_are_fixed_and_span_the_heldout_tokens(corpus):
    first = heldout_batches(corpus.heldout, context=64, batch_size=16, n_batches=4)
    second = heldout_batches(corpus.heldout, context=64, batch_size=16, n_batches=4)
    assert len(first) == 4
    for (xa, ya), (xb, yb) in zip(first, second):
        assert xa.shape == (16, 64) and torch.equal(xa, xb) and torch.equal(ya, yb)
    heldout = torch.from_numpy(np.asarray(corpus.heldout, dtype=np.int64))
    assert torch.equal(first[0][0][0], heldout[:64])
    assert torch.equal(first[-1][1][-1], heldout[-64:])


def test_evaluate_restores_the_training_mode():
    torch.manual_seed(0)
    model = GPT(ModelConfig())
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    batches = heldout_batches(tokens, context=64, batch_size=4, n_batches=2)
    model.train()
    loss = evaluate(model, batches)
    assert model.training and abs(loss - np.log(256)) < 0.1
    model.eval()
    assert evaluate(model, batches) == loss
    assert not model.training
