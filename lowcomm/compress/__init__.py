"""Tensor codecs for the wire: a name → codec registry over self-describing frames.

``get_codec(name, **params)`` returns a ``Codec`` whose ``encode`` gives bytes and
whose ``decode`` raises only ``CodecError`` on bad input. Names: ``dense`` (alias
``fp32``), ``uint8``, ``fp8``, ``q2``, ``topk``, ``dct-topk``; the last two are
``SparseCodec``s with ``select``/``transmitted``/``decode_sparse`` for error
feedback and ``scatter_mean`` aggregation.
"""

from __future__ import annotations

import inspect

from lowcomm.compress.base import Codec
from lowcomm.compress.dct_topk import DctTopKCodec
from lowcomm.compress.dense import DenseCodec
from lowcomm.compress.errors import CodecError
from lowcomm.compress.fp8 import Fp8Codec
from lowcomm.compress.q2 import Q2Codec
from lowcomm.compress.sparse import SparseCodec, scatter_mean
from lowcomm.compress.topk import TopKCodec
from lowcomm.compress.uint8 import Uint8Codec

__all__ = ["Codec", "CodecError", "SparseCodec", "get_codec", "known_codecs", "scatter_mean"]

_CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (DenseCodec, Uint8Codec, Fp8Codec, Q2Codec, TopKCodec, DctTopKCodec)
}
# Alias name -> (codec name, params it fixes); the run config says codec = "fp32" | "uint8".
_ALIASES: dict[str, tuple[str, dict[str, object]]] = {"fp32": ("dense", {"dtype": "float32"})}


def known_codecs() -> list[str]:
    """Every name ``get_codec`` accepts, aliases included."""
    return sorted([*_CODECS, *_ALIASES])


def get_codec(name: str, **params: object) -> Codec:
    """Build the codec registered as ``name`` with ``params``.

    Raises:
        ValueError: unknown name, unknown parameter, or a bad parameter value.
    """
    fixed: dict[str, object] = {}
    if name in _ALIASES:
        alias, (name, fixed) = name, _ALIASES[name]
        clash = {key for key in fixed if key in params and params[key] != fixed[key]}
        if clash:
            raise ValueError(f"codec {alias!r} fixes {fixed}; drop {sorted(clash)} or use {name!r} (known codecs: {known_codecs()})")
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; known codecs: {known_codecs()}")
    cls = _CODECS[name]
    merged = {**params, **fixed}
    accepted = _parameter_names(cls)
    unknown = sorted(set(merged) - set(accepted))
    if unknown:
        raise ValueError(
            f"codec {name!r} has no parameter(s) {unknown}; it accepts {accepted} "
            f"(known codecs: {known_codecs()})"
        )
    try:
        return cls(**merged)
    except ValueError as exc:
        raise ValueError(f"codec {name!r}: {exc} (known codecs: {known_codecs()})") from None


def _parameter_names(cls: type[Codec]) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        for param in inspect.signature(klass.__init__).parameters.values():
            if param.kind is inspect.Parameter.KEYWORD_ONLY and param.name not in names:
                names.append(param.name)
    return names
