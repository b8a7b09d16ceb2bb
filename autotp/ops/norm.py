"""Normalizations: softmax / log_softmax and native_layer_norm.

All are nonlinear, so a Partial input is infeasible. A Shard survives on any dim the op does not
normalize over; a Shard on the normalized dim(s) is infeasible (the local statistics would be the
shard's, not the row's).
"""

from __future__ import annotations

from collections.abc import Sequence

from autotp.ops._common import R, aten_ops
from autotp.ops.registry import Candidate, OpCall, register, reject
from autotp.placement import Partial, Placement, Replicate, Shard, normalize_dim


@register(*aten_ops("_softmax.default", "_log_softmax.default", "softmax.int", "log_softmax.int"))
def softmax_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Softmax over ``dim``: Shard on another dim survives; on ``dim`` or Partial it is infeasible."""
    p = inputs[0]
    dim = normalize_dim(op.arg(1, "dim"), op.tensor_inputs[0].ndim)
    if isinstance(p, Partial):
        return reject("softmax of a Partial is not the sum of softmaxes")
    if isinstance(p, Shard) and p.dim == dim:
        return reject(f"softmax over sharded dim {dim}")
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
