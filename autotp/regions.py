"""Trace a repeated decoder layer once: Dynamo's subgraph reuse for the layer stack.

Dynamo inlines a model's forward, so a decoder of ``n`` layers is traced ``n`` times over, and
each graph of a launch (prefill, decode) pays for it again: on the 150M-parameter benchmark model
Dynamo's trace was 3.7 s of the prefill graph's 8.1 s compile. ``torch.compiler.
nested_compile_region`` marks a function whose calls Dynamo traces once: a later call whose inputs
match (the same tensor metadata, and the guards of everything the body read re-checked against the
new call's inputs, ``torch/_dynamo/variables/invoke_subgraph.py``) is stamped out as another call
of the same subgraph (``invoke_subgraph``), not traced again.

A transformers decoder layer cannot be marked as it is. It takes the KV cache object and writes
into it (``cache.update`` keeps the concatenated keys on the cache's layer): measured on torch 2.13,
Dynamo refuses to reuse such a region ("subgraph has side effects", and "unsupported input VT
types" for the cache object as an input). So a layer call runs through :func:`_layer_region`,
which takes tensors only: outside the region the cache's layer for this layer index is taken
apart (its ``keys`` and ``values`` go in), inside it a fresh ``DynamicLayer`` holding them stands
in for the cache (:class:`_OneLayerCache`; its ``update`` is the library's own
``DynamicLayer.update``, so the keys are concatenated exactly as before), and the layer's new keys
and values come out as outputs, which the wrapper writes back to the cache's layer, as ``update``
would have. The layer's own ``forward`` runs unchanged inside the region.

Which calls go through the region (:func:`_eligible`, decided while Dynamo traces, from what the
call holds): a KV cache whose ``update`` is transformers' ``Cache.update`` (not overridden),
without offloading, that already holds a layer at this index, that layer exactly a
``DynamicLayer``: prefills (the layer's keys and values come in as None, and its first ``update``
initializes the stand-in) and decode steps. Every other call (training without a cache,
sliding-window, static or quantized cache layers, a cache that grows its layer list on demand) runs
the layer's own ``forward``, inlined as before. The attention reads the stand-in cache through
``update`` only; a layer that reads anything else of it (its length, its mask sizes) gets the one
layer's answer (:class:`_OneLayerCache` answers ``get_seq_length`` and ``get_mask_sizes`` from
that layer, which is what transformers' cache answers for that index).

What is guaranteed: the region body is the layer's own code and Dynamo re-checks every guard the
body needed before reusing it, so a layer of another kind (a different class, sliding window,
attribute that the body read) gets its own subgraph. The backend inlines each subgraph call
before planning (:func:`autotp.passes.inline.inline_subgraphs`), so planning and lowering see the
graph they saw before; what is saved is Dynamo's trace of the repeated layers. What is not: the
parameters of every layer are still graph inputs with their own guards, so the trace still grows
(more slowly) with depth.

:func:`install_layer_regions` swaps each layer of the one layer stack (``depth.layer_stack``) to a
subclass made once per layer class (its ``forward`` is :func:`_regional_forward`, its name
``Regional<Name>_<digest>``); the layer's attributes and parameters are its own. ``parallelize_model``
installs it where the stack has at least :data:`MIN_LAYERS` such layers, unless ``layer_regions=False``
/ ``AUTOTP_LAYER_REGIONS=0`` (``True`` / ``1``: at any depth). torch 2.13 failed to
recompile a graph whose stamped-out region had read a size that the recompile specializes
(``InternalTorchDynamoError: KeyError: 2`` in ``stamp_out_subgraph``: forwards at batch 1, then a
generate at batch 2; a 32-token forward, then a generate from 8 tokens);
:func:`autotp.compat.stamped_regions_keep_bound_sizes`, installed with the first region, mends it.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch
from transformers.cache_utils import (  # at import: Dynamo cannot store a guard on an import it traced
    Cache,
    DynamicLayer,
)

from autotp.compat import stamped_regions_keep_bound_sizes
from autotp.depth import CannotShorten, _text_config, layer_stack
from autotp.kv_cache import cache_keyword

__all__ = ["MIN_LAYERS", "install_layer_regions", "regional_layers"]

#: the fewest regional layers for which ``parallelize_model`` installs regions by default: a region
#: costs one traced body plus a reuse check and a stamp-out per other layer, which a 2-layer stack
#: does not repay (measured: tests/distributed/test_architectures.py, 2-layer tiny models, 187.4
#: CPU-s with regions against 172.8 without); at 8 and 14 layers they save (docs/architecture.md,
#: "Layer regions"). 4 lies between, not measured: a stamp-out costs about half a traced layer
MIN_LAYERS = 4

#: set on the subclasses this module makes (``True``), so that installing twice is a no-op
_REGIONAL = "_autotp_layer_region"


class _OneLayerCache:
    """The KV cache a layer sees inside its region: one ``DynamicLayer`` (fresh, made inside the
    region from the keys and values passed in) answering for every layer index."""

    def __init__(self, past: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.layer = DynamicLayer()
        if past is not None:  # None: a prefill, whose first update initializes the layer
            _hold(self.layer, *past)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)


@torch.compiler.nested_compile_region
def _layer_region(layer: torch.nn.Module, keyword: str, layout: str,
                  *leaves: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One decoder layer's forward on its cache layer's (keys, values), None in a prefill, and its
    own arguments, all packed by :func:`_pack` into ``leaves`` laid out as ``layout`` says:
    (output, new keys, new values)."""
    past, args, kwargs = _unpack(layout, leaves)
    cache = _OneLayerCache(past)
    out = _own_class(layer).forward(layer, *args, **{**kwargs, keyword: cache})
    return out, cache.layer.keys, cache.layer.values


