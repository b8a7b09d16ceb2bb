"""Creation ops: arange, full, zeros, empty, scalar_tensor, *_like, new_*, and random factories.

* Factories with no tensor input (``arange``, ``full``, ``zeros``, ``empty*``, ``scalar_tensor``,
  ``rand``...) produce Replicate: every rank builds the whole tensor (random ones assume the ranks'
  generators are in sync, which the runtime must guarantee).
* ``new_*`` ops read only dtype/device from ``self``: any input placement -> Replicate.
* ``*_like`` / ``fill`` with a constant read only the shape: a Shard input gives the same Shard
  (each rank fills its own chunk), Replicate or Partial inputs (full local shape) give Replicate.
* Random ops of another tensor's shape or values (``rand_like``, ``bernoulli``, ``native_dropout``)
  live in ``autotp/ops/random.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotp.ops._common import P, R, aten_ops, is_float, out_spec, same
from autotp.ops.registry import POINTWISE, Candidate, OpCall, register, reject
from autotp.placement import Placement, Replicate, Shard


@register(*aten_ops(
    "arange.default", "arange.start", "arange.start_step", "full.default", "zeros.default",
    "ones.default", "empty.memory_format", "empty_strided.default", "empty_permuted.default",
    "scalar_tensor.default", "rand.default", "randn.default", "randint.default", "randint.low",
    "randperm.default", "eye.default", "linspace.default",
))
def factory_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """A factory with no tensor inputs builds the whole tensor on every rank. A floating tensor of
    zeros is also a valid Partial (zeros on every rank sum to zeros): offered so that the zero
    branch of ``where(mask, partial, 0)`` keeps a masked partial sum partial."""
    if any(not isinstance(p, Replicate) for p in inputs):
        return reject("factory ops take only Replicate tensor inputs")
    if _builds_float_zeros(op):
        return [Candidate(R), Candidate(P)]
    return same(R)


def _builds_float_zeros(op: OpCall) -> bool:
    spec = out_spec(op)
    if spec is None or not is_float(spec.dtype):
        return False
    name = op.target.name() if hasattr(op.target, "name") else str(op.target)
    if name.startswith("aten::zeros"):
        return True
    if name.startswith("aten::scalar_tensor"):
        value = op.arg(0, "s")
    elif name.startswith("aten::full"):
        value = op.arg(1, "fill_value")
    else:
        return False
    return isinstance(value, (int, float, bool)) and value == 0


@register(*aten_ops("new_zeros.default", "new_ones.default", "new_full.default", "new_empty.default",
                    "new_empty_strided.default"))
def new_factory_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """new_*(self, size): self gives only dtype and device."""
    return same(R)


@register(*aten_ops("full_like.default", "zeros_like.default", "ones_like.default", "empty_like.default",
                    "fill.Scalar"), strided=POINTWISE)
def like_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """A constant of ``x``'s shape: Shard stays Shard, R or P (full local shape) give R."""
    p = inputs[0]
    return same(p if isinstance(p, Shard) else R)
