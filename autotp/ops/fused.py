"""Fused projections: which fused layouts (``StridedShard``) a parameter may be stored in.

A fused projection (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``) computes several
logical outputs in one matmul and cuts them apart afterwards, by ``split`` / ``chunk`` or by slices
along the output dim. A plain column split of its weight gives rank 0 all of q and part of k, so the
cut would need the whole tensor. Stored *strided* — rank ``r`` holds chunk ``r`` of q, of k and of
v — the cut is local: each rank cuts its own chunks with sizes divided by N.

The solver cannot see that from the parameter alone (its frontier search runs forward), so the
candidate layouts are read off the graph beforehand: every split and every set of slices that tiles
a dim gives a *segmentation* (the piece sizes) for tensors whose dim has that size. A parameter dim
of that size may then also be stored as ``StridedShard(dim, segments)``; the rules check that the
fused layout reaches a split into exactly those segments (see ``autotp/ops/registry.py``:
``strided=``), and the cost model chooses. Nothing here looks at names.

Pieces no rank count divides are kept whole on every rank (``StridedShard.whole``): Falcon's
multi-query ``query_key_value`` is viewed as ``(B, S, H + 2, D)`` and cut by ``[..., :-2, :]`` (the q
heads), ``[..., [-2], :]`` and ``[..., [-1], :]`` (its one k and one v head, constant list indices
whose values decompose records). That tiles the heads dim as ``H + 1 + 1``: with ``H`` divisible by
N the q heads are split and the k and v heads held whole. A dim cut with dims after it also
offers the segmentation of that dim flattened with them (``(H+2, D)`` -> ``(H+2)*D``, the size of
the projection's output features), since the projection's weight only has the flat dim.

Pieces that are an attention's heads no tp divides (``autotp/ops/heads.py``) are split in whole
heads (``StridedShard.heads``): GPT-2 XL's ``c_attn`` cut by ``split(1600)`` into q | k | v of 25
heads each at tp=2 is ``S(1|1600:25h+1600:25h+1600:25h)``, rank 0 holding heads 0-12 of each and
rank 1 heads 13-24; Falcon-7B's 71 q heads beside its whole k and v head ``S(0|4544:71h+64r+64r)``.
Each rank's q, k and v then hold the same heads, and attention stays local. A dim that is a head's
width (4544 at tp 2, 4 and 8) is not split evenly, which would cut inside a head.

Pieces that are kv heads fewer than the ranks (``autotp/ops/kv_heads.py`` reads them off the graph)
are held per group of ranks (``StridedShard.groups``), each rank the kv head its query heads use,
as a separate k/v projection's ``GroupedShard``: Phi-3's ``qkv_proj`` with 32 query heads over 4 kv
heads of 96 at tp=8 is ``S(0|3072+384/4+384/4)``; one kv head is held whole.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.fx

from autotp.ops._common import aten_ops
from autotp.ops.heads import head_splits
from autotp.ops.kv_heads import kv_sites
from autotp.ops.registry import CONSTANT_VALUE
from autotp.placement import StridedShard, normalize_dim

_SPLITS = set(aten_ops("split.Tensor", "split_copy.Tensor", "split_with_sizes.default",
                       "split_with_sizes_copy.default"))
_SLICES = set(aten_ops("slice.Tensor", "slice_copy.Tensor"))

_INDEX = set(aten_ops("index.Tensor"))

#: dim size -> the fused layouts of a dim of that size: (segments, the segments held whole, each
#: segment's head count where they are split in whole heads, else (), each segment's kv groups
#: where some are kv heads held per group of ranks, else ()); ``StridedShard``'s fields
Segmentations = dict[int, set[tuple[tuple[int, ...], ...]]]


def _shape(node: object) -> tuple[int | None, ...] | None:
    """A tensor node's sizes, None for a symbolic one (a dynamic batch or sequence: the fused dims
    are static); None for a node that is no tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(s if isinstance(s, int) else None for s in val.shape)
    return None


