"""Selecting, slicing, gathering, joining and splitting: placement follows the dim.

* A Shard on a dim the op does not touch survives (its index shifts where dims appear or vanish).
* Selecting, slicing (other than the full range), indexing, padding or flipping *along* a sharded
  dim is infeasible: rank ``r`` would need rows it does not hold.
* ``cat``/``stack`` need every input in the same placement and reject concatenation along the
  sharded dim. ``split``/``unbind`` return one placement per piece.
* All of them only move data, so Partial stays Partial (padding only with zeros). Index tensors are
  integers and never Partial; an index tensor sharded along its own dims shards the result
  (``index_select``/``gather`` with a Replicate source).
* ``operator.getitem`` picks one element of a multi-output op's tuple placement.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch

from autotp.ops._common import P, R, aten_ops, is_float, out_len, out_spec, same, shift_after_removal
from autotp.ops.registry import OWN, Candidate, OpCall, TensorSpec, register, register_local, reject
from autotp.placement import Partial, Placement, Replicate, Shard, StridedShard, normalize_dim


@register(*aten_ops("select.int", "select_copy.int"))
def select_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """select(x, dim, index) drops ``dim``."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    dim = normalize_dim(op.arg(1, "dim"), op.tensor_inputs[0].ndim)
    if p.dim == dim:
        return reject(f"select along sharded dim {dim}")
    return same(Shard(shift_after_removal(p.dim, [dim])))


def _full_range(size: int, start: int | None, end: int | None, step: int = 1) -> bool:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    return step == 1 and start <= 0 and end >= size


SPLIT_SIZES, SLICE_BOUNDS = "split_sizes", "slice_bounds"


def segment_of(p: StridedShard, start: int | None, end: int | None) -> int | None:
    """The segment of fused shard ``p`` that the global slice ``[start, end)`` of its dim is
    exactly (negative and open bounds resolved as Python does), or None."""
    size = sum(p.segments)
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else min(end + size if end < 0 else end, size)
    bounds = p.bounds()
    return bounds.index((start, end)) if (start, end) in bounds else None


