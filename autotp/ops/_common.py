"""Helpers shared by the rule modules: overload lookup, argument access, dtype and dim bookkeeping.

Nothing here registers a rule. Every helper is pure: it reads an :class:`OpCall` and placements and
returns values; none of them touches a graph or a process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autotp.ops.registry import Candidate, OpCall, Rejected, TensorSpec, reject
from autotp.placement import Partial, Placement, Replicate, Shard, normalize_dim

R = Replicate()
P = Partial()


def aten_ops(*names: str) -> list[Any]:
    """Resolve ``"view_copy.default"``-style names to ``torch.ops.aten`` overloads.

    Names whose op or overload this torch build lacks are skipped, so a rule module imports cleanly
    on an older or newer torch; the coverage test catches anything that matters.
    """
    out = []
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None:
            continue
        op = getattr(packet, overload or "default", None)
        if op is not None:
            out.append(op)
    return out


def is_float(dtype: torch.dtype) -> bool:
    """Floating or complex: the only dtypes that may be Partial (integers and bools never are)."""
    return dtype.is_floating_point or dtype.is_complex


def out_spec(op: OpCall, index: int | None = None) -> TensorSpec | None:
    """The op's (single) output spec, or element ``index`` of a tuple/list output."""
    out = op.out
    if index is not None:
        if isinstance(out, (tuple, list)) and index < len(out):
            out = out[index]
        elif index != 0:
            return None
    return out if isinstance(out, TensorSpec) else None


def out_is_float(op: OpCall, index: int | None = None) -> bool:
    spec = out_spec(op, index)
    return spec is not None and is_float(spec.dtype)


def out_len(op: OpCall) -> int:
    """Number of results of a multi-output op (1 for a single tensor)."""
    return len(op.out) if isinstance(op.out, (tuple, list)) else 1


def tensor_index(op: OpCall, index: int, name: str) -> int | None:
    """Position in ``op.tensor_inputs`` of the tensor passed as argument ``index``/``name``.

    Counts the tensors that pytree flattening puts before it (the same order ``tensor_inputs`` and
    the rule's ``inputs`` use). Returns None when that argument is absent or not a tensor.
    """
    if index < len(op.args):
        if not isinstance(op.args[index], TensorSpec):
            return None
        before, _ = pytree.tree_flatten(op.args[:index])
        return sum(isinstance(a, TensorSpec) for a in before)
    if name not in op.kwargs or not isinstance(op.kwargs[name], TensorSpec):
        return None
    count = sum(isinstance(a, TensorSpec) for a in pytree.tree_flatten(op.args)[0])
    for key, value in op.kwargs.items():
        if key == name:
            return count
        count += sum(isinstance(a, TensorSpec) for a in pytree.tree_flatten(value)[0])
    return None


def norm_dims(dims: int | Iterable[int] | None, ndim: int) -> list[int]:
    """Normalize a reduction ``dim`` argument; ``None`` or ``[]`` mean every dim."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        return list(range(ndim))
    return sorted({normalize_dim(d, ndim) for d in dims})


def same(p: Placement | None) -> list[Candidate]:
    """One candidate: the given placement."""
    return [Candidate(p)]


def broadcast_shard(out_shape: Sequence[int], specs: Sequence[TensorSpec],
                    inputs: Sequence[Placement]) -> Rejected | Placement:
    """Output placement of a broadcasting op whose inputs are only Replicate or Shard.

    Dims align from the right. Every Shard input must shard the same output dim ``k``; an input
    that has dim ``k`` at full size must be sharded on it too, one with size 1 there (or without
    that dim) stays Replicate. Returns ``Shard(k)``, ``Replicate()`` or a rejection.
    """
    out_nd = len(out_shape)
    k: int | None = None
    for i, (spec, p) in enumerate(zip(specs, inputs, strict=True)):
        if isinstance(p, Shard):
            kk = p.dim + out_nd - spec.ndim
            if spec.shape[p.dim] != out_shape[kk]:
                return reject(f"input {i} is sharded on a broadcast dim {p.dim}")
            if k is not None and kk != k:
                return reject(f"inputs are sharded on different output dims {k} and {kk}")
            k = kk
    if k is None:
        return R
    for i, (spec, p) in enumerate(zip(specs, inputs, strict=True)):
        if isinstance(p, Replicate):
            d = k - (out_nd - spec.ndim)
            if d >= 0 and spec.shape[d] != 1:
                return reject(f"input {i} is Replicate at full size on dim {d} while another input is "
                              f"sharded there (narrow it to S({d}) first)")
    return Shard(k)


def shift_after_removal(d: int, removed: Iterable[int]) -> int:
    """Index of dim ``d`` once the dims in ``removed`` (not containing ``d``) are dropped."""
    return d - sum(1 for r in removed if r < d)


def is_zero(value: Any) -> bool:
    """True for a Python scalar equal to zero (a Partial plus zero stays Partial)."""
    return isinstance(value, (int, float, bool, complex)) and value == 0
