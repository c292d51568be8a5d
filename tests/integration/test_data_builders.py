"""The corpus cache under concurrent builders: three processes build it at once and leave one complete
cache (the rest of the data tests are in tests/unit/test_data.py)."""

import os
import subprocess
import sys

import pytest

from lowcomm.data.corpus import DataConfig, load_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWCOMM_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield load_corpus(DataConfig())


def test_concurrent_builders_leave_one_complete_cache(tmp_path, corpus):
    env = {**os.environ, "LOWCOMM_CACHE": str(tmp_path)}
    code = ("from lowcomm.data.corpus import DataConfig, load_corpus; "
            "print(load_corpus(DataConfig()).sha256)")
    builders = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
                for _ in range(3)]
    shas = {b.communicate(timeout=60)[0].strip() for b in builders}
    assert all(b.returncode == 0 for b in builders)
    assert shas == {corpus.sha256}
    directory = next(tmp_path.iterdir())
    assert sorted(p.name for p in directory.iterdir()) == ["meta.json", "tokens.bin"]