def behind_brackets(node: torch.fx.Node) -> torch.fx.Node:
    """The value behind identity brackets (``autotp.edge`` / ``autotp.mark``, which decompose puts
    around every value a Dynamo node reads or makes), so slices taken by different Dynamo nodes of
    one tensor are grouped together."""
    while node.op == "call_function" and "autotp" in str(node.target) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def fused_segmentations(graph: torch.fx.Graph, world_size: int) -> Segmentations:
    """Dim size -> the segmentations (piece sizes, and which pieces no rank count divides, held
    whole) found in ``graph``: ``split`` calls, and slices and constant indices of one tensor along
    one dim that tile it exactly."""
    found: Segmentations = defaultdict(set)
    heads = {width: split.heads for width, split in head_splits(graph, world_size).items()}
    # kv heads fewer than the ranks (and dividing them): held per group of ranks, or whole for one
    heads.update({d * count: -count for _, count, d in kv_sites(graph) if count < world_size and world_size % count == 0})
    slices: dict[tuple[torch.fx.Node, int], set[tuple[int, int]]] = defaultdict(set)
    for n in graph.nodes:
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        shape = _shape(n.args[0])
        if shape is None:
            continue
        if n.target in _SPLITS:
            dim = normalize_dim(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0), len(shape))
            size, sizes = shape[dim], n.args[1]
            if size is None:
                continue
            pieces = tuple(min(sizes, size - k) for k in range(0, size, sizes)) if isinstance(sizes, int) \
                else tuple(sizes)
            _add(found, size, pieces, world_size, heads)
        elif n.target in _SLICES:
            dim = normalize_dim(n.args[1] if len(n.args) > 1 else 0, len(shape))
            size = shape[dim]
            start = n.args[2] if len(n.args) > 2 else None
            end = n.args[3] if len(n.args) > 3 else None
            step = n.args[4] if len(n.args) > 4 else 1
            if size is None or step != 1 or not all(isinstance(b, (int, type(None))) for b in (start, end)):
                continue
            start = 0 if start is None else (start + size if start < 0 else start)
            end = size if end is None else min(end + size if end < 0 else end, size)
            if 0 <= start < end:
                slices[(behind_brackets(n.args[0]), dim)].add((start, end))
        elif n.target in _INDEX:
            at = _constant_index(n, len(shape))
            if at is not None and shape[at[0]] is not None:  # x[..., [i], :]: one row of dim ``at``
                dim, index = at
                index = index + shape[dim] if index < 0 else index
                slices[(behind_brackets(n.args[0]), dim)].add((index, index + 1))
    for (node, dim), bounds in slices.items():
        shape = _shape(node)
        ordered = sorted(bounds)
        if shape is None or shape[dim] is None or ordered[0][0] != 0 or ordered[-1][1] != shape[dim]:
            continue
        if all(a[1] == b[0] for a, b in zip(ordered, ordered[1:], strict=False)):
            pieces = tuple(e - s for s, e in ordered)
            unit = math.prod(shape[dim + 1:]) if None not in shape[dim + 1:] else 1
            _add(found, shape[dim], pieces, world_size, heads, unit=unit, scale=1)
            if unit > 1:  # the same cut of the dim flattened with the ones after it (heads x head_dim)
                _add(found, shape[dim] * unit, pieces, world_size, heads, unit=unit, scale=unit)
    return dict(found)


def _constant_index(n: torch.fx.Node, ndim: int) -> tuple[int, int] | None:
    """(dim, index) of ``index(x, [None, .., idx])`` whose one index tensor is a constant of one
    value (``CONSTANT_VALUE``, recorded by decompose), else None."""
    indices = n.args[1] if len(n.args) > 1 else ()
    used = [(d, t) for d, t in enumerate(indices) if t is not None]
    if len(used) != 1 or not isinstance(used[0][1], torch.fx.Node):
        return None
    dim, t = used[0]
    value = t.meta.get(CONSTANT_VALUE)
    return (dim, value[0]) if value is not None and len(value) == 1 and dim < ndim else None


def _add(found: Segmentations, size: int, pieces: tuple[int, ...], world_size: int, heads: dict[int, int],
         unit: int = 1, scale: int = 1) -> None:
    """Record ``pieces`` of a dim of ``size`` (each index of them ``unit`` elements of the tensor cut,
    ``scale`` indices of the recorded dim). A piece whose elements are the width of an attention's
    heads that ``world_size`` does not divide (``heads``: width -> head count, from
    :func:`autotp.ops.heads.head_splits`) is split in whole heads; one divisible by ``world_size``
    is split evenly (in ``N`` blocks, as heads, when others are split in heads); the others are
    held whole. At least one must be split."""
    if len(pieces) < 2 or sum(pieces) * scale != size or not all(p > 0 for p in pieces):
        return
    counts = [heads.get(p * unit, 0) for p in pieces]  # > 0: query heads, < 0: kv heads fewer than N
    whole = tuple(i for i, (p, h) in enumerate(zip(pieces, counts, strict=True))
                  if h == -1 or not h and p % world_size)
    groups = tuple(-h if h < -1 else 0 for h in counts)
    if len(whole) == len(pieces) or len(whole) + sum(1 for g in groups if g) == len(pieces):
        return
    per_segment = tuple(0 if i in whole or groups[i] else h or world_size for i, h in enumerate(counts)) \
        if any(h > 0 for h in counts) else ()
    found[size].add((tuple(p * scale for p in pieces), whole, per_segment, groups if any(groups) else ()))


def strided_candidates(shape: tuple[int, ...], segmentations: Segmentations) -> list[StridedShard]:
    """The fused layouts a parameter of ``shape`` may be stored in (one per dim and segmentation)."""
    return [StridedShard(d, *layout) for d, size in enumerate(shape) for layout in sorted(segmentations.get(size, ()))]
