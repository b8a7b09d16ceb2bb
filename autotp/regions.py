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

Which calls go through the region (:func:`_regional_forward`, decided while Dynamo traces, from
what the call holds): a KV cache whose ``update`` is transformers' ``Cache.update`` (not overridden),
without offloading, that already holds a layer at this index, that layer exactly a
``DynamicLayer`` or a ``DynamicSlidingWindowLayer`` that does not record its past: prefills (the
layer's keys and values come in as None, and its first ``update`` initializes the stand-in) and
decode steps. A sliding-window layer's ``update`` returns its past and the new states concatenated,
as the stand-in's does, and keeps only the last ``sliding_window - 1`` positions: the wrapper
slices them and counts the new states (``cumulative_length``, which the model's mask reads)
outside the region (:func:`_hold_window`). The cache may come by name (``cache``,
``past_key_values``, or ``layer_past``: BLOOM's, Falcon's and GPT-NeoX's layers) or by position
(GPT-2's blocks): the wrapper passes every argument to the region by its name. A layer that returns
a tuple (BLOOM's and Falcon's blocks: the hidden states and the attention weights or None) gets it
back whole, though only tensors leave the region (:func:`_flat`, :func:`_output`). A call that
holds no cache (a training step, an encoder's layers) runs through :func:`_plain_region`, the
layer's forward on its own arguments, unless the layer is gradient-checkpointed (transformers then
wraps the call in a checkpoint, which the backend plans through: ``passes/checkpoint.py``). Every
other call (static or quantized cache layers, a sliding layer recording its past for assisted
decoding, a cache that grows its layer list on demand, a forward taking more positional arguments
than it names) runs the layer's own ``forward``, inlined as before. Measured
(one process, tp=1, CPU seconds of ``parallelize_model`` + an 8-token ``generate``, 24 layers at
hidden 64): a Mistral with a window of 4096, whose layers all fell back before, 8.5 + 9.3 ->
5.1 + 4.2 (the same model without a window: 4.8 + 4.3); with a window of 6 that the prompt
overfills, 8.4 + 19.2 -> 4.0 + 12.4; Gemma-2 (alternating, window 4) 7.8 + 12.2 -> 4.2 + 8.8;
GPT-2, whose blocks had all fallen back (the cache by position), 7.3 + 7.2 (regions off) ->
5.1 + 4.0; GPT-NeoX, not swapped before (``layer_past``), 9.2 + 8.0 -> 4.0 + 4.0; BLOOM 7.1 + 7.2
-> 3.5 + 3.6 (with the tuple output: 7.4 + 7.9 without, each layer's body traced anew); Falcon
7.3 + 9.3 either way (its bodies are not reused, ``compat.stamped_regions_keep_bound_sizes``);
same tokens as plain transformers each time. Without a cache (24 layers, load + the first
training step, loss and backward): Llama 7.6 + 7.9 -> 3.5 + 4.2, BERT 6.1 + 6.5 -> 3.2 + 3.9, same
losses. The attention reads the stand-in cache through
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
import inspect
from typing import Any

import torch
from transformers.cache_utils import (  # at import: Dynamo cannot store a guard on an import it traced
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

from autotp.compat import stamped_regions_keep_bound_sizes
from autotp.depth import CannotShorten, _text_config, layer_stack
from autotp.kv_cache import LAYER_CACHE_NAMES, cache_keyword

__all__ = ["MIN_LAYERS", "install_layer_regions", "regional_layers"]

#: the fewest regional layers for which ``parallelize_model`` installs regions by default: a region
#: costs one traced body plus a reuse check and a stamp-out per other layer, which a 2-layer stack
#: does not repay (measured: tests/distributed/test_architectures.py, 2-layer tiny models, 187.4
#: CPU-s with regions against 172.8 without); at 8 and 14 layers they save (docs/architecture.md,
#: "Layer regions"). 4 lies between, not measured: a stamp-out costs about half a traced layer
MIN_LAYERS = 4

#: set on the subclasses this module makes: the class they were made from (what
#: :func:`_regional_forward` runs where a call is not eligible; installing twice is a no-op)
_OWN_CLASS = "_autotp_own_class"


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
def _layer_region(layer: torch.nn.Module, keyword: str, layout: str, *leaves: Any) -> tuple[Any, ...]:
    """One decoder layer's forward on its cache layer's (keys, values), None in a prefill, and its
    own arguments, all packed by :func:`_regional_forward` into ``leaves`` laid out as ``layout``
    says (:func:`_unpack`): (new keys, new values, output), or, for a layer that returns a tuple
    (BLOOM's and Falcon's blocks: the hidden states and the attention weights or None),
    (new keys, new values, :func:`_mark` 2, each item, a None as :func:`_mark` 1): Dynamo reuses
    a region only where every output is a tensor (a tuple or a None among them, and each layer was
    traced anew); :func:`_output` puts the tuple back.

    Why flat: Dynamo fingerprints a region call's inputs to look for a body to reuse, and for any
    keyword or nested argument it traces ``pytree.tree_flatten`` over all of them, on every layer
    call; with leaves only it reads them as they are (``build_input_fingerprint``'s fast path).
    Profiled (tiny Llama, hidden 256, 14 layers, a 16-token prefill, one process): that flatten was
    6.9 of the 16.8 s Dynamo spent in the region calls. The layout is one string, a constant: a
    call with another layout is another input to Dynamo's reuse check, never the same body."""
    past, args, kwargs = _unpack(layout, leaves)
    cache = _OneLayerCache(past)
    kwargs[keyword] = cache
    out = _own_class(layer).forward(layer, *args, **kwargs)
    keys, values = cache.layer.keys, cache.layer.values
    return keys, values, *_flat(out, keys.device)


@torch.compiler.nested_compile_region
def _plain_region(layer: torch.nn.Module, layout: str, *leaves: Any) -> tuple[Any, ...]:
    """One decoder or encoder layer's forward on its own arguments, for a call that holds no KV
    cache (a training step, an encoder's layer), packed as for :func:`_layer_region`: its output
    as :func:`_flat` makes it."""
    _, args, kwargs = _unpack(layout, leaves)
    out = _own_class(layer).forward(layer, *args, **kwargs)
    device = next((leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)), None)
    return _flat(out, device)


def _flat(out: Any, device: torch.device | None) -> tuple[Any, ...]:
    """A layer's output as a region returns it: ``(out,)``, or for a tuple (BLOOM's and Falcon's
    blocks: the hidden states and the attention weights or None) :func:`_mark` 2 then each item,
    a None as :func:`_mark` 1 (Dynamo reuses a region only where every output is a tensor)."""
    if type(out) is tuple:
        return _mark(2, device), *(_mark(1, device) if item is None else item for item in out)
    return (out,)


def _mark(dims: int, device: torch.device | None) -> torch.Tensor:
    """An empty bool tensor of ``dims`` dims: what a region returns to say "a tuple follows" (2) or
    "None" (1), where only tensors may leave it (:func:`_layer_region`); no layer returns one. Read
    for its metadata only: after the backend inlines the region, nothing uses it."""
    return torch.empty((0,) * dims, dtype=torch.bool, device=device)


def _output(result: tuple[Any, ...], start: int) -> tuple[Any, ...]:
    """The tuple a layer returned, from what a region returned from ``start`` on: its :func:`_mark`
    2, then the items (:func:`_flat`; the callers take a lone output themselves)."""
    items = []
    for item in result[start + 1:]:
        items.append(None if isinstance(item, torch.Tensor) and item.dtype == torch.bool and item.shape == (0,)
                     else item)
    return tuple(items)


#: what a region takes as one argument (Dynamo's "leaf" inputs of a region: tensors, sizes, constants)
_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def _unpack(layout: str, leaves: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(past, args, kwargs) from the layout and leaves :func:`_regional_forward` packed. The layout
    is ``"<past>|<names>|<tuples>"``: ``<past>`` ``2`` where the leaves open with the cache layer's
    keys and values, ``0`` for a prefill (no past); ``<names>`` each argument's name in order, empty
    for a positional one, ``,``-separated; ``<tuples>`` ``start:length;`` for each argument that is
    a tuple, in order (its items are the ``length`` leaves from ``start``); every other argument is
    one leaf."""
    head, names, tuples = layout.split("|")
    i = int(head)
    past = tuple(leaves[:i]) if i else None
    starts = [tuple(int(n) for n in entry.split(":")) for entry in tuples.split(";")[:-1]]
    args, kwargs = [], {}
    for name in names.split(",") if names else ():
        if starts and starts[0][0] == i:  # in order: an empty tuple at i comes before a leaf at i
            n = starts.pop(0)[1]
            value, i = tuple(leaves[i:i + n]), i + n
        else:
            value, i = leaves[i], i + 1
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return past, tuple(args), kwargs


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The layer's index as its attention knows it (transformers' ``layer_idx``), or None. Read
    once, at install: walking the submodules on every call would be traced by Dynamo every time."""
    for module in layer.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int):
            return index
    return None


def _regional_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A layer's forward through :func:`_layer_region` where the call is eligible (see the module
    docstring) and every argument but the cache is a leaf or a tuple of leaves, else its own.

    Dynamo interprets this function symbolically on every layer call of every graph, bytecode by
    bytecode, where the region body is traced once: so it is written flat and short. Every user
    function it called, every comprehension and generator (each its own code object on Python
    3.11), was inlined afresh per call, ``all(...)`` over a generator costs about 2 ms, a builtin
    call or an attribute read 0.05-0.2 ms (measured on torch 2.13, tiny functions under
    ``torch.compile(backend="eager")``); the region wrapper cost Dynamo ~20 ms per layer call,
    0.57 s over the benchmark model's two graphs. The per-class facts (the layer's own class, the
    cache keyword, the names its arguments may come by position under and the cache's position
    among them) are class attributes set by :func:`_regional_class`, the layer index an
    attribute set at install; what is left is what this call holds: the cache's kind, its layer at
    this index, and each argument's kind. The layout is built only from names and tuple lengths,
    constants Dynamo folds, and names a call's structure exactly, so a call of another structure is
    another constant input to Dynamo's reuse check, never the same body."""
    cls = type(self)
    keyword, positional, at = cls._autotp_cache_keyword, cls._autotp_positional, cls._autotp_cache_position
    if len(args) > len(positional):  # more than the forward names: its own forward
        return cls._autotp_own_class.forward(self, *args, **kwargs)
    cache = args[at] if at < len(args) else kwargs.get(keyword)  # GPT-2's blocks take it positionally
    index = self._autotp_layer_index
    if cache is None:  # a training step or an encoder: the layer's own arguments only
        if self.training and getattr(self, "gradient_checkpointing", False):  # checkpointed: its own
            return cls._autotp_own_class.forward(self, *args, **kwargs)
        target, sliding, head, leaves = None, False, "0|", []
    # eligible: transformers' own Cache.update, no offloading, a layer at this index that is
    # exactly a DynamicLayer or a DynamicSlidingWindowLayer not recording its past (prefill or
    # decode step)
    elif (index is None or not isinstance(cache, Cache) or type(cache).update is not Cache.update
            or getattr(cache, "offloading", False) or index >= len(cache.layers)):
        return cls._autotp_own_class.forward(self, *args, **kwargs)
    else:
        target = cache.layers[index]
        sliding = type(target) is DynamicSlidingWindowLayer
        if not sliding and type(target) is not DynamicLayer or sliding and target.record_past:
            return cls._autotp_own_class.forward(self, *args, **kwargs)
        if target.is_initialized:
            head, leaves = "2|", [target.keys, target.values]
        else:
            head, leaves = "0|", []
    names = positional[:len(args)] + tuple(kwargs)  # every argument by its name: the cache's is the stand-in's
    tuples = ""
    for value in args + tuple(kwargs.values()):
        if value is cache:
            leaves.append(None)  # the region puts its stand-in under this name
        elif isinstance(value, _LEAVES):
            leaves.append(value)
        elif type(value) is tuple:
            for item in value:
                if not isinstance(item, _LEAVES):
                    return cls._autotp_own_class.forward(self, *args, **kwargs)
            tuples += f"{len(leaves)}:{len(value)};"
            leaves.extend(value)
        else:
            return cls._autotp_own_class.forward(self, *args, **kwargs)
    layout = head + ",".join(names) + "|" + tuples
    if target is None:
        result = _plain_region(self, layout, *leaves)
        return result[0] if len(result) == 1 else _output(result, 0)
    result = _layer_region(self, keyword, layout, *leaves)
    keys, values = result[0], result[1]
    if sliding:
        _hold_window(target, keys, values)
    else:
        _hold(target, keys, values)
    return result[2] if len(result) == 3 else _output(result, 2)


def _hold(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make the ``DynamicLayer`` ``layer`` hold ``keys`` and ``values``: the state its
    ``lazy_initialization`` leaves (device, initialized), less the two empty tensors it makes,
    which would be dead nodes in every traced layer. A layer initialized already (a decode step)
    keeps its device (its new keys are its old ones and the step's, concatenated there): only its
    tensors are stored, each attribute store being a side effect Dynamo records per layer call."""
    if not layer.is_initialized:
        layer.device, layer.is_initialized = keys.device, True
    layer.keys, layer.values = keys, values


def _hold_window(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make the ``DynamicSlidingWindowLayer`` ``layer`` (not recording its past) hold what its
    ``update`` leaves, given the full keys and values the region's ``DynamicLayer`` returned (its
    past and the new states, concatenated: what ``update`` concatenates and returns too): the new
    states counted in ``cumulative_length`` (which the model's sliding-window mask reads through
    ``get_mask_sizes``), and only the last ``sliding_window - 1`` positions kept, sliced as
    ``update`` slices them; a prefill also initializes it as its ``lazy_initialization`` does."""
    # the past the region concatenated: none before a prefill, nor the 1-d empty tensor
    # ``lazy_initialization`` leaves in a layer initialized before its first update
    past = layer.keys.shape[-2] if layer.is_initialized and layer.keys.dim() > 1 else 0
    if not layer.is_initialized:
        layer.device, layer.is_initialized = keys.device, True
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)
    layer.cumulative_length += keys.shape[-2] - past
    start = -layer.sliding_window + 1
    layer.keys, layer.values = keys[:, :, start:, :], values[:, :, start:, :]


@functools.cache
def _regional_class(cls: type, keyword: str) -> type:
    """``cls`` with :func:`_regional_forward` as its forward, made once per class and kept as an
    attribute of this module under a name derived from ``cls``'s: Dynamo's guards name the class,
    and stored graphs (``autotp/stored_graphs.py``) pickle it by reference, so the next launch,
    which swaps its layers before it reads them, finds it at the same place. Its class attributes
    hold what the wrapper reads of the forward's signature: the cache's name, the names of the
    arguments a call may pass by position (in order, up to the first that cannot be named), and
    the cache's position among them (past them where it has none)."""
    digest = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}:{keyword}".encode()).hexdigest()[:12]
    name = f"Regional{cls.__name__}_{digest}"
    positional = _positional_names(cls.forward)
    regional = type(name, (cls,), {"forward": _regional_forward, "_autotp_cache_keyword": keyword,
                                   "_autotp_positional": positional,
                                   "_autotp_cache_position": positional.index(keyword) if keyword in positional
                                   else len(positional),
                                   _OWN_CLASS: cls, "__module__": __name__, "__qualname__": name})
    globals()[name] = regional
    return regional


def _positional_names(forward: Any) -> tuple[str, ...]:
    """The names of ``forward``'s parameters after ``self`` that a call may pass by position and by
    name, in order, up to the first that is not one (``*args``, keyword-only, positional-only)."""
    names = []
    for parameter in list(inspect.signature(forward).parameters.values())[1:]:
        if parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        names.append(parameter.name)
    return tuple(names)


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
    return [layer for layer in stack if cache_keyword(_own_class(layer).forward, LAYER_CACHE_NAMES) is not None]


def _own_class(layer: torch.nn.Module) -> type:
    """The layer's class before :func:`install_layer_regions` swapped it."""
    cls = type(layer)
    return getattr(cls, _OWN_CLASS, cls)


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
        if not hasattr(cls, _OWN_CLASS):
            layer._autotp_layer_index = _layer_index(layer)
            layer.__class__ = _regional_class(cls, cache_keyword(cls.forward, LAYER_CACHE_NAMES))
    return len(layers)
