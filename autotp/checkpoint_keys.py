"""Checkpoint keys -> model parameters, with transformers' own conversion mapping, read per slice.

Why
===

A checkpoint does not always store a parameter under the parameter's name. transformers 5.x keeps,
per model class / ``model_type``, a list of weight transforms (``transformers.conversion_mapping``,
applied in ``core_model_loading.convert_and_load_state_dict_in_model``):

* ``WeightRenaming``: the key changes, the tensor does not (GPT-NeoX stores its head as
  ``embed_out.weight``; the model calls it ``lm_head.weight``; legacy ``LayerNorm.gamma``);
* ``WeightConverter``: several stored tensors become one parameter through a chain of operations
  (Mixtral stores one ``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` per expert; the model holds
  ``mlp.experts.gate_up_proj = cat([stack(w1_e), stack(w3_e)], 1)`` and
  ``mlp.experts.down_proj = stack(w2_e)``).

autotp never asks which model it is: it takes the transforms transformers itself would apply to
this model (``get_model_conversion_mapping``), renames every stored key with transformers' own
``rename_source_key`` (renamings, then at most one converter, then the base-model prefix, exactly
as ``convert_and_load_state_dict_in_model`` does), and groups the keys a converter collects per
target, in transformers' order (keys sorted by ``dot_natural_key``, so expert 10 follows expert 9).

How a parameter is read
=======================

Each converted parameter gets a **source**: a small tree describing how its global tensor is
built from stored tensors.

* :class:`Stored` - one stored tensor (a renaming);
* :class:`Stacked` - ``torch.stack(parts, dim)`` (transformers' ``MergeModulelist``);
* :class:`Concatenated` - ``torch.cat(parts, dim)`` (``Concatenate``);
* :class:`Converted` - any other chain (``Chunk``, ``Transpose``, ``PermuteForRope``, ...): the
  sources are read in full and transformers' own operations run on them; only then is the rank's
  slice cut. Correct for every converter, but it reads whole tensors, so it is the fallback.

:func:`read_source` reads ``[start, stop)`` of one dim of a source by pushing the slice down the
tree: a slice along a stacked dim selects parts, along a concatenated dim it selects the parts it
overlaps (and their sub-ranges), along any other dim it becomes the same slice of every part. So
rank ``r`` of a Mixtral ``gate_up_proj`` sharded on the intermediate dim (fused: strided over the
gate and up segments) reads, for every expert, exactly its rows of ``w1`` and of ``w3``.

The :class:`~autotp.weights.Checkpoint` knows these sources by the parameter names
(:meth:`~autotp.weights.Checkpoint.add_conversions`), so a converted parameter has a checkpoint key
like any other and every reader (``ParameterMeta.load_local``, ``verify``) works unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autotp.compat import weight_conversions
from autotp.errors import CheckpointError

__all__ = [
    "Concatenated",
    "Converted",
    "Source",
    "Stacked",
    "Stored",
    "converted_sources",
    "read_source",
    "source_dtype",
    "source_shape",
    "stored_keys",
]


@dataclass(frozen=True)
class Stored:
    """One tensor stored in the checkpoint under ``key``."""

    key: str


@dataclass(frozen=True)
class Stacked:
    """``torch.stack(parts, dim)``."""

    dim: int
    parts: tuple[Source, ...]


@dataclass(frozen=True)
class Concatenated:
    """``torch.cat(parts, dim)``."""

    dim: int
    parts: tuple[Source, ...]


@dataclass(frozen=True, eq=False)
class Converted:
    """Parameter ``target`` of transformers' ``converter`` run on the stored ``sources``
    (source pattern -> keys, in the order transformers collects them); ``layer_name`` is the name
    transformers passes to ``convert`` (the converter's first target)."""

    converter: Any
    layer_name: str
    target: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]
    model: Any


Source = Stored | Stacked | Concatenated | Converted

#: reads ``[start, stop)`` of ``dim`` (None: all) of a stored key, converted to ``dtype``
StoredReader = Callable[[str, int | None, int, int, torch.dtype | None], torch.Tensor]
StoredInfo = Callable[[str], tuple[tuple[int, ...], torch.dtype]]


# --------------------------------------------------------------------------------------------------
# Building sources from transformers' conversion mapping
# --------------------------------------------------------------------------------------------------