def local_segment_bounds(p: StridedShard, start: int | None, end: int | None, world_size: int, rank: int = 0
                         ) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` in its local shard of the segment the global slice
    ``[start, end)`` of ``p``'s dim takes: its chunk (or heads) of a split segment, or the whole one."""
    i = segment_of(p, start, end)
    if i is None:
        raise ValueError(f"slice [{start}, {end}) is not one segment of {p}")  # internal: the rule checked
    return p.local_bounds(world_size, rank)[i]


def local_segment_index(p: StridedShard, index: int, world_size: int, rank: int = 0) -> int:
    """Where the global index ``index`` (negative counts from the end) of a whole segment of ``p``
    lies in rank ``rank``'s local shard."""
    size = sum(p.segments)
    index = index + size if index < 0 else index
    i = next(k for k, (a, b) in enumerate(p.bounds()) if a <= index < b)
    return p.local_bounds(world_size, rank)[i][0] + index - p.bounds()[i][0]


def whole_segment_of(p: StridedShard, indices: Sequence[int]) -> int | None:
    """The whole segment of ``p`` (``StridedShard.whole``) that holds every one of ``indices``, or None."""
    size = sum(p.segments)
    at = {next((k for k, (a, b) in enumerate(p.bounds()) if a <= (i + size if i < 0 else i) < b), None)
          for i in indices}
    return at.pop() if len(at) == 1 and indices and at <= set(p.whole) else None


@register_local(SLICE_BOUNDS)
def slice_bounds_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                       out_placement: Any, rank: int, world_size: int) -> Any:
    """``slice(x, dim, start, end)`` of one segment of a fused shard: this rank's bounds of it
    (:func:`local_segment_bounds`); ``index(x, [.., idx, ..])`` into a whole segment: the indices
    moved to where that segment lies in the local shard."""
    x, p = args[0], in_placements[0]
    if target is torch.ops.aten.index.Tensor:
        indices = [None if t is None else torch.tensor([local_segment_index(p, int(i), world_size, rank)
                                                        for i in t.flatten().tolist()]).view(t.shape)
                   if d == p.dim else t for d, t in enumerate(args[1])]
        return target(x, indices)
    dim = normalize_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.ndim)
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    local_start, local_end = local_segment_bounds(p, start, end, world_size, rank)
    return target(x, dim, local_start, local_end, *args[4:])


@register(*aten_ops("slice.Tensor", "slice_copy.Tensor", "narrow.default", "narrow_copy.default"), strided=OWN)
def slice_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """slice/narrow along ``dim``: a Shard there survives only if the slice is the whole dim.

    A fused shard (``StridedShard``) sliced along its dim to exactly one segment gives a plain
    Shard with the local rewrite ``slice_bounds`` (Phi-3's ``qkv[..., :q_size]``), or ``R`` for a
    segment every rank holds whole (Falcon's ``qkv[..., :-2, :]`` is its sharded q heads)."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    x = op.tensor_inputs[0]
    dim = normalize_dim(op.arg(1, "dim", 0), x.ndim)
    if p.dim != dim:
        return same(p)
    if isinstance(p, StridedShard):
        start, end = op.arg(2, "start"), op.arg(3, "end")
        i = segment_of(p, start, end) if "narrow" not in str(op.target) and op.arg(4, "step", 1) == 1 else None
        if i is not None:
            return [Candidate(p.segment_placement(i, op.world_size), local=SLICE_BOUNDS)]
        return reject(f"slice [{start}, {end}) of fused dim {dim} is not one of its segments {p}")
    if "narrow" in str(op.target):
        # even a full-length narrow would ask each rank for the global length
        return reject(f"narrow along sharded dim {dim}")
    # a full-range slice is the identity; the local bounds clamp to the local size
    if _full_range(x.shape[dim], op.arg(2, "start"), op.arg(3, "end"), op.arg(4, "step", 1)):
        return same(p)
    return reject(f"slice along sharded dim {dim}")


@register(*aten_ops("index_select.default"))
def index_select_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """index_select(x, dim, index): x's Shard elsewhere survives; a sharded index shards ``dim``."""
    px, pi = inputs
    x = op.tensor_inputs[0]
    dim = normalize_dim(op.arg(1, "dim"), x.ndim)
    if isinstance(pi, Shard):
        if isinstance(px, Replicate):
            return same(Shard(dim))
        return reject("a sharded index needs a Replicate source")
    if isinstance(pi, Partial):
        return reject("an index cannot be Partial")
    if isinstance(px, Shard) and px.dim == dim:
        return reject(f"index_select along sharded dim {dim}")
    return same(px)


VOCAB_GATHER = "vocab_gather"


def vocab_gather(x_local: torch.Tensor, dim: int, index: torch.Tensor, start: int) -> torch.Tensor:
    """``gather(x, dim, index)`` on the chunk ``[start, start + x_local.shape[dim])`` of ``x`` along
    ``dim``: indices this rank holds read their value, the others give 0, so the ranks' results sum
    to the full gather (the vocab-parallel pick of target log-probabilities). Shapes: x_local
    (..., C/N, ...), index (..., k, ...) -> (..., k, ...)."""
    size = x_local.shape[dim]
    local = index - start
    owned = (local >= 0) & (local < size)
    picked = torch.gather(x_local, dim, local.clamp(0, max(size - 1, 0)))
    return picked.masked_fill(~owned, 0)


@register_local(VOCAB_GATHER)
def vocab_gather_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                       out_placement: Any, rank: int, world_size: int) -> torch.Tensor:
    """``aten.gather(x_local, dim, index)`` with ``x`` sharded (evenly) along ``dim``."""
    x, dim, index = args[0], args[1], args[2]
    dim = normalize_dim(dim, x.ndim)
    return vocab_gather(x, dim, index, rank * x.shape[dim])


@register(*aten_ops("gather.default"))
def gather_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """gather(x, dim, index): output has index's shape; out[..i..] = x[..index[..i..]..] on ``dim``.

    A source sharded along ``dim`` itself with a Replicate index gives Partial through the
    ``vocab_gather`` rewrite (each rank reads the indices it holds, zeros elsewhere)."""
    px, pi = inputs
    x, index = op.tensor_inputs
    dim = normalize_dim(op.arg(1, "dim"), x.ndim)
    if isinstance(pi, Partial):
        return reject("an index cannot be Partial")
    if isinstance(px, Partial):
        return same(P) if isinstance(pi, Replicate) else reject("Partial source needs a Replicate index")
    if isinstance(px, Replicate):
        # out[.., i, ..] reads x[.., index[.., i, ..], ..] at the same position on every other dim:
        # only a shard along ``dim`` itself leaves the rank's reads inside the (whole) source
        if isinstance(pi, Shard) and pi.dim != dim:
            return reject(f"index sharded on dim {pi.dim} needs the source sharded there too")
        return same(pi)
    if px.dim == dim:
        if isinstance(pi, Replicate) and is_float(x.dtype):
            return [Candidate(P, local=VOCAB_GATHER)]
        return reject(f"gather along sharded dim {dim} needs a Replicate index and a floating source")
    if pi == px and index.shape[px.dim] == x.shape[px.dim]:
        return same(px)
    return reject(f"gather with source {px} needs the index sharded the same way at full size")


@register(*aten_ops("index.Tensor"), strided=OWN)
def index_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """x[indices] (advanced indexing with a list of optional integer index tensors).

    A Shard of x on a non-indexed dim survives; the broadcast index dims replace the indexed dims
    in place when those are adjacent, else they go first. Index tensors must be Replicate.

    A fused shard indexed along its dim alone, by constant indices that all fall in one segment
    every rank holds whole (Falcon's ``qkv[..., [-2], :]``, its one k head), is ``R``: each rank
    reads that segment where it lies in its shard (local rewrite ``slice_bounds``). A fused shard
    indexed on other dims moves like a plain one and stays fused: transformers' ``batched_mm``
    experts (the decode path ``generate`` switches to off the CPU) read ``gate_up_proj[expert_ids]``,
    the experts' fused gate | up weights sharded on their feature dim.
    """
    px, pis = inputs[0], inputs[1:]
    if any(not isinstance(q, Replicate) for q in pis):
        return reject("index tensors must be Replicate")
    indices = list(op.arg(1, "indices"))
    if isinstance(px, StridedShard) and px.dim < len(indices) and indices[px.dim] is not None:
        at = indices[px.dim]
        if isinstance(at, TensorSpec) and at.value is not None \
                and all(t is None for d, t in enumerate(indices) if d != px.dim) \
                and whole_segment_of(px, at.value) is not None:
            return [Candidate(R, local=SLICE_BOUNDS)]
        return reject(f"indexing a fused shard {px} other than by constants into one whole segment")
    if not isinstance(px, Shard):
        return same(px)
    x = op.tensor_inputs[0]
    if any(isinstance(t, TensorSpec) and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return reject("boolean mask indexing of a sharded tensor")
    indexed = [i for i, t in enumerate(indices) if t is not None]
    if px.dim in indexed:
        return reject(f"indexing along sharded dim {px.dim}")
    b = max((t.ndim for t in indices if t is not None), default=0)
    if indexed == list(range(indexed[0], indexed[-1] + 1)):
        d = px.dim if px.dim < indexed[0] else px.dim - len(indexed) + b
    else:
        d = b + sum(1 for i in range(px.dim) if i not in indexed)
    spec = out_spec(op)
    if spec is not None and (d >= spec.ndim or spec.shape[d] != x.shape[px.dim]):
        return reject("could not locate the sharded dim in the indexing result")
    return same(dataclasses.replace(px, dim=d))


def _same_placement(inputs: Sequence[Placement | None]) -> Placement | None:
    first = inputs[0]
    return first if all(q == first for q in inputs) else None


@register(*aten_ops("cat.default"))
def cat_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """cat(tensors, dim): all inputs alike (legacy empty ``(0,)`` inputs aside); never along the shard dim."""
    # cat skips legacy empty 1-D inputs of shape (0,): DynamicCache prefill is cat([tensor([]), k], -2)
    kept = [(s, q) for s, q in zip(op.tensor_inputs, inputs, strict=True) if s.shape != (0,)]
    if not kept:
        return same(R)
    specs = [s for s, _ in kept]
    p = _same_placement([q for _, q in kept])
    if p is None:
        return reject(f"cat needs all inputs in the same placement, got {list(inputs)}")
    if not isinstance(p, Shard):
        return same(p)
    ndim = specs[0].ndim
    dim = normalize_dim(op.arg(1, "dim", 0), ndim)
    if p.dim == dim:
        return reject(f"cat along sharded dim {dim}")
    return same(p)


@register(*aten_ops("stack.default"))
def stack_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """stack(tensors, dim): all inputs alike; the new dim shifts shard dims at or after it."""
    p = _same_placement(inputs)
    if p is None:
        return reject(f"stack needs all inputs in the same placement, got {list(inputs)}")
    if not isinstance(p, Shard):
        return same(p)
    dim = normalize_dim(op.arg(1, "dim", 0), op.tensor_inputs[0].ndim + 1)
    return same(Shard(p.dim + 1 if dim <= p.dim else p.dim))


@register_local(SPLIT_SIZES)
def split_sizes_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                      out_placement: Any, rank: int, world_size: int) -> Any:
    """split / split_with_sizes of a fused shard into its segments: each size this rank's piece."""
    return target(args[0], local_split_sizes(args[1], in_placements[0], rank, world_size), *args[2:], **kwargs)


def local_split_sizes(sizes: int | Sequence[int], p: StridedShard, rank: int, world_size: int) -> int | list[int]:
    """The split sizes of fused shard ``p``'s segments on rank ``rank``: one int where every local
    segment has the same length (as ``split(H)`` was written), else the list of them."""
    local = p.local_segments(world_size, rank)
    return local[0] if isinstance(sizes, int) and len(set(local)) == 1 else local


def split_pieces(op: OpCall, size: int) -> tuple[int, ...]:
    """The piece sizes of a split / split_with_sizes of a dim of ``size``."""
    sizes = op.arg(1, "split_size", op.kwargs.get("split_sizes"))
    if isinstance(sizes, int):
        return tuple(min(sizes, size - k) for k in range(0, size, sizes)) if sizes > 0 else ()
    return tuple(sizes)


@register(*aten_ops("split.Tensor", "split_copy.Tensor", "split_with_sizes.default",
                    "split_with_sizes_copy.default", "unbind.int", "unbind_copy.int"), strided=OWN)
def split_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """split/unbind along ``dim``: every piece keeps a Shard on another dim (unbind drops ``dim``).

    A fused shard (``StridedShard``) split along its dim into exactly its segments gives plain
    Shards with the local rewrite ``split_sizes`` (GPT-2's ``c_attn(x).split(H, dim=2)``)."""
    p = inputs[0]
    n = out_len(op)
    if not isinstance(p, Shard):
        return same(tuple(p for _ in range(n)))
    x = op.tensor_inputs[0]
    unbind = "unbind" in str(op.target)
    dim = normalize_dim(op.arg(1 if unbind else 2, "dim", 0), x.ndim)
    if isinstance(p, StridedShard):
        if p.dim != dim:
            d = shift_after_removal(p.dim, [dim]) if unbind else p.dim
            return same(tuple(dataclasses.replace(p, dim=d) for _ in range(n)))
        if p.whole:  # the split's local sizes would be the segments' local lengths (not done yet)
            return reject(f"split of a fused dim with segments held whole {p}")
        if not unbind and split_pieces(op, x.shape[dim]) == p.segments:
            # each piece its segment's placement: Shard, or its whole heads (GPT-2 XL's 25 per rank count)
            return [Candidate(tuple(p.segment_placement(i, op.world_size) for i in range(n)), local=SPLIT_SIZES)]
        return reject(f"split of fused dim {dim} into pieces other than its segments {p.segments}")
    if p.dim == dim:
        if not unbind and n == 1:
            return same((p,))  # a single piece is the whole tensor
        return reject(f"split along sharded dim {dim}")
    d = shift_after_removal(p.dim, [dim]) if unbind else p.dim
    return same(tuple(Shard(d) for _ in range(n)))


@register(*aten_ops("constant_pad_nd.default"))
def pad_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """constant_pad_nd(x, pad, value): pad pairs apply to the last dims; zero padding is linear."""
    p = inputs[0]
    if isinstance(p, Partial):
        return same(P) if op.arg(2, "value", 0) == 0 else reject("padding a Partial with a non-zero value")
    if isinstance(p, Replicate):
        return same(R)
    x = op.tensor_inputs[0]
    pad = list(op.arg(1, "pad"))
    i = x.ndim - 1 - p.dim  # pad[2i], pad[2i+1] apply to dim ndim-1-i
    if 2 * i < len(pad) and (pad[2 * i] != 0 or pad[2 * i + 1] != 0):
        return reject(f"padding along sharded dim {p.dim}")
    return same(p)


@register(*aten_ops("repeat.default"), strided=OWN)
def repeat_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """repeat(x, repeats): a Shard survives where its repeat count is 1 (new dims are leading);
    repeated ``k > 1`` times along its dim it becomes strided, each copy one segment (rank ``r``
    holds chunk ``r`` of every copy): BLOOM's ``alibi.repeat(B, 1, 1)`` of per-head slopes
    ``(H, 1, S)`` S(0) is ``(B*H, 1, S)`` S(0|H+...+H), the layout of ``(B, H)`` merged. The local
    op repeats its own chunk with the same counts."""
    p = inputs[0]
    if not isinstance(p, Shard):
        return same(p)
    x, spec = op.tensor_inputs[0], out_spec(op)
    if spec is None:
        return reject("repeat without a known output shape")
    d = p.dim + spec.ndim - x.ndim
    size = x.shape[p.dim]
    k = spec.shape[d] // size if size else 0  # the count may be symbolic (a dynamic batch)
    if k < 1:
        return reject(f"repeat {k} times along sharded dim {p.dim} leaves nothing to shard")
    if isinstance(p, StridedShard):
        if not p.even:
            return reject(f"repeat of a fused dim with segments held whole or split in heads {p}")
        return same(StridedShard(d, p.segments * k))
    return same(Shard(d) if k == 1 else StridedShard(d, (size,) * k))


@register(*aten_ops("tril.default", "triu.default"))
def triangle_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """tril/triu mask the last two dims: a Shard there is infeasible, on batch dims it survives."""
    p = inputs[0]
    if isinstance(p, Shard) and p.dim >= op.tensor_inputs[0].ndim - 2:
        return reject(f"triangular mask over sharded dim {p.dim}")
    return same(p)


@register(*aten_ops("flip.default"))
def flip_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """flip(x, dims): a Shard on a flipped dim would put chunks in the wrong rank order."""
    p = inputs[0]
    ndim = op.tensor_inputs[0].ndim
    if isinstance(p, Shard) and p.dim in {normalize_dim(d, ndim) for d in op.arg(1, "dims")}:
        return reject(f"flip along sharded dim {p.dim}")
    return same(p)


@register(operator.getitem, single_placements=False)
def getitem_rule(op: OpCall, inputs: Sequence[Placement | tuple | None]) -> list[Candidate]:
    """``result[i]`` of a multi-output op: the i-th element of the tuple placement.

    Accepts the tuple either as one input (``inputs == [(p0, p1, ...)]``) or flattened, one
    placement per tensor element of ``args[0]`` (non-tensor elements then read as None).
    """
    index = op.arg(1, "index")
    if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
        elements = list(inputs[0])
    else:
        items = op.args[0] if isinstance(op.args[0], (tuple, list)) else [op.args[0]]
        flat = iter(inputs)
        elements = [next(flat, None) if isinstance(t, TensorSpec) else None for t in items]
    if not isinstance(index, int) or not -len(elements) <= index < len(elements):
        return reject(f"getitem index {index!r} out of range for {len(elements)} results")
    element = elements[index]
    if not isinstance(element, (Replicate, Shard, Partial)):
        return reject(f"result {index} has no placement")
    return same(element)


@register(*aten_ops("slice_scatter.default", "select_scatter.default"))
def scatter_slice_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """slice_scatter / select_scatter(self, src, dim, ...): write src into a slice of self.

    Both must be placed alike (src's shard dim shifts for select_scatter, which drops ``dim``); a
    Shard along ``dim`` survives only for a full-range slice (the result is then src). Writing a
    Partial into a Partial is linear.
    """
    ps, pv = inputs
    x = op.tensor_inputs[0]
    dim = normalize_dim(op.arg(2, "dim", 0), x.ndim)
    select = "select" in str(op.target)
    if isinstance(ps, (Partial, Replicate)) or isinstance(pv, (Partial, Replicate)):
        if ps == pv:
            return same(ps)
        return reject(f"self {ps} and src {pv} must be placed alike")
    if ps.dim == dim:
        full = not select and _full_range(x.shape[dim], op.arg(3, "start"), op.arg(4, "end"),
                                          op.arg(5, "step", 1))
        if full and pv == ps:
            return same(ps)
        return reject(f"scatter along sharded dim {dim}")
    need = Shard(shift_after_removal(ps.dim, [dim])) if select else ps
    if pv != need:
        return reject(f"src is {pv}, needs {need} to match self {ps}")
    return same(ps)
