"""The [data] sources read from disk: nanoGPT token files (uint16, uint32, train.bin + val.bin) and a
folder of text files; every problem with them is one line saying what to do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowcomm.config import ConfigError, default_config
from lowcomm.data.corpus import CorpusError, DataConfig, load_corpus
from lowcomm.data.loader import TokenShard


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWCOMM_CACHE", str(tmp_path / "cache"))


def write_tokens(path, tokens, dtype):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return str(path)


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text and text
    return text


def test_a_uint16_file_is_memmapped_and_its_tail_held_out(tmp_path):
    tokens = np.arange(10_000) % 1000
    path = write_tokens(tmp_path / "train.bin", tokens, "<u2")
    corpus = load_corpus(DataConfig(corpus="tokens", path=path, holdout_fraction=0.1), vocab_size=1000, context=16)
    assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.dtype("<u2")
    assert len(corpus.heldout) == 1000 and corpus.n_tokens == 10_000
    assert np.array_equal(np.concatenate([corpus.train, corpus.heldout]), tokens)


def test_a_uint32_file_holds_ids_beyond_uint16(tmp_path):
    tokens = np.arange(70_000, 80_000)
    path = write_tokens(tmp_path / "big.bin", tokens, "<u4")
    corpus = load_corpus(DataConfig(corpus="tokens", path=path, dtype="uint32"), vocab_size=80_000, context=16)
    assert int(corpus.train.max()) == 70_000 + len(corpus.train) - 1 and corpus.heldout[-1] == 79_999
    x, y = TokenShard(corpus.train, 1, 2, context=16, batch_size=3, seed=0).next_batch()
    assert x.dtype == torch.int64 and int(x.min()) >= 70_000 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(CorpusError) as error:
        load_corpus(DataConfig(corpus="tokens", path=path, dtype="uint32"), vocab_size=50_000, context=16)
    assert "token id 79999" in one_line(error) and "model.vocab_size >= 80000" in str(error.value)


def test_a_nanogpt_folder_uses_val_bin_as_the_heldout_split(tmp_path):
    write_tokens(tmp_path / "train.bin", np.full(5000, 7), "<u2")
    write_tokens(tmp_path / "val.bin", np.full(300, 9), "<u2")
    corpus = load_corpus(DataConfig(corpus="tokens", path=str(tmp_path)), vocab_size=256, context=16)
    assert len(corpus.train) == 5000 and set(corpus.train.tolist()) == {7}
    assert len(corpus.heldout) == 300 and set(corpus.heldout.tolist()) == {9}


def test_a_text_folder_is_byte_level_sorted_joined_and_cached(tmp_path):
    folder = tmp_path / "texts"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "two.txt").write_bytes(b"second file")
    (folder / "a.txt").write_bytes(b"first \xff")
    (folder / ".hidden").write_bytes(b"never read")
    config = DataConfig(corpus="text", path=str(folder), holdout_fraction=0.25)
    corpus = load_corpus(config, vocab_size=256, context=2)
    stream = np.concatenate([corpus.train, corpus.heldout])
    assert bytes(stream.astype(np.uint8)) == b"first \xff\nsecond file"
    assert corpus.sha256 == load_corpus(config).sha256  # the cache, read back
    (folder / "a.txt").write_bytes(b"edited")  # another listing: another cache
    assert bytes(np.concatenate([c for c in (load_corpus(config).train, load_corpus(config).heldout)])
                 .astype(np.uint8)) == b"edited\nsecond file"


@pytest.mark.parametrize("setup, config, expected", [
    (None, dict(corpus="tokens", path="{tmp}/missing.bin"), "does not exist"),
    ("odd", dict(corpus="tokens", path="{tmp}/odd.bin"), "not a whole number of uint16 tokens"),
    ("odd", dict(corpus="tokens", path="{tmp}/odd.bin", dtype="int8"), "data.dtype = 'int8': use one of"),
    ("short", dict(corpus="tokens", path="{tmp}/short.bin"), "fewer than one window"),
    ("big", dict(corpus="tokens", path="{tmp}/big.bin"), "beyond model.vocab_size = 256"),
    ("half", dict(corpus="tokens", path="{tmp}/half"), "without val.bin"),
    (None, dict(corpus="tokens", path=""), "needs data.path"),
    (None, dict(corpus="text", path="{tmp}/nothing"), "is not a folder"),
    ("empty", dict(corpus="text", path="{tmp}/empty"), "holds no text"),
    (None, dict(corpus="wikipedia"), "use one of stdlib, tokens, text"),
])
def test_unusable_data_is_one_line_saying_what_to_do(tmp_path, setup, config, expected):
    if setup == "odd":
        (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    elif setup == "short":
        write_tokens(tmp_path / "short.bin", np.arange(100), "<u2")
    elif setup == "big":
        write_tokens(tmp_path / "big.bin", np.arange(5000) % 300, "<u2")
    elif setup == "half":
        (tmp_path / "half").mkdir()
        write_tokens(tmp_path / "half" / "train.bin", np.arange(1000), "<u2")
    elif setup == "empty":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "blank.txt").write_bytes(b"")
    data = DataConfig(**{k: v.format(tmp=tmp_path) for k, v in config.items()})
    with pytest.raises(CorpusError) as error:
        load_corpus(data, vocab_size=256, context=64)
    assert expected in one_line(error)


def test_the_run_config_checks_the_data_section_and_hashes_it(tmp_path):
    base = default_config()
    with pytest.raises(ConfigError, match="needs data.path"):
        base.override({"data.corpus": "tokens"})
    with pytest.raises(ConfigError, match="data.dtype = 'float32'"):
        base.override({"data.dtype": "float32"})
    with pytest.raises(ConfigError, match="byte-level"):
        base.override({"data.corpus": "text", "data.path": "x", "model.vocab_size": 100})
    tokens = base.override({"data.corpus": "tokens", "data.path": "a.bin", "model.vocab_size": 100})  # checked at load
    hashes = {base.config_hash(), tokens.config_hash(), tokens.override({"data.path": "b.bin"}).config_hash(),
              tokens.override({"data.dtype": "uint32"}).config_hash(),
              base.override({"model.factory": "pkg.mod:build"}).config_hash()}
    assert len(hashes) == 5


def test_a_token_files_largest_id_is_scanned_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    import lowcomm.data.token_file as token_file
    scans = []
    scan = token_file.largest_token
    monkeypatch.setattr(token_file, "largest_token", lambda tokens: scans.append(len(tokens)) or scan(tokens))
    path = write_tokens(tmp_path / "ids.bin", np.arange(5000) % 300, "<u2")
    config = DataConfig(corpus="tokens", path=path)
    load_corpus(config, vocab_size=300, context=16)
    load_corpus(config, vocab_size=300, context=16)
    assert scans == [5000]  # the second load reads the remembered id
    with pytest.raises(CorpusError, match="token id 299"):  # remembered, the check still refuses
        load_corpus(config, vocab_size=299, context=16)
    write_tokens(tmp_path / "ids.bin", np.arange(6000) % 200, "<u2")  # another size: scanned again
    load_corpus(config, vocab_size=200, context=16)
    assert scans == [5000, 6000]


def test_a_text_file_is_read_in_chunks_never_whole(tmp_path, monkeypatch):
    import pathlib

    import lowcomm.data.text_folder as text_folder
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_bytes(bytes(range(32, 127)) * 3)
    (folder / "b.txt").write_bytes(b"tail")
    monkeypatch.setattr(text_folder, "READ_BYTES", 7, raising=False)

    def whole(self):
        raise AssertionError(f"{self} read whole")

    monkeypatch.setattr(pathlib.Path, "read_bytes", whole)
    corpus = load_corpus(DataConfig(corpus="text", path=str(folder)), vocab_size=256, context=2)
    stream = np.concatenate([corpus.train, corpus.heldout])
    assert bytes(stream.astype(np.uint8)) == bytes(range(32, 127)) * 3 + b"\ntail"
