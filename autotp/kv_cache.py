"""The KV-cache argument of a transformers model, under either of its names.

transformers 5.24 renamed a causal LM's ``past_key_values`` forward argument and output field to
``cache`` (the old keyword is accepted with a warning until 5.40, and the output keeps a
``past_key_values`` property). autotp supports every ``transformers>=5.0``, so the planner, the
benchmarks and the tests ask these two functions instead of spelling either name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

CACHE_NAMES = ("cache", "past_key_values")  # newest first


def cache_keyword(forward: Callable[..., Any]) -> str | None:
    """The name ``forward`` takes its KV cache under (None: it takes none). Decorators that wrap
    ``forward`` keep its signature through ``functools.wraps``."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in CACHE_NAMES if name in parameters), None)


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


def cache_layers(cache: Any) -> list[Any]:
    """The layers (each holding ``keys`` and ``values``) of a transformers cache: a ``DynamicCache``'s
    own, an ``EncoderDecoderCache``'s self-attention layers then its cross-attention layers; none
    for None."""
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        return layers
    inner = (getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache"))
    return [layer for c in inner if c is not None for layer in cache_layers(c)]
