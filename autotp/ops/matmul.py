"""Matrix products: mm, bmm, addmm, baddbmm, mv, dot, matmul, linear, grouped mm — one einsum-style helper.

Each op is described by the labels of its operands' dims (``mm``: ``ik,kj->ij``). With operand
placements:

* exactly one Partial operand and every other operand Replicate -> Partial (the op is bilinear);
* all Replicate -> Replicate;
* otherwise exactly one label may be sharded, and every operand that has that label at full size
  must be sharded on it (size-1 broadcast batch dims may stay Replicate):
  a contracted label gives Partial (``mm(S(1), S(0)) -> P``: row-parallel), an output label gives
  Shard on the output dim (``mm(R, S(1)) -> S(1)``: column-parallel; batch dims of ``bmm``).

The additive term of ``addmm``/``baddbmm``/``linear`` (bias) is valid only if its placement matches
the product's: Replicate for a Replicate product, Shard on the same output dim when it has that dim
at full size (else Replicate, it broadcasts), and Partial with a Partial product. A Replicate bias on
a Partial product (a row-parallel layer with a bias) gives Partial with the local rewrite
``replicated_share`` (each rank adds ``bias / N``; see ``autotp/ops/elementwise.py``).
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from autotp.ops._common import P, R, aten_ops, is_float, out_is_float, out_spec
from autotp.ops.elementwise import REPLICATED_SHARE
from autotp.ops.registry import POINTWISE, Candidate, OpCall, Rejected, TensorSpec, register, reject
from autotp.placement import Partial, Placement, Replicate, Shard


def einsum_placement(labels: Sequence[str], shapes: Sequence[tuple[int, ...]], out_labels: str,
                     inputs: Sequence[Placement], out_float: bool) -> Placement | Rejected:
    """Output placement of an einsum ``labels[0],labels[1],... -> out_labels`` (see module doc)."""
    partial = [isinstance(p, Partial) for p in inputs]
    if any(partial):
        if sum(partial) == 1 and all(isinstance(p, (Partial, Replicate)) for p in inputs):
            return P if out_float else reject("a non-floating product cannot be Partial")
        return reject("a product is linear in one operand only: one Partial with all others Replicate")
    sharded = {labels[i][p.dim] for i, p in enumerate(inputs) if isinstance(p, Shard)}
    if not sharded:
        return R
    if len(sharded) > 1:
        return reject(f"operands are sharded on different dims {sorted(sharded)}")
    (label,) = sharded
    for i, (lab, shape, p) in enumerate(zip(labels, shapes, inputs, strict=True)):
        if label in lab:
            j = lab.index(label)
            if shape[j] != 1 and p != Shard(j):
                return reject(f"operand {i} is {p}, needs S({j}) like the others (dim label {label!r})")
    if label in out_labels:
        return Shard(out_labels.index(label))
    return P if out_float else reject("a non-floating contraction cannot be Partial")


def with_bias(product: Placement, bias: TensorSpec, pb: Placement, out_ndim: int) -> Placement | Rejected:
    """Placement of ``bias + product`` (bias broadcast to the product, dims aligned right)."""
    if isinstance(product, Partial) or isinstance(pb, Partial):
        if isinstance(product, Partial) and isinstance(pb, (Partial, Replicate)):
            return P
        return reject(f"bias {pb} cannot be added to a product that is {product}: "
                      "each rank would add its own copy")
    if isinstance(product, Replicate):
        return R if isinstance(pb, Replicate) else reject(f"bias is {pb} but the product is Replicate")
    d = product.dim - (out_ndim - bias.ndim)
    need = Shard(d) if d >= 0 and bias.shape[d] != 1 else R
    if pb != need:
        return reject(f"bias is {pb}, needs {need} to match the product {product}")
    return product


def _einsum_rule(op: OpCall, inputs: Sequence[Placement], labels: Sequence[str], out_labels: str,
                 bias_index: int | None = None) -> list[Candidate]:
    specs = op.tensor_inputs
    operands = [i for i in range(len(specs)) if i != bias_index]
    product = einsum_placement(labels, [specs[i].shape for i in operands], out_labels,
                               [inputs[i] for i in operands], out_is_float(op))
    if isinstance(product, Rejected):
        return product
    if bias_index is not None:
        share = isinstance(product, Partial) and isinstance(inputs[bias_index], Replicate)
        product = with_bias(product, specs[bias_index], inputs[bias_index], len(out_labels))
        if isinstance(product, Rejected):
            return product
        if share:
            return [Candidate(product, local=REPLICATED_SHARE)]
    return [Candidate(product)]


@register(*aten_ops("mm.default"), strided=POINTWISE)
def mm_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """mm: ik,kj->ij."""
    return _einsum_rule(op, inputs, ["ik", "kj"], "ij")


@register(*aten_ops("bmm.default"), strided=POINTWISE)
def bmm_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """bmm: bik,bkj->bij."""
    return _einsum_rule(op, inputs, ["bik", "bkj"], "bij")


@register(*aten_ops("mv.default"), strided=POINTWISE)
def mv_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """mv: ik,k->i."""
    return _einsum_rule(op, inputs, ["ik", "k"], "i")


@register(*aten_ops("dot.default"), strided=POINTWISE)
def dot_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """dot: k,k->."""
    return _einsum_rule(op, inputs, ["k", "k"], "")


@register(*aten_ops("addmm.default"), strided=POINTWISE)
def addmm_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """addmm(bias, a, b) = beta*bias + alpha*(a @ b): mm plus a matching bias."""
    return _einsum_rule(op, inputs, ["ik", "kj"], "ij", bias_index=0)


@register(*aten_ops("baddbmm.default"), strided=POINTWISE)
def baddbmm_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """baddbmm(bias, a, b) = beta*bias + alpha*bmm(a, b): bmm plus a matching bias."""
    return _einsum_rule(op, inputs, ["bik", "bkj"], "bij", bias_index=0)


@register(*aten_ops("linear.default"), strided=POINTWISE)
def linear_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """linear(x, w, b) = x @ w.T + b: ...k,jk->...j, bias over j."""
    x = op.tensor_inputs[0]
    batch = string.ascii_uppercase[: x.ndim - 1]
    bias_index = 2 if len(op.tensor_inputs) == 3 else None
    labels = [batch + "k", "jk"]
    return _einsum_rule(op, inputs, labels, batch + "j", bias_index=bias_index)


def matmul_labels(a_ndim: int, b_ndim: int) -> tuple[list[str], str]:
    """Labels of ``torch.matmul`` operands (1-D promotion and batch broadcasting included)."""
    if a_ndim == 1 and b_ndim == 1:
        return ["k", "k"], ""
    batch = string.ascii_uppercase[: max(a_ndim, b_ndim) - 2]
    a = batch[len(batch) - max(a_ndim - 2, 0):] + ("ik" if a_ndim >= 2 else "k")
    b = batch[len(batch) - max(b_ndim - 2, 0):] + ("kj" if b_ndim >= 2 else "k")
    out = batch + ("i" if a_ndim >= 2 else "") + ("j" if b_ndim >= 2 else "")
    return [a, b], out


@register(*aten_ops("matmul.default"), strided=POINTWISE)
def matmul_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """matmul with numpy semantics; size-1 broadcast batch dims may stay Replicate."""
    a, b = op.tensor_inputs
    labels, out = matmul_labels(a.ndim, b.ndim)
    spec = out_spec(op)
    if spec is not None and spec.ndim != len(out):
        return reject(f"unexpected matmul output rank {spec.ndim}")
    return _einsum_rule(op, inputs, labels, out)


# --------------------------------------------------------------------------------------------------
# Grouped matmul (mixture-of-experts): rows of ``x`` are sorted by expert, ``offs`` ends each group
# --------------------------------------------------------------------------------------------------

#: ``out[rows of group e] = x[rows of group e] @ w[e]``: x ``sk``, w ``ekn``, offs ``e`` -> ``sn``.
#: Only ``k`` (row-parallel: Partial) and ``n`` (column-parallel: Shard) may be sharded. A shard of
#: the experts ``e`` or of the rows ``s`` is not a local grouped mm: ``offs`` holds global row
#: offsets, so a rank holding some experts (or some rows) would pair rows with the wrong weights.
GROUPED_MM_LABELS = (["sk", "ekn", "e"], "sn")


@register(*aten_ops("_grouped_mm.default"), "transformers.grouped_mm_fallback.default", strided=POINTWISE)
def grouped_mm_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """grouped mm of a 2-D ``x`` (S, K) and stacked weights (E, K, N) with group ends ``offs`` (E,):
    ``x`` R and ``w`` S(2) -> S(1) (each rank computes its output features of every expert);
    ``x`` S(1) and ``w`` S(1) -> P (each rank sums its part of K). ``offs`` must be Replicate, so
    routing is the same on every rank. Other layouts (3-D ``x``, no ``offs``, a bias) are replicated."""
    specs = op.tensor_inputs
    bias, out_dtype = op.arg(3, "bias"), op.arg(4, "out_dtype")
    if len(specs) != 3 or specs[0].ndim != 2 or specs[1].ndim != 3 or specs[2].ndim != 1 or bias is not None:
        if all(isinstance(p, Replicate) for p in inputs):
            return [Candidate(R)]
        return reject("only a 2-D input with 3-D stacked weights, group offsets and no bias is understood")
    if out_dtype is not None and any(isinstance(p, Partial) for p in inputs) and not is_float(out_dtype):
        return reject("a non-floating product cannot be Partial")
    if not isinstance(inputs[2], Replicate):
        return reject(f"group offsets are {inputs[2]}: every rank must route the same rows to the same expert")
    labels, out_labels = GROUPED_MM_LABELS
    for i, p in enumerate(inputs[:2]):
        if isinstance(p, Shard) and labels[i][p.dim] in "se":
            return reject(f"operand {i} is sharded on {labels[i][p.dim]!r} (rows or experts): offs is global")
    return _einsum_rule(op, inputs, labels, out_labels)
