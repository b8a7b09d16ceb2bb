"""Reshapes and dim shuffles: view/reshape/_unsafe_view, expand, permute/transpose, (un)squeeze.

Partial and Replicate pass through all of them unchanged (they only move data). A Shard follows
its dim. For reshapes, a sharded input dim ``d`` survives as output dim ``o`` exactly when

    prod(in_shape[d:]) == prod(out_shape[o:])   and   out_shape[o] % N == 0

i.e. ``d`` is the outermost factor of ``o`` (merging ``(kv, rep) -> kv*rep`` with ``kv`` sharded, or
splitting ``H -> (heads, D)`` with ``H`` sharded and ``heads % N == 0``): then each rank's
contiguous block of the flattened group is the same block on both sides.

A sharded dim merged *behind* other dims (eager attention's ``(B, heads, S, D) -> (B*heads, S,
D)`` with heads sharded) is not a plain Shard of the merged dim: rank ``r`` holds chunk ``r`` of
each batch's heads, which is ``StridedShard(o, (heads,) * B)`` — the layout of fused q|k|v, with
equal segments. In general the merged dim holds ``count`` segments of ``seg`` indices each:

    prod(out_shape[o:]) == count * prod(in_shape[d:])   and   prod(in_shape[d:]) == seg * prod(out_shape[o+1:])

with ``count >= 2`` and ``seg % N == 0``. The reverse split of such a dim (``(B*heads, S, S) ->
(B, heads, S, S)``) gives back a plain Shard on the dim whose group is one segment:
``prod(out_shape[o:]) == seg * prod(in_shape[d+1:])`` and ``out_shape[o] % N == 0``. Every
segment is the same size, so the layout means the same at every batch size: a symbolic batch
only changes how many segments there are, and the local sizes stay ``global / N``.

The reshape's constant sizes are global, so the local op must divide the size at the output shard
dim by N (a strided dim too: it holds ``seg / N`` of each segment): such candidates carry
``local="shape"``, implemented by :func:`localize_sizes` (the runtime rewrite imports it too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from autotp.ops._common import P, R, aten_ops, out_spec, same, shift_after_removal
from autotp.ops.registry import (
    OWN,
    POINTWISE,
    Candidate,
    OpCall,
    over_groups,
    over_heads,
    register,
    register_local,
    reject,
)
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    chunks,
    head_split,
    local_size,
    normalize_dim,
    spread_size,
)


def localize_sizes(sizes: Sequence[Any], out_placement: Any, world_size: int, rank: int = 0) -> list[Any]:
    """The per-rank size list of a view/reshape/expand whose output has ``out_placement``.

    The size at the output's shard dim becomes rank ``rank``'s chunk of it
    (:func:`autotp.placement.local_size`: ``size / N``, or a short last chunk of a dim split
    unevenly), for a fused shard with whole segments its local length, for a grouped shard the
    size divided by its groups (raising ``ValueError`` when it does not divide) and its spread dim
    by :func:`autotp.placement.spread_size`, for a head shard the rank's heads
    (:meth:`autotp.placement.HeadShard.index_range`); a ``-1`` (inferred) stays ``-1``; other
    placements leave the sizes unchanged. ``(2, 6, 8, 8)`` with ``S(2)`` over 2 ranks becomes
    ``(2, 6, 4, 8)``.
    """
    sizes = list(sizes)
    if isinstance(out_placement, GroupedShard):
        d, parts = out_placement.dim, chunks(out_placement, world_size)
        size = sizes[d]
        if not (isinstance(size, int) and size == -1):
            if isinstance(size, int) and size % parts != 0:
                raise ValueError(f"size {size} at dim {d} does not divide by {parts} chunks")
            sizes[d] = size // parts
        if out_placement.inner is not None:  # a static spread of kv heads
            sizes[out_placement.inner] = spread_size(sizes[out_placement.inner], out_placement, world_size, rank)
    elif isinstance(out_placement, HeadShard):
        d = out_placement.dim
        if not (isinstance(sizes[d], int) and sizes[d] == -1):
            start, stop = out_placement.index_range(sizes[d], rank, world_size)
            sizes[d] = stop - start
    elif isinstance(out_placement, StridedShard) and not out_placement.even:
        if not (isinstance(sizes[out_placement.dim], int) and sizes[out_placement.dim] == -1):  # static: q_r | k | v
            sizes[out_placement.dim] = out_placement.local_length_of(sizes[out_placement.dim], world_size, rank)
    elif isinstance(out_placement, Shard):
        d = out_placement.dim
        size = sizes[d]
        if not (isinstance(size, int) and size == -1):
            sizes[d] = local_size(size, rank, world_size) if isinstance(size, int) else size // world_size
    return sizes


# Where the size list sits in each op that can carry local="shape": (position, keyword).
SIZE_ARG: dict[Any, tuple[int, str]] = {}


@register_local("shape")
def shape_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                out_placement: Any, rank: int, world_size: int) -> Any:
    """Run ``target`` with its size argument localized by :func:`localize_sizes`."""
    index, name = SIZE_ARG[target]
    args = list(args)
    kwargs = dict(kwargs)
    if index < len(args):
        args[index] = localize_sizes(args[index], out_placement, world_size, rank)
    else:
        kwargs[name] = localize_sizes(kwargs[name], out_placement, world_size, rank)
    return target(*args, **kwargs)


def _resolved_out_shape(op: OpCall, in_numel: int, sizes: Sequence[int]) -> tuple[int, ...]:
    spec = out_spec(op)
    if spec is not None:
        return spec.shape
    sizes = list(sizes)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = in_numel // known if known else 0
    return tuple(sizes)


VIEW_OPS = aten_ops("view.default", "view_copy.default", "_unsafe_view.default", "reshape.default")
for _t in VIEW_OPS:
    SIZE_ARG[_t] = (1, "shape" if "reshape" in str(_t) else "size")


@register(*VIEW_OPS, strided=OWN, grouped=OWN)
def view_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """A reshape keeps R and P; a Shard survives if its dim is the outermost factor of an out dim,
    and becomes strided if it is merged behind other dims (see the module docstring). A grouped
    shard is reasoned about over its groups; one spread over its inner dim merges into a Shard."""
    p = inputs[0]
    if isinstance(p, HeadShard):
        return over_heads(view_rule, op, inputs)
    if isinstance(p, GroupedShard):
        if p.inner is None:
            return over_groups(view_rule, op, inputs)
        x = op.tensor_inputs[0]
        out = _resolved_out_shape(op, x.numel, op.arg(1, "size", op.kwargs.get("shape")))
        merged = x.shape[p.dim] * x.shape[p.inner]
        for o in range(len(out)):
            split = head_split(o, merged, p.groups, op.world_size)
            if out[o] == merged and math.prod(out[o:]) == math.prod(x.shape[p.dim:]) and split is not None:
                # (B, KV, H/KV, S, D) S(1/KV:2) -> (B, H, S, D) S(1): each rank its query heads' kv copies
                # (S(1:Hh/KV) where the group's ranks do not divide its query heads: 7 over 2 are 4 + 3)
                return [Candidate(split, local="shape")]
        return reject(f"a view of {x.shape} does not merge the spread kv heads {p} into one dim: {out}")
    if isinstance(p, (Replicate, Partial)):
        return same(p)
    x = op.tensor_inputs[0]
    out = _resolved_out_shape(op, x.numel, op.arg(1, "size", op.kwargs.get("shape")))
    n = op.world_size
    suffix = math.prod(x.shape[p.dim:])  # elements per index of the dims before d
    if isinstance(p, StridedShard):
        # a fused dim survives whole: (B*S, 192) S(1|64+64+64) -> (B, S, 192) S(2|64+64+64)
        for o in range(len(out)):
            if out[o] == x.shape[p.dim] and math.prod(out[o:]) == suffix:
                return [Candidate(dataclasses.replace(p, dim=o), local="shape")]
        heads = _split_into_heads(p, x.shape, out, n)
        if heads is not None:
            return [Candidate(heads, local="shape")]
        # equal segments split apart: (B*H, S, S) S(0|H+H) -> (B, H, S, S) S(1); split in whole heads
        # no tp divides, S(0|25:25h+25:25h) -> S(1:25h)
        if p.segment_size is not None:
            segment = p.segment_size * math.prod(x.shape[p.dim + 1:])
            for o in range(len(out)):
                split = head_split(o, p.heads[0], 1, n) if p.heads and out[o] % p.heads[0] == 0 \
                    else Shard(o) if not p.heads and out[o] >= n and out[o] % n == 0 else None
                if math.prod(out[o:]) == segment and split is not None \
                        and _static_segment(op, x.shape[p.dim + 1:], out, o):
                    return [Candidate(split, local="shape")]
        return reject(f"a view splits or merges the fused dim {p.dim} of {x.shape} (segments {p.segments}) "
                      f"other than into whole segments: {out}")
    for o in range(len(out)):
        if math.prod(out[o:]) == suffix and out[o] >= n and out[o] % n == 0:
            # e.g. (B, S, H) S(2) -> (B, S, heads, D) S(2): local sizes (B, S, heads/N, D)
            return [Candidate(Shard(o), local="shape")]
        if math.prod(out[o:]) == suffix and out[o] == x.shape[p.dim]:
            # the sharded dim carried whole, though N may not divide it (vocabulary logits
            # (B, S, V) S(2) -> (B*S, V) S(1)): each rank's chunk is the same rows on both sides
            return [Candidate(Shard(o), local="shape")]
    merged = _merged_behind(x.shape[p.dim:], out, n)
    if merged is not None and _static_segment(op, x.shape[p.dim + 1:], out, merged.dim):
        # e.g. (B, H, S, D) S(1) -> (B*H, S, D) S(0|H+H): local sizes (B*H/N, S, D)
        return [Candidate(merged, local="shape")]
    return reject(f"sharded dim {p.dim} of {x.shape} is neither the outermost factor of a divisible "
                  f"dim of {out} nor merged whole behind other dims")


def _split_into_heads(p: StridedShard, shape: Sequence[int], out: Sequence[int], world_size: int
                      ) -> StridedShard | None:
    """The fused dim cut into ``(F / k, k)`` (heads of ``k``), every segment whole heads and every
    rank's chunk of a split segment whole heads: Falcon's ``(B, S, (H+2)*D) S(2|H*D+Dr+Dr) -> (B, S,
    H+2, D) S(2|H+1r+1r)``; segments split in heads (``StridedShard.heads``) keep their head counts,
    each head a whole number of ``k``: ``S(2|4544:71h+64r+64r) -> S(2|71:71h+1r+1r)``. None if the
    view does not cut it so."""
    fused = shape[p.dim]
    for o in range(len(out)):
        if math.prod(out[o:]) != math.prod(shape[p.dim:]) or out[o] < 1 or fused % out[o] or out[o] == fused:
            continue
        unit = fused // out[o]  # indices of the fused dim per index of out dim o
        if all(s % unit == 0 and (i in p.whole or p.groups and p.groups[i] and (s // p.groups[i]) % unit == 0
                                  or (s // p.heads[i] if p.heads else s // world_size) % unit == 0
                                  and (p.heads or s % world_size == 0)) for i, s in enumerate(p.segments)):
            return dataclasses.replace(p, dim=o, segments=tuple(s // unit for s in p.segments))
    return None


def _static_segment(op: OpCall, inner: Sequence[int], out: Sequence[int], o: int) -> bool:
    """Whether the segment a strided dim ``o`` of the view's output is cut into (or split from)
    has a static size. In a graph of static sizes it has. Where the output has a symbolic dim (a
    dynamic batch), only the plain ``(B, heads, S, D) <-> (B*heads, S, D)`` regrouping is allowed:
    the dims after ``o`` are the input's dims after the sharded one (up to dims of size 1, which
    are never symbolic: BLOOM's ``(B, H, S) -> (B*H, 1, S)``), so a segment is the sharded dim
    itself (static, as every plain shard is) and only the number of segments varies."""
    spec = out_spec(op)
    if spec is None or not spec.symbolic:
        return True
    return [s for s in out[o + 1:] if s != 1] == [s for s in inner if s != 1]


def _merged_behind(tail: Sequence[int], out: Sequence[int], world_size: int) -> StridedShard | None:
    """The strided placement of an output dim that holds the sharded input dim ``tail[0]`` whole
    behind ``count >= 2`` indices of outer dims, ``tail`` being the input's sizes from the sharded
    dim on: ``(H, S, D)`` into ``(B*H, S, D)`` is ``S(0|H+H)`` for ``B = 2``. None if no out dim
    holds it so: the dims after ``o`` must tile the tail, and each rank's chunk of a segment
    (``prod(tail) / N`` elements) must be whole indices of ``o``."""
    block = math.prod(tail)
    if block == 0:
        return None
    for o in range(len(out)):
        total, below = math.prod(out[o:]), math.prod(out[o + 1:])
        if below == 0 or total % block or total // block < 2 or block % below:
            continue
        seg = block // below  # indices of dim o per segment; a rank's chunk of it is whole indices
        if seg % world_size == 0:
            return StridedShard(o, (seg,) * (total // block))
    return None


EXPAND_OPS = aten_ops("expand.default", "expand_copy.default")
for _t in EXPAND_OPS:
    SIZE_ARG[_t] = (1, "size")


@register(*EXPAND_OPS, strided=POINTWISE, grouped=OWN)
def expand_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Shard follows its dim (shifted by new leading dims); R may also shard a broadcast dim. A
    grouped shard follows its dim over the groups; holding one index per group (one kv head), it
    may also spread over a broadcast dim right after it (``(B, KV, 1, S, D) -> (B, KV, H/KV, S, D)``:
    ``S(1/KV:2)``, each rank its query heads' copies)."""
    p = inputs[0]
    if isinstance(p, HeadShard):
        return over_heads(expand_rule, op, inputs)
    if isinstance(p, GroupedShard):
        if p.inner is not None:
            return reject(f"{p} is expanded again")
        cands = over_groups(expand_rule, op, inputs)
        x, spec = op.tensor_inputs[0], out_spec(op)
        if spec is None:
            return cands
        off = spec.ndim - x.ndim
        d, n = p.dim + off, op.world_size
        inner = d + 1
        if x.shape[p.dim] == p.groups and inner < spec.ndim and x.shape[p.dim + 1] == 1 \
                and head_split(inner, p.groups * spec.shape[inner], p.groups, n) is not None:
            cands = [*cands, Candidate(GroupedShard(d, p.groups, inner), local="shape")]
        return cands
    x = op.tensor_inputs[0]
    spec = out_spec(op)
    sizes = list(op.arg(1, "size"))
    out = spec.shape if spec is not None else tuple(
        x.shape[i - (len(sizes) - x.ndim)] if s == -1 else s for i, s in enumerate(sizes))
    off = len(out) - x.ndim
    if isinstance(p, Partial):
        return [Candidate(P)]
    if isinstance(p, Shard):
        # (..., d, ...) S(d) -> (new..., ..., d, ...) S(d + off); the size at that dim is global
        return [Candidate(Shard(p.dim + off), local="shape")]
    n = op.world_size
    cands = [Candidate(R)]
    for k, size in enumerate(out):
        broadcast = k < off or x.shape[k - off] == 1
        if broadcast and size >= n and size % n == 0:
            # each rank expands its size-1 dim straight to its own chunk: (.., 1, ..) -> (.., out[k]/N, ..)
            cands.append(Candidate(Shard(k), local="shape"))
        elif broadcast and k == 1 and len(out) == 4 and size % n and head_split(k, size, 1, n) is not None:
            # the heads dim of attention's (B, H, S, D), whole heads no tp divides: one kv head broadcast
            # over Falcon-7B's 71 query heads, each rank its own heads' copies ((B, 1, S, D) -> (B, 36, S, D))
            cands.append(Candidate(HeadShard(k, size), local="shape"))
    return cands


