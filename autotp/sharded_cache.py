"""Eager edits of a KV cache whose entries a parallelized model returned sharded.

``parallelize_model`` returns each KV-cache entry as a stand-in: a NaN-filled, zero-memory tensor
of the global shape that carries this rank's heads (:func:`autotp.context.sharded_standin`).
Between forward calls transformers edits a cache eagerly, through its layers' methods: beam search
reorders it (``reorder_cache``: ``index_select`` on the batch dim), assisted and contrastive
decoding select, repeat or crop it (``batch_select_indices``, ``batch_repeat_interleave``,
``crop``). Run on the stand-ins, those edits would produce plain NaN tensors and lose the shards,
and the entry would refuse the cache at the next call (:class:`autotp.inputs.CacheWatch`).

None of them touches the dim a plan shards a cache on (heads); they act on the batch and sequence
dims. So :func:`follow_edits` makes those methods of each cache layer that holds stand-ins run on
the local shards: the layer's stand-ins are swapped for their shards, the library's own method
runs unchanged, and what it leaves is wrapped again as stand-ins of the new global shape (the
sharded dim's global size kept, the dim markings Dynamo reads copied, so the next call reuses its
graph as after any step). A method that changed the sharded dim's local size is refused: that
would be an edit across heads, which no rank can make alone.

What is covered: edits through those four methods, on any layer class that has them (transformers'
dynamic and sliding-window layers; ``EncoderDecoderCache`` holds two such caches). What is not: a
user's own eager edit of ``layer.keys`` (a clone, a slice), which the entry still refuses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from autotp.compat import dim_markings
from autotp.context import output_path_of, shard_of, sharded_standin
from autotp.errors import AutoTPError

#: the cache-layer methods transformers' ``generate`` edits a cache with between forward calls
EDITS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave", "crop")
#: set on a layer whose methods already follow its shards
_FOLLOWING = "_autotp_follows_shards"


def follow_edits(cache: Any) -> None:
    """Make :data:`EDITS` of every layer of ``cache`` that holds stand-ins act on its shards
    (idempotent; the instance's methods shadow the class's, the class is untouched)."""
    for layer in getattr(cache, "layers", ()):
        if getattr(layer, _FOLLOWING, False) or not any(shard_of(v) is not None for v in vars(layer).values()):
            continue
        for name in EDITS:
            method = getattr(layer, name, None)
            if callable(method):
                setattr(layer, name, _on_shards(layer, method))
        setattr(layer, _FOLLOWING, True)


def _on_shards(layer: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def edit(*args: Any, **kwargs: Any) -> Any:
        held = {name: value for name, value in vars(layer).items() if shard_of(value) is not None}
        for name, value in held.items():
            setattr(layer, name, shard_of(value)[0])
        try:
            return method(*args, **kwargs)
        finally:
            for name, standin in held.items():
                setattr(layer, name, _rewrapped(standin, getattr(layer, name), method.__name__))

    return edit


def _rewrapped(standin: torch.Tensor, local: Any, edit: str) -> Any:
    """``local`` (what the edit left of ``standin``'s shard) as a stand-in again."""
    shard, placement = shard_of(standin)
    if local is shard:  # the edit left this entry alone
        return standin
    if not isinstance(local, torch.Tensor):
        return local
    if local.dim() != shard.dim() or local.shape[placement.dim] != shard.shape[placement.dim]:
        raise AutoTPError(
            f"the KV cache's {edit} changed the dim each rank holds a part of ({placement}: local shape "
            f"{tuple(shard.shape)} -> {tuple(local.shape)}), which no rank can do alone; edit the cache "
            "only along its batch and sequence dims, or pass use_cache=False")
    out = sharded_standin(local, placement, 1, output_path_of(standin), size=standin.shape[placement.dim])
    for attribute, marks in dim_markings(standin).items():
        setattr(out, attribute, type(marks)(marks) if isinstance(marks, (set, list, tuple, dict)) else marks)
    return out