#: the layout name of the cache layer's (keys, values) entry (no keyword argument can be named so)
_PAST = "*past"
#: what a region takes as one argument (Dynamo's "leaf" inputs of a region: tensors, sizes, constants)
_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def _pack(past: tuple[torch.Tensor, torch.Tensor] | None, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> tuple[str, list[Any]] | None:
    """The region's arguments as a flat list of leaves and the layout that rebuilds them
    (``"*past:2;:-1;attention_mask:-1;position_embeddings:2;..."``: each entry's name, empty for a
    positional one, and its tuple length, -1 for a leaf), or None where a value is neither a leaf
    nor a tuple of leaves (the call then runs the layer's own forward).

    Why flat: Dynamo fingerprints a region call's inputs to look for a body to reuse, and for any
    keyword or nested argument it traces ``pytree.tree_flatten`` over all of them, on every layer
    call; with leaves only it reads them as they are (``build_input_fingerprint``'s fast path).
    Profiled (tiny Llama, hidden 256, 14 layers, a 16-token prefill, one process): that flatten was
    6.9 of the 16.8 s Dynamo spent in the region calls. The layout is one string, a constant: a
    call with another layout is another input to Dynamo's reuse check, never the same body."""
    parts, leaves = [], []
    for name, value in ((_PAST, past), *(("", a) for a in args), *kwargs.items()):
        if type(value) is tuple and all(isinstance(v, _LEAVES) for v in value):
            parts.append(f"{name}:{len(value)}")
            leaves.extend(value)
        elif isinstance(value, _LEAVES):
            parts.append(f"{name}:-1")
            leaves.append(value)
        else:
            return None
    return ";".join(parts), leaves


def _unpack(layout: str, leaves: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(past, args, kwargs) from :func:`_pack`'s layout and leaves."""
    past, args, kwargs, i = None, [], {}, 0
    for part in layout.split(";"):
        name, size = part.rsplit(":", 1)
        n = int(size)
        value = leaves[i] if n < 0 else tuple(leaves[i:i + n])
        i += 1 if n < 0 else n
        if name == _PAST:
            past = value
        elif name:
            kwargs[name] = value
        else:
            args.append(value)
    return past, tuple(args), kwargs


def _eligible(cache: Any, index: Any) -> Any:
    """The cache layer this call's region reads and writes, or None where the call runs as it is
    (see the module docstring)."""
    if not isinstance(index, int) or not isinstance(cache, Cache) or getattr(cache, "offloading", False):
        return None
    if type(cache).update is not Cache.update or index >= len(cache.layers):
        return None
    layer = cache.layers[index]
    return layer if type(layer) is DynamicLayer else None


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The layer's index as its attention knows it (transformers' ``layer_idx``), or None. Read
    once, at install: walking the submodules on every call would be traced by Dynamo every time."""
    for module in layer.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


def _regional_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A layer's forward through :func:`_layer_region` where the call is eligible, else its own."""
    own = _own_class(self).forward
    keyword = type(self)._autotp_cache_keyword
    cache = kwargs.get(keyword)
    target = _eligible(cache, self._autotp_layer_index) if cache is not None else None
    if target is None:
        return own(self, *args, **kwargs)
    past = (target.keys, target.values) if target.is_initialized else None
    packed = _pack(past, args, {k: v for k, v in kwargs.items() if k != keyword})
    if packed is None:
        return own(self, *args, **kwargs)
    layout, leaves = packed
    out, keys, values = _layer_region(self, keyword, layout, *leaves)
    _hold(target, keys, values)
    return out


def _hold(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make the ``DynamicLayer`` ``layer`` hold ``keys`` and ``values``: the state its
    ``lazy_initialization`` leaves (device, initialized), less the two empty tensors it makes,
    which would be dead nodes in every traced layer."""
    layer.device, layer.is_initialized = keys.device, True
    layer.keys, layer.values = keys, values


@functools.cache
def _regional_class(cls: type, keyword: str) -> type:
    """``cls`` with :func:`_regional_forward` as its forward, made once per class and kept as an
    attribute of this module under a name derived from ``cls``'s: Dynamo's guards name the class,
    and stored graphs (``autotp/stored_graphs.py``) pickle it by reference, so the next launch,
    which swaps its layers before it reads them, finds it at the same place."""
    digest = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}:{keyword}".encode()).hexdigest()[:12]
    name = f"Regional{cls.__name__}_{digest}"
    regional = type(name, (cls,), {"forward": _regional_forward, "_autotp_cache_keyword": keyword,
                                   _REGIONAL: True, "__module__": __name__, "__qualname__": name})
    globals()[name] = regional
    return regional


def regional_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers :func:`install_layer_regions` would swap: each layer of the one layer stack
    whose forward takes a KV cache (empty where the model has no such stack)."""
    config = getattr(module, "config", None)
    depth = getattr(_text_config(config), "num_hidden_layers", None) if config is not None else None
    if not isinstance(depth, int) or depth < 2 or getattr(config, "is_encoder_decoder", False):
        return []
    try:
        stack = module.get_submodule(layer_stack(module, depth))
    except CannotShorten:
        return []
    return [layer for layer in stack if cache_keyword(_own_class(layer).forward) is not None]


def _own_class(layer: torch.nn.Module) -> type:
    """The layer's class before :func:`install_layer_regions` swapped it."""
    cls = type(layer)
    return cls.__mro__[1] if getattr(cls, _REGIONAL, False) else cls


def install_layer_regions(module: torch.nn.Module, min_layers: int = 1) -> int:
    """Route each eligible layer call of ``module``'s layer stack through its region (see the
    module docstring) where the stack has at least ``min_layers`` such layers (``parallelize_model``'s
    default: :data:`MIN_LAYERS`); returns how many layers were swapped (0 below ``min_layers``)."""
    layers = regional_layers(module)
    if len(layers) < max(min_layers, 1):
        return 0
    stamped_regions_keep_bound_sizes()
    for layer in layers:
        cls = type(layer)
        if not getattr(cls, _REGIONAL, False):
            layer._autotp_layer_index = _layer_index(layer)
            layer.__class__ = _regional_class(cls, cache_keyword(cls.forward))
    return len(layers)