@register(*aten_ops("permute.default", "permute_copy.default"), strided=POINTWISE)
def permute_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Shard(d) -> Shard(position of d in dims)."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    ndim = op.tensor_inputs[0].ndim
    dims = [normalize_dim(d, ndim) for d in op.arg(1, "dims")]
    return same(Shard(dims.index(p.dim)))


@register(*aten_ops("transpose.int", "transpose_copy.int", "t.default", "t_copy.default"),
          strided=POINTWISE)
def transpose_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Swap two dims (``t`` swaps 0 and 1 of a 2-D tensor and is a no-op below 2-D)."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    ndim = op.tensor_inputs[0].ndim
    if "transpose" in str(op.target):
        a, b = normalize_dim(op.arg(1, "dim0"), ndim), normalize_dim(op.arg(2, "dim1"), ndim)
    else:
        a, b = (0, 1) if ndim == 2 else (0, 0)
    d = b if p.dim == a else a if p.dim == b else p.dim
    return same(Shard(d))


@register(*aten_ops("unsqueeze.default", "unsqueeze_copy.default"), strided=POINTWISE)
def unsqueeze_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """A new size-1 dim at ``dim`` shifts shard dims at or after it by one."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    dim = normalize_dim(op.arg(1, "dim"), op.tensor_inputs[0].ndim + 1)
    return same(Shard(p.dim + 1 if dim <= p.dim else p.dim))


@register(*aten_ops("squeeze.default", "squeeze.dim", "squeeze.dims", "squeeze_copy.default",
                    "squeeze_copy.dim", "squeeze_copy.dims"), strided=POINTWISE)
def squeeze_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Size-1 dims disappear (dims listed but not of size 1 stay); a shard dim shifts left."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    x = op.tensor_inputs[0]
    dims = op.arg(1, "dim")
    if dims is None:
        candidates = range(x.ndim)
    elif isinstance(dims, int):
        candidates = [normalize_dim(dims, x.ndim)]
    else:
        candidates = [normalize_dim(d, x.ndim) for d in dims]
    removed = {d for d in candidates if x.shape[d] == 1}
    return same(Shard(shift_after_removal(p.dim, removed)))
