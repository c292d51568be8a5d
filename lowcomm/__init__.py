"""lowcomm: train one model on peers scattered over the internet with low-communication algorithms.

The Python API (lowcomm.api) is importable from here: `lowcomm.train(...)` runs replicas of your
model in this process, `lowcomm.join(...)` joins a real run with it. It is loaded on first use, so
`import lowcomm` stays light.
"""

from lowcomm.version import __version__

__all__ = ["__version__", "Joined", "Trained", "join", "run_config", "train"]


def __getattr__(name: str):
    if name in __all__:
        from lowcomm import api

        return getattr(api, name)
    raise AttributeError(f"module 'lowcomm' has no attribute {name!r}")
