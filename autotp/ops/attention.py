"""Scaled dot-product attention, every ATen overload: one rule over the heads / batch dims.

q ``(B, Hq, L, E)``, k ``(B, Hk, S, E)``, v ``(B, Hk, S, Ev)``, optional mask broadcastable to
``(B, Hq, L, S)``:

* all Replicate -> Replicate;
* q, k, v all ``S(1)`` (heads) -> output ``S(1)``. With GQA (``Hk < Hq``) contiguous chunks still
  pair up — rank r's query heads ``[r*Hq/N, (r+1)*Hq/N)`` use kv heads ``[r*Hk/N, (r+1)*Hk/N)`` —
  because both head counts divide by N (they are sharded);
* multi-query (one kv head, ``Hk == 1``): q ``S(1)`` with k, v Replicate -> ``S(1)``: the kv
  projection is replicated (``tp > kv heads``) and each rank's query heads share the one kv head;
* grouped-query with more ranks than kv heads (``N`` a multiple of ``Hk``): q ``S(1)`` with k, v
  ``S(1/Hk)`` (:class:`~autotp.placement.GroupedShard`, one kv head per rank) -> ``S(1)``: rank r's
  query heads ``[r*Hq/N, (r+1)*Hq/N)`` all use kv head ``r*Hk//N``, the one it holds, which
  ``enable_gqa`` pairs with every local query head;
* heads no tp divides (:class:`~autotp.placement.HeadShard`, whole heads per rank): q ``S(1:Hh/G)``
  with k, v alike (multi-head attention, or kv heads already spread over the query heads), with k, v
  ``R`` of one kv head (multi-query), or, when
  ``G`` is the kv head count, with k, v ``S(1/G)`` (each group of ranks holds its kv head and
  shares its query heads unevenly, 7 over 2 ranks as 4 + 3) -> ``S(1:Hh/G)``;
* q, k, v all ``S(0)`` (batch) -> ``S(0)``;
* the mask (and the math kernel's dropout mask) must be sharded like q where it has that dim at
  full size, and Replicate where it broadcasts (size 1 or missing);
* a Shard on the sequence or head_dim dims is infeasible (``is_causal`` and the softmax would see
  a slice), and so is any Partial.

Dropout is allowed with sharded heads / batch: each rank drops its own heads' probabilities.
Extra results get their natural placement (logsumexp ``(B, H, L)`` shards like the output, the
math kernel's attention weights ``(B, H, L, S)`` too); seeds, offsets, cumulative lengths and debug
masks get None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotp.ops._common import R, aten_ops, out_spec, tensor_index
from autotp.ops.registry import OWN, Candidate, OpCall, TensorSpec, register, reject
from autotp.placement import GroupedShard, HeadShard, Partial, Placement, Replicate, Shard

OUT, LSE, ATTN = "out", "lse", "attn"


@dataclass(frozen=True)
class Layout:
    """Where an overload keeps its optional tensors and what each of its results is."""

    mask: tuple[int, str] | None
    results: tuple[str | None, ...] | None  # None: a single tensor result
    dropout_mask: tuple[int, str] | None = None


_NINE = (OUT, LSE, None, None, None, None, None, None, None)
LAYOUTS: dict[str, Layout] = {
    "scaled_dot_product_attention.default": Layout((3, "attn_mask"), None),
    "_scaled_dot_product_flash_attention_for_cpu.default": Layout((99, "attn_mask"), (OUT, LSE)),
    "_scaled_dot_product_efficient_attention.default": Layout((3, "attn_bias"), (OUT, LSE, None, None)),
    "_scaled_dot_product_flash_attention.default": Layout(None, _NINE),
    "_scaled_dot_product_cudnn_attention.default": Layout((3, "attn_bias"), _NINE),
    "_scaled_dot_product_fused_attention_overrideable.default": Layout((3, "attn_bias"), _NINE),
    "_scaled_dot_product_attention_math.default": Layout((3, "attn_mask"), (OUT, ATTN),
                                                         dropout_mask=(6, "dropout_mask")),
}
_BY_TARGET = {op: LAYOUTS[name] for name in LAYOUTS for op in aten_ops(name)}


def _mask_need(mask: TensorSpec, shard_dim: int) -> Placement:
    """Placement a mask broadcast to (B, H, L, S) needs when q is sharded on ``shard_dim``."""
    d = shard_dim - (4 - mask.ndim)
    return Shard(d) if d >= 0 and mask.shape[d] != 1 else R


def _result(op: OpCall, kind: str | None, index: int, q: TensorSpec, p: Placement) -> Placement | None:
    if kind in (OUT, ATTN):
        return p
    if kind == LSE:
        spec = out_spec(op, index)
        if spec is None or spec.ndim < 3:
            return None
        if isinstance(p, Shard) and spec.shape[p.dim] != q.shape[p.dim]:
            return None
        return p
    return None


def _head_split_attention(op: OpCall, layout: Layout, inputs: Sequence[Placement | None],
                          extras: list[tuple[str, int]]) -> list[Candidate]:
    """q split in whole heads no tp divides (see the module docstring)."""
    q, k = op.tensor_inputs[:2]
    pq, pk, pv = inputs[:3]
    if q.ndim != 4 or pq.dim != 1:
        return reject(f"q is {pq}: only a split of the heads dim (1) is exact")
    grouped = GroupedShard(1, pq.groups) if pq.groups >= 2 else None
    single_kv = k.shape[1] == 1 and isinstance(pk, Replicate) and isinstance(pv, Replicate)  # multi-query
    if not (pk == pq == pv or single_kv or grouped is not None and pk == grouped == pv and k.shape[1] == pq.groups):
        return reject(f"k, v {pk}, {pv} do not hold the kv heads of q {pq}'s query heads")
    for name, i in extras:
        need = _mask_need(op.tensor_inputs[i], 1)
        need = HeadShard(need.dim, pq.heads, pq.groups) if isinstance(need, Shard) else need
        if inputs[i] != need:
            return reject(f"the {name} is {inputs[i]}, needs {need} with q {pq}")
    if layout.results is None:
        return [Candidate(pq)]
    return [Candidate(tuple(_result(op, kind, j, q, pq) for j, kind in enumerate(layout.results)))]


@register(*_BY_TARGET, grouped=OWN)
def sdpa_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Attention over heads or batch shards (see the module docstring)."""
    layout = _BY_TARGET[op.target]
    if any(isinstance(p, Partial) for p in inputs):
        return reject("attention is nonlinear: no input may be Partial")
    q, k, v = op.tensor_inputs[:3]
    pq, pk, pv = inputs[:3]
    extras: list[tuple[str, int]] = []
    for where, name in ((layout.mask, "mask"), (layout.dropout_mask, "dropout mask")):
        if where is not None:
            i = tensor_index(op, *where)
            if i is not None:
                extras.append((name, i))
    if isinstance(pq, GroupedShard):
        return reject("q is a grouped shard: only k and v may hold their heads in groups")
    if isinstance(pq, HeadShard):
        return _head_split_attention(op, layout, inputs, extras)
    if isinstance(pq, Replicate):
        if all(isinstance(p, Replicate) for p in inputs):
            shard: Placement = R
        else:
            return reject("q is Replicate while k, v or the mask are sharded")
    else:
        if q.ndim != 4 or pq.dim not in (0, 1):
            return reject(f"q sharded on dim {pq.dim}: only batch (0) or heads (1) shards are exact")
        single_kv = pq.dim == 1 and k.shape[1] == 1 and v.shape[1] == 1
        one_per_rank = pq.dim == 1 and k.shape[1] >= 2 and GroupedShard(1, k.shape[1]) == pk == pv and k.shape[1] == v.shape[1] \
            and op.world_size % k.shape[1] == 0 and q.shape[1] % op.world_size == 0
        if single_kv and isinstance(pk, Replicate) and isinstance(pv, Replicate):
            pass  # multi-query: the one kv head serves every rank's query heads (enable_gqa)
        elif isinstance(pk, GroupedShard) or isinstance(pv, GroupedShard):
            if not one_per_rank:
                return reject(f"k, v {pk}, {pv} with q {pq}: a grouped k/v must hold one kv head per rank")
        elif pk != pq or pv != pq:
            return reject(f"q, k, v must be sharded alike, got {pq}, {pk}, {pv}")
        for name, i in extras:
            need = _mask_need(op.tensor_inputs[i], pq.dim)
            if inputs[i] != need:
                return reject(f"the {name} is {inputs[i]}, needs {need} with q {pq}")
        shard = pq
    if layout.results is None:
        return [Candidate(shard)]
    return [Candidate(tuple(_result(op, kind, j, q, shard) for j, kind in enumerate(layout.results)))]
