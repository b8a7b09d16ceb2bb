"""Elementwise ops with broadcasting: unary math, binary arithmetic, comparisons, where, masked_fill.

Placement algebra (dims align from the right, as broadcasting does):

* Replicate/Shard only: every Shard input must shard the same output dim; an input with that dim
  at full size must be sharded on it too, one with size 1 there (or without it) stays Replicate
  (:func:`autotp.ops._common.broadcast_shard`).
* Partial is kept only where the op is linear in its Partial inputs, with every other tensor input
  Replicate and the result floating: ``add(P, P)``, ``sub(P, P)``, ``mul(P, R)``, ``div(P, R)``,
  ``neg(P)``, ``clone(P)``, ``_to_copy(P)`` to a floating dtype, ``where(c, P, P)``,
  ``masked_fill(P, m, 0)``. Adding a non-zero scalar or any nonlinear op on a Partial is infeasible.
* Partial plus Replicate (``add(P, R)``, ``sub(R, P)``: a residual added to a row-parallel result)
  is Partial with the local rewrite ``replicated_share``: each rank adds ``R / N``, so the ranks'
  results sum to ``P + R``. Exact in value for N a power of 2 (dividing by N is exact in binary
  floating point); otherwise ``R / N`` rounds, ~1 ulp of ``R`` per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autotp.ops._common import P, aten_ops, broadcast_shard, is_zero, out_is_float, out_spec
from autotp.ops.registry import (
    POINTWISE,
    Candidate,
    OpCall,
    Rejected,
    TensorSpec,
    register,
    register_local,
    reject,
)
from autotp.placement import Partial, Placement, Replicate, Shard

# A predicate on which tensor inputs are Partial (all others are Replicate): True if the op is
# linear in exactly those inputs, so per-rank results add up to the global result.
PartialCheck = Callable[[OpCall, list[bool]], bool]


def _no_partial(op: OpCall, pm: list[bool]) -> bool:
    return False


def _linear_unary(op: OpCall, pm: list[bool]) -> bool:
    return pm == [True]


def _additive(op: OpCall, pm: list[bool]) -> bool:
    # add/sub/rsub: x + alpha*y is linear in (x, y) jointly; a scalar operand must be zero.
    other = op.arg(1, "other")
    return all(pm) and (isinstance(other, TensorSpec) or is_zero(other))


def _multiplicative(op: OpCall, pm: list[bool]) -> bool:
    return sum(pm) == 1


def _divide(op: OpCall, pm: list[bool]) -> bool:
    if op.kwargs.get("rounding_mode") is not None:
        return False
    return pm[0] and not any(pm[1:])


def _where_self(op: OpCall, pm: list[bool]) -> bool:
    return pm == [False, True, True]


def _where_scalar_other(op: OpCall, pm: list[bool]) -> bool:
    return pm == [False, True] and is_zero(op.arg(2, "other"))


def _where_scalar_self(op: OpCall, pm: list[bool]) -> bool:
    return pm == [False, True] and is_zero(op.arg(1, "self"))


def _masked_fill_scalar(op: OpCall, pm: list[bool]) -> bool:
    return pm == [True, False] and is_zero(op.arg(2, "value"))


def _masked_fill_tensor(op: OpCall, pm: list[bool]) -> bool:
    return pm == [True, False, True]


def _copy(op: OpCall, pm: list[bool]) -> bool:
    # copy(self, src) overwrites self: only src's values matter.
    return len(pm) == 2 and pm[1]


REPLICATED_SHARE = "replicated_share"
_ADDITIVE_TARGETS = set(aten_ops("add.Tensor", "sub.Tensor", "rsub.Tensor", "add_.Tensor", "sub_.Tensor"))


def _replicated_share_ok(op: OpCall, inputs: Sequence[Placement | None]) -> bool:
    """``add``/``sub`` of Partial and Replicate tensors (no Shard, no scalar operand): Partial if
    each rank adds its ``1/N`` share of the Replicate terms."""
    return (op.target in _ADDITIVE_TARGETS and len(inputs) == 2
            and all(isinstance(p, (Partial, Replicate)) for p in inputs)
            and all(isinstance(s, TensorSpec) for s in (op.arg(0, "self"), op.arg(1, "other"))))


@register_local(REPLICATED_SHARE)
def replicated_share_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                           out_placement: Any, rank: int, world_size: int) -> Any:
    """Run ``target`` with each additive Replicate term divided by ``world_size``
    (:func:`additive_terms` says which tensor inputs are additive)."""
    flat, tree = pytree.tree_flatten((args, kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    for k in additive_terms(target, len(positions)):
        i = positions[k]
        if isinstance(in_placements[k], Replicate) and flat[i].is_floating_point():
            flat[i] = flat[i] / world_size
    args, kwargs = pytree.tree_unflatten(flat, tree)
    return target(*args, **kwargs)


def additive_terms(target: Any, n_tensors: int) -> list[int]:
    """Which tensor inputs (in ``tensor_inputs`` order) enter ``target``'s result as a plain
    summand: both operands of add/sub, the bias of addmm/baddbmm (first) and linear (third)."""
    name = str(target)
    if "linear" in name:
        return [2] if n_tensors == 3 else []
    if "addmm" in name or "baddbmm" in name:
        return [0]
    return list(range(n_tensors))


def elementwise(op: OpCall, inputs: Sequence[Placement | None], partial_ok: PartialCheck) -> list[Candidate]:
    """The shared rule of the family: broadcast Shard/Replicate, or Partial where linear."""
    specs = op.tensor_inputs
    out = out_spec(op)
    if out is not None:
        out_shape = out.shape
    else:
        out_shape = tuple(torch.broadcast_shapes(*(s.shape for s in specs)))
    partial = [isinstance(p, Partial) for p in inputs]
    if any(partial):
        if any(isinstance(p, Shard) for p in inputs):
            return reject("a Partial input cannot be combined with a Shard input")
        if not out_is_float(op):
            return reject("a non-floating result cannot be Partial")
        if not partial_ok(op, partial):
            if _replicated_share_ok(op, inputs):
                return [Candidate(P, local=REPLICATED_SHARE)]
            return reject(f"{op.target} is not linear in its Partial inputs {partial} "
                          f"(args {op.args})")
        return [Candidate(P)]
    res = broadcast_shard(out_shape, specs, inputs)
    if isinstance(res, Rejected):
        return res
    return [Candidate(res)]


def _family(partial_ok: PartialCheck, *names: str) -> None:
    def rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
        return elementwise(op, inputs, partial_ok)

    rule.__name__ = f"elementwise_{partial_ok.__name__.lstrip('_')}"
    rule.__doc__ = f"Elementwise rule; Partial inputs accepted by {partial_ok.__name__}."
    register(*aten_ops(*names), strided=POINTWISE)(rule)


UNARY_NONLINEAR = (
    "abs.default", "acos.default", "asin.default", "atan.default", "atanh.default", "asinh.default",
    "ceil.default", "cos.default", "cosh.default", "erf.default", "erfc.default", "exp.default",
    "exp2.default", "expm1.default", "floor.default", "frac.default", "gelu.default", "isinf.default",
    "isnan.default", "log.default", "log10.default", "log1p.default", "log2.default",
    "logical_not.default", "bitwise_not.default", "reciprocal.default", "relu.default",
    "round.default", "rsqrt.default", "sigmoid.default", "sign.default", "sgn.default", "silu.default",
    "sin.default", "sinh.default", "sqrt.default", "tan.default", "tanh.default", "trunc.default",
    "pow.Tensor_Scalar", "pow.Scalar", "clamp.default", "clamp_min.default", "clamp_max.default",
    "leaky_relu.default", "elu.default", "hardtanh.default", "softplus.default", "mish.default",
    "hardsigmoid.default", "hardswish.default", "nan_to_num.default", "square.default",
)
BINARY_NONLINEAR = (
    "pow.Tensor_Tensor", "maximum.default", "minimum.default", "atan2.default", "fmod.Tensor",
    "fmod.Scalar", "remainder.Tensor", "remainder.Scalar", "floor_divide.default", "div.Tensor_mode",
    "div.Scalar_mode", "clamp.Tensor",
    "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor",
    "le.Scalar", "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar",
    "logical_and.default", "logical_or.default", "logical_xor.default",
    "bitwise_and.Tensor", "bitwise_and.Scalar", "bitwise_or.Tensor", "bitwise_or.Scalar",
    "bitwise_xor.Tensor", "bitwise_xor.Scalar", "where.Scalar",
)
LINEAR_UNARY = (
    "neg.default", "clone.default", "alias.default", "alias_copy.default", "detach.default",
    "detach_copy.default", "lift_fresh_copy.default", "contiguous.default", "positive.default",
    "_to_copy.default", "mul.Scalar", "div.Scalar", "mul_.Scalar", "div_.Scalar",
)

_family(_no_partial, *UNARY_NONLINEAR, *BINARY_NONLINEAR)
_family(_linear_unary, *LINEAR_UNARY)
_family(_additive, "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "rsub.Tensor",
        "add_.Tensor", "sub_.Tensor")
_family(_multiplicative, "mul.Tensor", "mul_.Tensor")
_family(_divide, "div.Tensor", "div_.Tensor")
_family(_where_self, "where.self")
_family(_where_scalar_other, "where.ScalarOther")
_family(_where_scalar_self, "where.ScalarSelf")
_family(_masked_fill_scalar, "masked_fill.Scalar")
_family(_masked_fill_tensor, "masked_fill.Tensor")
_family(_copy, "copy.default", "copy_.default")
