"""A plain call completed into the warm-up's prefill, so that it reuses the warm-up's graph.

``parallelize_model`` warms a decoder-only model up with ``generate(ids, max_new_tokens=1)``
(``api._warm_up``): its one forward is the prefill a user's ``generate`` makes, passed as keywords
(transformers 5.24: ``input_ids``, a fresh ``cache``, ``use_cache=True``, ``return_dict=True``).
A plain ``model(input_ids=ids)`` passes only the ids; Dynamo guards on the keywords a frame was
called with, so it used to compile a graph of its own (its parameters already pinned, but traced,
keyed and lowered again: as long as the warm-up's own compile).

The plain call asks for the same computation: a model given no cache under ``use_cache`` builds
the same empty cache itself, and ``use_cache`` / ``return_dict`` default to the config's values.
So a call whose keywords are a subset of the prefill's is completed with the ones it left out —
each constant only where the config's default *is* the prefill's value, the cache as a fresh copy
of the prefill's empty one (made before the warm-up filled it) — and runs the warm-up's graph.
The result is what the plain call returns (logits, and the filled cache it would have made). Any
other call (a mask, labels, ``use_cache=False``, another cache, positional arguments that do not
bind) is passed on unchanged and compiles what it needs, as before.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrefillCall"]


def _is_cache(value: Any) -> bool:
    """A transformers KV cache object (any ``Cache`` subclass)."""
    from transformers.cache_utils import Cache

    return isinstance(value, Cache)


@dataclass(frozen=True)
class PrefillCall:
    """The keywords of the warm-up's prefill (in the order it passed them): for each, ``tensor``
    (the ids: the caller's own are used), a constant (``use_cache=True``), or the cache, kept as
    an empty copy (:meth:`complete` hands each call its own copy)."""

    order: tuple[str, ...]
    tensors: frozenset[str]
    constants: Mapping[str, Any]
    cache_name: str | None
    empty_cache: Any

    @classmethod
    def record(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> PrefillCall | None:
        """The prefill's keywords, before it runs (its cache is still empty); None for a call this
        cannot describe (positional arguments, a cache that already holds tokens, a value that is
        neither a tensor, a cache nor a plain constant)."""
        if args:
            return None
        tensors, constants, cache_name, empty = set(), {}, None, None
        for name, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                tensors.add(name)
            elif _is_cache(value) and cache_name is None and value.get_seq_length() == 0:
                cache_name, empty = name, copy.deepcopy(value)
            elif value is None or isinstance(value, (bool, int, str)):
                constants[name] = value
            else:
                return None
        return cls(tuple(kwargs), frozenset(tensors), constants, cache_name, empty)

    def complete(self, signature: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                 config: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of a call, completed into the prefill's keywords where the call means
        the same computation (see the module docstring); else as given."""
        named = dict(kwargs)
        if args:  # model(ids): bound to their names, if the forward's signature names them all
            if signature is None:
                return args, kwargs
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                return args, kwargs
            if any(signature.parameters[n].kind in (inspect.Parameter.VAR_POSITIONAL,
                                                    inspect.Parameter.VAR_KEYWORD) for n in bound):
                return args, kwargs
            named = dict(bound)
        named = {k: v for k, v in named.items() if v is not None}  # None: the model's own default
        if not named or set(named) - set(self.order) or not set(named) & self.tensors:
            return args, kwargs
        for name, value in named.items():
            if name in self.tensors and not isinstance(value, torch.Tensor):
                return args, kwargs
            if name in self.constants and (type(value) is not type(self.constants[name])
                                           or value != self.constants[name]):
                return args, kwargs
            if name == self.cache_name:
                return args, kwargs  # the caller's own cache: its graph is its own
        missing = [n for n in self.order if n not in named]
        for name in missing:
            if name in self.tensors:
                return args, kwargs
            # a constant the call left out is the config's default there; fill only where that
            # default is the prefill's value (else the plain call means something else)
            if name in self.constants and getattr(config, name, None) != self.constants[name]:
                return args, kwargs
        if self.cache_name in missing and self.constants.get("use_cache") is not True:
            return args, kwargs  # the model makes a cache of its own only under use_cache
        completed = {}
        for name in self.order:
            if name in named:
                completed[name] = named[name]
            elif name == self.cache_name:
                completed[name] = copy.deepcopy(self.empty_cache)
            else:
                completed[name] = self.constants[name]
        return (), completed
