"""Normalizations: softmax / log_softmax and native_layer_norm.

All are nonlinear, so a Partial input is infeasible. A Shard survives on any dim the op does not
normalize over. A Shard on the normalized dim of a layer norm is infeasible (the local statistics
would be the shard's, not the row's). A softmax over its sharded dim is offered with the local
rewrite ``sharded_softmax``: each rank reduces its chunk to a row maximum and a row sum of
exponentials, and two all-reduces (max, then sum; one value per row) make them the whole row's, so
the output keeps the input's Shard. This is the softmax of vocab-parallel cross-entropy: the
logits never leave their vocabulary shards, and only ``rows`` values per rank cross the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autotp.ops._common import R, aten_ops, is_float, out_spec
from autotp.ops.registry import OWN, Candidate, OpCall, register, register_local, reject
from autotp.placement import Partial, Placement, Replicate, Shard, StridedShard, normalize_dim

SHARDED_SOFTMAX = "sharded_softmax"
LOG_SOFTMAX_TARGETS = frozenset(aten_ops("_log_softmax.default", "log_softmax.int"))


def softmax_from_stats(x: torch.Tensor, dim: int, row_max: torch.Tensor, row_sum: torch.Tensor,
                       log: bool) -> torch.Tensor:
    """(Log-)softmax of a chunk of each row along ``dim``, given the whole rows' maximum and sum of
    ``exp(x - row_max)`` (both keepdim). Shapes: x (..., C/N, ...) -> same."""
    shifted = x - row_max
    if log:
        return shifted - row_sum.log()
    return shifted.exp() / row_sum


@register_local(SHARDED_SOFTMAX, across_ranks=True)
def sharded_softmax_local(target: Any, rank_args: list[tuple], rank_kwargs: list[dict],
                          in_placements: Sequence[Any], out_placement: Any, world_size: int) -> list[torch.Tensor]:
    """All ranks in lockstep: the row max and sum-exp are reduced over the ranks' chunks (what the
    runtime's two all-reduces do), then each rank normalizes its own chunk."""
    chunks = [args[0] for args in rank_args]
    dim = normalize_dim(rank_args[0][1], chunks[0].ndim)
    third = rank_args[0][2] if len(rank_args[0]) > 2 else None  # _softmax: half_to_float; softmax.int: dtype
    dtype = third if isinstance(third, torch.dtype) else torch.float32 if third is True else chunks[0].dtype
    chunks = [c.to(dtype) for c in chunks]
    row_max = torch.stack([c.amax(dim, keepdim=True) for c in chunks]).amax(0)
    row_sum = torch.stack([(c - row_max).exp().sum(dim, keepdim=True) for c in chunks]).sum(0)
    return [softmax_from_stats(c, dim, row_max, row_sum, target in LOG_SOFTMAX_TARGETS) for c in chunks]


def sharded_softmax_collectives(op: OpCall) -> tuple[tuple[str, int], ...]:
    """The all-reduces of a softmax over a sharded dim: row maxima, then row sums (one value a row)."""
    spec = out_spec(op)
    dim = normalize_dim(op.arg(1, "dim"), spec.ndim)
    row_bytes = spec.nbytes // max(spec.shape[dim], 1)
    return (("all_reduce", row_bytes), ("all_reduce", row_bytes))


@register(*aten_ops("_softmax.default", "_log_softmax.default", "softmax.int", "log_softmax.int"), strided=OWN)
def softmax_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Softmax over ``dim``: Shard on another dim survives (a strided one too: the ``(B*heads, S,
    S)`` scores of eager attention); on ``dim`` it survives through the ``sharded_softmax``
    rewrite (two row-sized all-reduces), unless strided; a Partial input is infeasible."""
    p = inputs[0]
    dim = normalize_dim(op.arg(1, "dim"), op.tensor_inputs[0].ndim)
    if isinstance(p, Partial):
        return reject("softmax of a Partial is not the sum of softmaxes")
    if isinstance(p, StridedShard) and p.dim == dim:
        return reject(f"softmax over the fused (strided) dim {dim}")
    if isinstance(p, Shard) and p.dim == dim:
        if not is_float(op.tensor_inputs[0].dtype):
            return reject(f"softmax over sharded dim {dim} of an integer tensor")
        return [Candidate(p, local=SHARDED_SOFTMAX, collectives=sharded_softmax_collectives(op))]
    return [Candidate(p)]


@register(*aten_ops("native_layer_norm.default"))
def layer_norm_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd).

    ``mean``/``rstd`` have shape ``x.shape[:k] + (1,) * len(normalized_shape)``, so a Shard on a
    leading (not normalized) dim is the same dim in all three results. weight/bias live on the
    normalized dims and must be Replicate.
    """
    x, px = op.tensor_inputs[0], inputs[0]
    first_normalized = x.ndim - len(op.arg(1, "normalized_shape"))
    for i, q in enumerate(inputs[1:], start=1):
        if not isinstance(q, Replicate):
            return reject(f"layer_norm affine parameter (tensor input {i}) must be Replicate, got {q}")
    if isinstance(px, Partial):
        return reject("layer_norm of a Partial is infeasible")
    if isinstance(px, Shard):
        if px.dim >= first_normalized:
            return reject(f"layer_norm over sharded dim {px.dim}")
        return [Candidate((px, px, px))]
    return [Candidate((R, R, R))]
