"""Which model a run trains: the built-in GPT, or the module a user's factory returns.

`[model] factory = "package.module:callable"` names a callable that receives the [model] section
(`ModelConfig`) and returns a `torch.nn.Module`. The module is imported by name, so its package must
be importable on every peer (installed, or its folder on PYTHONPATH). torch's RNG is seeded with the
run's seed right before the model is built, so every peer starts from the same weights; the build runs
on a fork of the RNG (`torch.random.fork_rng`), so the caller's RNG state is the same afterwards. The model's
forward takes token ids x [B, T] (int64) and returns the logits [B, T, vocab], or a tuple with the
logits first (data.loader.next_token_loss).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

import torch
from torch import nn

from lowcomm.models.gpt import GPT, ModelConfig

FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class ModelFactoryError(ValueError):
    """The model factory cannot be loaded or did not build a usable model; the message says what to do."""


def factory_spec_error(spec: str) -> str | None:
    """Why `spec` is not of the form "package.module:callable" (None: it is, or it is "" for the GPT)."""
    if spec == "" or FACTORY.match(spec):
        return None
    return f"model.factory = {spec!r}: write it as \"package.module:callable\" (or \"\" for the built-in GPT)"


def load_factory(spec: str) -> Callable[[ModelConfig], nn.Module]:
    """The callable `spec` names, imported (ModelFactoryError with one line saying what to do)."""
    problem = factory_spec_error(spec)
    if problem or not spec:
        raise ModelFactoryError(problem or "model.factory is empty: the built-in GPT needs no factory")
    module_name, _, attribute = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelFactoryError(f"model.factory = {spec!r}: cannot import {module_name!r} ({e}); install its "
                                "package or put its folder on PYTHONPATH on every peer") from None
    except Exception as e:  # the user's module raised while it was imported
        raise ModelFactoryError(f"model.factory = {spec!r}: importing {module_name!r} failed: "
                                f"{type(e).__name__}: {_first_line(e)}; fix that module") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ModelFactoryError(f"model.factory = {spec!r}: {module_name!r} has no {attribute!r}; name a "
                                    "callable defined in that module")
        target = getattr(target, part)
    if not callable(target):
        raise ModelFactoryError(f"model.factory = {spec!r}: {attribute!r} is a {type(target).__name__}, not a "
                                "callable; name a function or class that takes the [model] section")
    return target


def build_model(config: ModelConfig, seed: int | None = None) -> nn.Module:
    """The run's model, the GPT or the factory's; with `seed`, built right after torch.manual_seed(seed) on
    a fork of torch's RNG (CPU, and the current CUDA device once CUDA is in use), which is put back
    afterwards. Only the current GPU's state is forked: a peer made its GPU current (runtime.trainer.
    pick_device), and reading every GPU's state would set up CUDA on devices it never uses."""
    factory = load_factory(config.factory) if config.factory else GPT
    if seed is None:
        return _build(factory, config)
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return _build(factory, config)


def _build(factory: Callable[[ModelConfig], nn.Module], config: ModelConfig) -> nn.Module:
    if factory is GPT:
        return GPT(config)
    try:
        model = factory(config)
    except Exception as e:
        raise ModelFactoryError(f"model.factory = {config.factory!r} raised {type(e).__name__}: {_first_line(e)}; "
                                "it is called with the [model] section (a ModelConfig)") from None
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(f"model.factory = {config.factory!r} returned a {type(model).__name__}; it must "
                                "return a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFactoryError(f"model.factory = {config.factory!r} returned a module with no trainable "
                                "parameters; return the model to train")
    return model


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]