def converted_sources(
    model: torch.nn.Module, checkpoint_keys: Collection[str], transforms: list[Any] | None = None
) -> dict[str, Source]:
    """Model state-dict name -> :data:`Source`, for every name transformers would fill from a
    checkpoint key with another name (a renaming) or from several keys (a converter).

    ``transforms`` defaults to ``transformers.conversion_mapping.get_model_conversion_mapping(model)``
    (none for a model that is not a ``PreTrainedModel``). Names stored as they are, and names that
    differ only by the base-model prefix, are left to :func:`autotp.weights.checkpoint_key`.
    """
    hf = weight_conversions()
    WeightConverter, WeightRenaming = hf.WeightConverter, hf.WeightRenaming  # noqa: N806 - classes
    dot_natural_key, rename_source_key = hf.dot_natural_key, hf.rename_source_key

    if transforms is None:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            return {}
        transforms = hf.get_model_conversion_mapping(model)
    if not transforms:
        return {}
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {p: c for c in converters for p in c.source_patterns}
    names = dict.fromkeys(model.state_dict(keep_vars=True), True)  # rename_source_key tests `.get() is not None`
    prefix = getattr(model, "base_model_prefix", None) or None

    sources: dict[str, Source] = {}
    collected: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # first target -> (converter, pattern -> keys)
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # as transformers: a stored name wins over a bad rename
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if renamed not in names:
            continue
        if pattern is None:
            plain, _ = rename_source_key(key, [], [], prefix, names)
            if renamed != plain:  # a renaming fired (not just the base-model prefix)
                sources[renamed] = Stored(key)
            continue
        _, by_pattern = collected.setdefault(renamed, (converter_of[pattern], {}))
        by_pattern.setdefault(pattern, []).append(key)
    for layer_name, (converter, by_pattern) in collected.items():
        sources.update(_converter_sources(converter, layer_name, by_pattern, model))
    return sources


def _converter_sources(converter: Any, layer_name: str, by_pattern: dict[str, list[str]],
                       model: torch.nn.Module) -> dict[str, Source]:
    """The sources of the parameters one converter fills from ``by_pattern``: sliced trees when its
    operations only stack and concatenate, else :class:`Converted` for each target."""
    hf = weight_conversions()
    Concatenate, MergeModulelist = hf.Concatenate, hf.MergeModulelist  # noqa: N806 - classes

    state: dict[str, list[Source] | Source] = {p: [Stored(k) for k in keys] for p, keys in by_pattern.items()}
    targets = list(converter.target_patterns)
    for op in converter.operations:
        if type(op) is MergeModulelist:
            merged: dict[str, list[Source] | Source] = {}
            count = len(state)
            for pattern in list(state):
                value = state.pop(pattern)
                merged[op.get_target_pattern(count, pattern, targets)] = (
                    Stacked(op.dim, tuple(value)) if isinstance(value, list) else value)
            state = merged
        elif type(op) is Concatenate:
            parts: list[Source] = []
            for pattern in converter.source_patterns:
                value = state.pop(pattern, None)
                if value is not None:
                    parts.extend(value if isinstance(value, list) else [value])
            state = {op.get_target_pattern(targets): Concatenated(op.dim, tuple(parts))}
        else:
            items = tuple((p, tuple(keys)) for p, keys in by_pattern.items())
            return {name: Converted(converter, layer_name, name, items, model)
                    for name in _full_names(layer_name, targets)}
    named = _full_names(layer_name, list(state))
    return {name: (value[0] if isinstance(value, list) else value)
            for name, value in zip(named, state.values(), strict=True)}


def _full_names(layer_name: str, targets: list[str]) -> list[str]:
    """transformers' expansion of target patterns into full names (``WeightConverter.convert``):
    the prefix and suffix around the first target found in ``layer_name``."""
    full = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    found = next((t for t in targets if t in full), None)
    if found is None:
        return list(targets)
    head, _, tail = full.partition(found)
    return [head + t + tail for t in targets]


# --------------------------------------------------------------------------------------------------
# Shapes, dtypes and sliced reads
# --------------------------------------------------------------------------------------------------


def stored_keys(source: Source) -> list[str]:
    """Every stored key ``source`` reads, in order."""
    if isinstance(source, Stored):
        return [source.key]
    if isinstance(source, Converted):
        return [k for _, keys in source.sources for k in keys]
    return [k for part in source.parts for k in stored_keys(part)]


