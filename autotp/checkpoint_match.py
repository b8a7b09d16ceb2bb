"""Does the checkpoint hold every tensor the model needs, in a shape and dtype that fit?

Answered from the safetensors headers (or the index and the shards' headers; a ``.bin`` file's
pickled metadata) alone, before anything is traced or compiled, so a mismatched checkpoint fails in
seconds instead of after every rank compiled. Used by ``parallelize_model`` (before the
stand-ins are made), ``autotp generate`` (in the launching process, before any rank starts) and
``autotp plan`` (when the folder holds weights).

Every problem is collected and reported at once, in one :class:`~autotp.errors.CheckpointError`:
parameters with no tensor, tensors whose shape disagrees with the model that ``config.json``
builds, and tensors whose stored dtype cannot stand for the parameter (an integer or boolean
tensor for a floating parameter is a quantized or foreign checkpoint: a cast would load numbers,
but the wrong ones; a complex one would lose its imaginary part).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from autotp.errors import CheckpointError
from autotp.weights import Checkpoint, checkpoint_key, tied_groups

__all__ = ["ParameterSource", "check_checkpoint", "match_parameters"]

#: how many names each kind of problem lists before "... and N more"
_SHOWN = 5


@dataclass(frozen=True)
class ParameterSource:
    """Where one parameter (with its tied group) comes from in the checkpoint."""

    key: str
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    group: tuple[str, ...]


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "integer"


def convertible(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """A stored tensor can be loaded as ``wanted`` without changing what it means: floating to any
    floating dtype (float8 included), integer/bool to integer, complex to complex."""
    return _kind(stored) == _kind(wanted) or (_kind(stored) == "integer" and wanted == torch.bool)


def _listed(items: list[str]) -> str:
    more = f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return "; ".join(items[:_SHOWN]) + more


def match_parameters(module: torch.nn.Module, checkpoint: Checkpoint) -> dict[str, ParameterSource]:
    """``{parameter fqn: its source}`` for every parameter of ``module`` (built from the config, on
    meta or with stand-ins; tied parameters share one source), or one :class:`CheckpointError`
    naming every missing tensor, wrong shape and unconvertible dtype."""
    groups = {fqn: tuple(g) for g in tied_groups(module) for fqn in g}
    keys = list(checkpoint.keys())
    prefix = getattr(module, "base_model_prefix", "") or ""
    found: dict[str, ParameterSource] = {}
    missing: list[str] = []
    shapes: list[str] = []
    dtypes: list[str] = []
    by_id: dict[int, ParameterSource] = {}
    for fqn, param in module.named_parameters(remove_duplicate=False):
        if id(param) in by_id:
            found[fqn] = by_id[id(param)]
            continue
        group = groups.get(fqn, (fqn,))
        key = next((k for k in (checkpoint_key(f, keys, prefix) for f in group) if k), None)
        if key is None:
            missing.append(fqn)
            continue
        shape, stored = tuple(checkpoint.shape(key)), checkpoint.dtype(key)
        if shape != tuple(param.shape):
            shapes.append(f"{key} has shape {shape} but the model built from config.json expects "
                          f"{tuple(param.shape)} for {fqn}")
        elif not convertible(stored, param.dtype):
            dtypes.append(f"{key} is stored as {stored} but {fqn} is {param.dtype}")
        found[fqn] = by_id[id(param)] = ParameterSource(key, shape, stored, group)
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameters have no tensor in the checkpoint at {checkpoint.folder}: "
                        f"{missing[:_SHOWN]}{' ...' if len(missing) > _SHOWN else ''}")
    if shapes:
        problems.append(f"{len(shapes)} checkpoint tensor(s) disagree with the config: {_listed(shapes)}")
    if dtypes:
        problems.append(f"{len(dtypes)} checkpoint tensor(s) have a dtype that cannot be loaded as the "
                        f"parameter's (a quantized or foreign checkpoint?): {_listed(dtypes)}")
    if problems:
        raise CheckpointError(". ".join(problems) + ". Check that the checkpoint matches config.json "
                              "(the same model, unquantized).")
    return found


def check_checkpoint(folder: str | os.PathLike[str], module: torch.nn.Module) -> None:
    """:func:`match_parameters` for the weights in ``folder`` against ``module`` (built from the
    config, on meta), reading headers only; the files are closed again. For the callers that do not
    load the weights themselves: ``autotp generate``'s launching process and ``autotp plan``."""
    with Checkpoint(folder) as checkpoint:
        checkpoint.add_conversions_for(module)  # names transformers renames / converts on load
        match_parameters(module, checkpoint)
