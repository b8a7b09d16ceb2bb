"""The KV-cache argument of a transformers model, under either of its names.

transformers 5.24 renamed a causal LM's ``past_key_values`` forward argument and output field to
``cache`` (the old keyword is accepted with a warning until 5.40, and the output keeps a
``past_key_values`` property). autotp supports every ``transformers>=5.0``, so the planner, the
benchmarks and the tests ask these two functions instead of spelling either name. The caches a
value holds and their layers (:func:`caches_in`, :func:`cache_layers`) are found here too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

CACHE_NAMES = ("cache", "past_key_values")  # newest first


#: what a decoder layer's forward may call its cache: a model's names, and ``layer_past`` (BLOOM,
#: Falcon and GPT-NeoX layers take the model's ``Cache`` under it)
LAYER_CACHE_NAMES = (*CACHE_NAMES, "layer_past")


def cache_keyword(forward: Callable[..., Any], names: tuple[str, ...] = CACHE_NAMES) -> str | None:
    """The name ``forward`` takes its KV cache under, the first of ``names`` it has (None: it takes
    none). Decorators that wrap ``forward`` keep its signature through ``functools.wraps``."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in names if name in parameters), None)


def returned_cache(output: Any) -> Any:
    """The KV cache a model call returned (None: it returned none). Reads the field, never the
    deprecated property, so no warning is printed."""
    fields = getattr(output, "__dataclass_fields__", None) or {}
    for name in CACHE_NAMES:
        if name in fields or (not fields and hasattr(output, name)):
            value = getattr(output, name, None)
            if value is not None:
                return value
    return None


def caches_in(value: Any) -> Iterator[Any]:
    """The transformers cache objects in ``value``: those with a ``layers`` list (``DynamicCache``,
    ``StaticCache``), also inside an ``EncoderDecoderCache`` (its self-attention cache, then its
    cross-attention cache), a ModelOutput, a dict or a tuple."""
    if value is None:
        return
    layers = getattr(value, "layers", None)  # (a tensor has none of these attributes: nothing)
    if isinstance(layers, list):
        yield value
        return
    if isinstance(value, dict):
        for v in value.values():
            yield from caches_in(v)
        return
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from caches_in(v)
        return
    for name in ("self_attention_cache", "cross_attention_cache"):
        inner = getattr(value, name, None)
        if inner is not None:
            yield from caches_in(inner)


def cache_layers(cache: Any) -> list[Any]:
    """The layers (each holding ``keys`` and ``values``) of the caches in ``cache``
    (:func:`caches_in`): a ``DynamicCache``'s own, an ``EncoderDecoderCache``'s self-attention
    layers then its cross-attention layers; none for None."""
    return [layer for c in caches_in(cache) for layer in c.layers]
