"""Reductions: sum, mean, amax/amin, max/min, arg{max,min}, any/all, var/std, prod, logsumexp, cumsum.

* Reducing over non-sharded dims keeps the Shard; its index shifts left by the number of reduced
  dims before it when ``keepdim=False``.
* ``sum`` over a sharded dim gives Partial (floating results only). So does ``mean``, through the
  local rewrite ``sharded_mean``: each rank scales its chunk's mean by its share of the dim
  (``local size / global size``), and the shares sum to the whole mean. This is how an RMSNorm over a
  sharded dim (OLMo-2's q/k norms over all heads) costs one all-reduce of a per-token statistic
  instead of an all-gather of its input. Every other reduction over a sharded dim is infeasible
  (there is no Partial-max or -any).
* ``sum`` and ``mean`` are linear: Partial in, Partial out. Nothing else accepts a Partial.
* A scan (``cumsum``) keeps Shards on other dims, rejects one along the scan, and is linear.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotp.ops._common import P, R, aten_ops, norm_dims, out_is_float, out_len
from autotp.ops.registry import Candidate, OpCall, register, register_local, reject
from autotp.placement import Partial, Placement, Replicate, Shard, normalize_dim

SUM, MEAN, OTHER = "sum", "mean", "other"
SHARDED_MEAN = "sharded_mean"


@register_local(SHARDED_MEAN)
def sharded_mean_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                       out_placement: Any, rank: int, world_size: int) -> Any:
    """A mean over the (evenly) sharded dim of ``args[0]``: this rank's summand of the whole mean."""
    return target(*args, **kwargs) / world_size


def reduce(op: OpCall, inputs: Sequence[Placement | None], kind: str, dims: object, keepdim: bool
           ) -> list[Candidate]:
    """Shared reduction rule. ``dims`` is the raw dim argument (None / [] mean all dims)."""
    p = inputs[0]
    x = op.tensor_inputs[0]
    n_out = out_len(op)

    def wrap(q: Placement) -> Candidate:
        return Candidate(q if not isinstance(op.out, (tuple, list)) else tuple(q for _ in range(n_out)))

    if isinstance(p, Replicate):
        return [wrap(R)]
    if isinstance(p, Partial):
        if kind in (SUM, MEAN) and out_is_float(op):
            return [wrap(P)]
        return reject(f"{op.target} is not linear: its input cannot be Partial")
    reduced = norm_dims(dims, x.ndim)
    if p.dim in reduced:
        if kind == SUM and out_is_float(op):
            return [wrap(P)]
        if kind == MEAN and out_is_float(op):
            return [Candidate(P, local=SHARDED_MEAN)]
        return reject(f"{op.target} over sharded dim {p.dim} has no Partial form")
    return [wrap(Shard(p.dim if keepdim else p.dim - sum(1 for r in reduced if r < p.dim)))]


def _reduction(kind: str, dim_at: tuple[int, str] | None, keepdim_at: tuple[int, str] | None,
               *names: str) -> None:
    def rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
        dims = op.arg(*dim_at) if dim_at else None
        keepdim = bool(op.arg(*keepdim_at, False)) if keepdim_at else False
        return reduce(op, inputs, kind, dims, keepdim)

    rule.__name__ = f"reduce_{kind}"
    rule.__doc__ = f"{kind} reduction rule for {', '.join(names)}."
    register(*aten_ops(*names))(rule)


_reduction(SUM, (1, "dim"), (2, "keepdim"), "sum.dim_IntList")
_reduction(SUM, None, None, "sum.default")
_reduction(MEAN, (1, "dim"), (2, "keepdim"), "mean.dim")
_reduction(MEAN, None, None, "mean.default")
_reduction(OTHER, (1, "dim"), (2, "keepdim"), "amax.default", "amin.default", "max.dim", "min.dim",
           "argmax.default", "argmin.default", "any.dim", "any.dims", "all.dim", "all.dims",
           "var_mean.correction", "var.correction", "std.correction", "prod.dim_int",
           "logsumexp.default")
_reduction(OTHER, None, None, "max.default", "min.default", "any.default", "all.default", "prod.default")
_reduction(OTHER, (2, "dim"), (3, "keepdim"), "linalg_vector_norm.default")


@register(*aten_ops("cumsum.default", "cumprod.default"))
def scan_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Inclusive scan along ``dim``: Shard elsewhere survives; cumsum is linear (P -> P)."""
    p = inputs[0]
    x = op.tensor_inputs[0]
    dim = normalize_dim(op.arg(1, "dim"), x.ndim)
    if isinstance(p, Partial):
        if "cumsum" in str(op.target) and out_is_float(op):
            return [Candidate(P)]
        return reject("cumprod is not linear")
    if isinstance(p, Shard) and p.dim == dim:
        return reject(f"scan along sharded dim {dim}")
    return [Candidate(p)]