def source_dtype(source: Source, info: StoredInfo) -> torch.dtype:
    """The stored dtype (of the first stored tensor: transformers stacks and concatenates as is)."""
    return info(stored_keys(source)[0])[1]


def source_shape(source: Source, info: StoredInfo) -> tuple[int, ...]:
    """The global shape of the tensor ``source`` builds (headers only, no data read)."""
    if isinstance(source, Stored):
        return tuple(info(source.key)[0])
    if isinstance(source, Converted):
        def meta(key: str, dim: int | None, start: int, stop: int, dtype: torch.dtype | None) -> torch.Tensor:
            shape, stored = info(key)
            return torch.empty(shape, dtype=dtype or stored, device="meta")

        return tuple(_run_converter(source, meta, None).shape)
    shapes = [source_shape(p, info) for p in source.parts]
    if not shapes or any(len(s) != len(shapes[0]) for s in shapes) or (
            isinstance(source, Stacked) and len(set(shapes)) > 1):
        raise CheckpointError(f"cannot combine stored tensors of shapes {shapes} ({stored_keys(source)[:4]}...)")
    if isinstance(source, Stacked):
        dim = source.dim % (len(shapes[0]) + 1)
        return (*shapes[0][:dim], len(shapes), *shapes[0][dim:])
    dim = source.dim % len(shapes[0])
    return (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1:])


def read_source(source: Source, read: StoredReader, info: StoredInfo, dim: int | None, start: int, stop: int,
                dtype: torch.dtype | None) -> torch.Tensor:
    """``[start, stop)`` of ``dim`` (None: everything) of the tensor ``source`` builds, reading only
    the stored rows that slice needs (except for :class:`Converted`)."""
    if isinstance(source, Stored):
        return read(source.key, dim, start, stop, dtype)
    if isinstance(source, Converted):
        full = _run_converter(source, read, dtype)
        if dim is None:
            return full
        index = (slice(None),) * dim + (slice(start, stop),)
        return full[index].contiguous()
    if isinstance(source, Stacked):
        ndim = len(source_shape(source, info))
        at = source.dim % ndim
        if dim == at:
            return torch.stack([read_source(p, read, info, None, 0, 0, dtype) for p in source.parts[start:stop]], at)
        inner = None if dim is None else (dim if dim < at else dim - 1)
        return torch.stack([read_source(p, read, info, inner, start, stop, dtype) for p in source.parts], at)
    ndim = len(source_shape(source, info))
    at = source.dim % ndim
    if dim != at:
        return torch.cat([read_source(p, read, info, dim, start, stop, dtype) for p in source.parts], at)
    pieces, offset = [], 0
    for part in source.parts:
        size = source_shape(part, info)[at]
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi or (not pieces and part is source.parts[-1]):
            pieces.append(read_source(part, read, info, at, lo - offset if lo < hi else 0,
                                      hi - offset if lo < hi else 0, dtype))
        offset += size
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, at)


def _run_converter(source: Converted, read: StoredReader, dtype: torch.dtype | None) -> torch.Tensor:
    """Run transformers' own converter on the full stored tensors and return ``source.target``."""
    converter = copy.deepcopy(source.converter)
    for pattern, keys in source.sources:
        for key in keys:
            converter.add_tensor(source.layer_name, key, pattern,
                                 lambda k=key: read(k, None, 0, 0, dtype))
    try:
        out = converter.convert(source.layer_name, model=source.model, config=getattr(source.model, "config", None))
    except Exception as e:
        raise CheckpointError(
            f"transformers' conversion {converter!r} failed on {_names(k for _, ks in source.sources for k in ks)}: "
            f"{type(e).__name__}: {e}. The checkpoint does not match this architecture's conversion mapping."
        ) from e
    value = out.get(source.target)
    if value is None:
        raise CheckpointError(f"transformers' conversion {converter!r} produced {sorted(out)}, not {source.target!r}.")
    return value[0] if isinstance(value, list) else value


def _names(keys: Iterable[str]) -> str:
    keys = list(keys)
    return ", ".join(keys[:3]) + (f" ... ({len(keys)} keys)" if len(keys) > 3 else "")
