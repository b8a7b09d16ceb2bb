"""Attention heads no tp divides: which widths are whole heads, and how their split is grouped.

Megatron splits attention by heads, so tp must divide the head count. Where it does not (Qwen2.5-7B's
28 query heads at tp=8), autotp still splits in whole heads, unevenly: a
:class:`~autotp.placement.HeadShard`. Grouped-query attention (``H`` query heads over ``KV`` kv
heads, ``KV`` dividing N) makes ``KV`` groups of ``N / KV`` ranks: group ``g`` holds kv head ``g``
(the k/v projections' :class:`~autotp.placement.GroupedShard`, ``autotp/ops/kv_heads.py``) and
its ``H / KV`` query heads shared by ``chunk_range`` (7 over 2 ranks are 4 + 3), so every rank's
query heads use only the kv head it holds and attention stays local. Multi-head attention (``KV ==
H``) is one group: q, k and v split alike. A split that would leave a rank without a head, or
whose query groups cannot follow the kv heads (``KV`` neither dividing N nor divisible by it), is
not offered (``autotp.api.check_divisible`` refuses it before loading).

The head count and width are read off the graph, as kv heads are: wherever attention spreads kv
heads over query heads (``(B, KV, 1, S, D) -> (B, KV, H/KV, S, D)``), scaled dot-product
attention meets q ``(B, H, L, D)`` and k ``(B, KV, S, D)``, or, for attention written with
matmuls (GPT-2's eager attention), a projection is cut into heads and they are moved before the
tokens (``(B, S, H*D) -> (B, S, H, D) -> (B, H, S, D)``, multi-head). A parameter dim of ``H * D`` indices
(q's projection rows, o_proj's columns, biases; k/v's too under multi-head attention) may then be
split as ``S(d:Hh/G)``; the solver decides which, by least communication as for every shard.
Nothing here looks at names.
"""

from __future__ import annotations

import torch.fx

from autotp.ops._common import aten_ops
from autotp.ops.attention import LAYOUTS
from autotp.ops.kv_heads import _shape, kv_spread
from autotp.placement import HeadShard, head_split

_ATTENTION = {op for name in LAYOUTS for op in aten_ops(name)}
_VIEWS = set(aten_ops("view.default", "view_copy.default", "_unsafe_view.default", "reshape.default"))
_PERMUTES = set(aten_ops("permute.default", "permute_copy.default"))
_PASS = set(aten_ops("clone.default", "alias.default", "contiguous.default"))


def _groups(heads: int, kv_heads: int, world_size: int) -> int | None:
    """How many kv groups a head split of ``heads`` over ``kv_heads`` follows at tp ``world_size``."""
    if kv_heads == heads:
        return 1
    if kv_heads < world_size and world_size % kv_heads == 0:
        return kv_heads
    return None


def head_splits(graph: torch.fx.Graph, world_size: int) -> dict[int, HeadShard]:
    """Width ``H * D`` -> the :class:`HeadShard` (on dim 0; callers move it) of every attention
    whose ``H`` query heads ``world_size`` does not divide but splits in whole heads. Spread kv
    heads name the grouping first (an attention after ``repeat_kv`` sees ``H`` kv heads)."""
    sites: dict[int, tuple[int, int]] = {}
    for n in graph.nodes:
        spread = kv_spread(n)
        if spread is not None and spread[1] > 0:  # repeat_kv: (.., KV, 1, ..) -> (.., KV, rep, ..) -> (.., H, ..)
            x, i = spread
            rep = _shape(n)[i]
            sites[x[i - 1] * rep * x[-1]] = (x[i - 1] * rep, x[i - 1])
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _ATTENTION and len(n.args) >= 3:
            q, k = _shape(n.args[0]), _shape(n.args[1])
            if q and k and len(q) == 4 and len(k) == 4 and q[1] % k[1] == 0:
                sites.setdefault(q[1] * q[-1], (q[1], k[1]))
    for n in graph.nodes:  # eager attention (batched matmuls): the projection cut into heads
        heads = _cut_into_heads(n)
        if heads is not None:
            sites.setdefault(heads[0] * heads[1], (heads[0], heads[0]))
    out: dict[int, HeadShard] = {}
    for width, (heads, kv_heads) in sites.items():
        groups = _groups(heads, kv_heads, world_size)
        split = head_split(0, heads, groups, world_size) if groups is not None else None
        if isinstance(split, HeadShard):
            out[width] = split
    return out


def _cut_into_heads(n: torch.fx.Node) -> tuple[int, int] | None:
    """(H, D) where ``n`` views ``(B, S, H*D)`` as ``(B, S, H, D)`` and a permute (through copies and
    brackets) then moves the heads before the tokens, ``(B, H, S, D)``: how attention written with
    matmuls (GPT-2's eager attention, decomposed into ``bmm``) takes q, k and v apart. The heads
    are taken to be their own kv heads (multi-head attention: grouped-query attention spreads its
    kv heads, which the first site kind reads)."""
    if n.op != "call_function" or n.target not in _VIEWS or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return None
    x, out = _shape(n.args[0]), _shape(n)
    if x is None or out is None or len(x) != 3 or len(out) != 4 or out[:2] != x[:2] or out[2] * out[3] != x[2] \
            or min(out[2], out[3]) < 2:
        return None
    users, seen = list(n.users), 0
    while users and seen < 8:
        u, seen = users.pop(), seen + 1
        if u.op != "call_function":
            continue
        if u.target in _PERMUTES and len(u.args) > 1 and list(u.args[1]) == [0, 2, 1, 3]:
            return out[2], out[3]
        if u.target in _PASS or "autotp" in str(u.target):
            users += list(u.users)
    return None


def head_candidates(shape: tuple[int, ...], splits: dict[int, HeadShard]) -> list[HeadShard]:
    """The head shards a parameter of ``shape`` may take: one per dim whose size is a split width."""
    return [HeadShard(d, splits[size].heads, splits[size].groups) for d, size in enumerate(shape) if size in splits]
