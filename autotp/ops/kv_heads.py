"""Key/value projections whose heads the ranks outnumber: which parameters, and how many heads.

Grouped-query attention (``H`` query heads over ``KV`` key/value heads) splits by heads only while
``KV >= N``. Past that, Megatron's plan gives rank ``r`` (of ``N``) the query heads
``[r*H/N, (r+1)*H/N)`` and the kv head they use, ``r * KV // N``: with ``N`` a multiple of ``KV``
each kv head is held by the ``N / KV`` consecutive ranks of its group (a
:class:`~autotp.placement.GroupedShard` with ``KV`` groups), and with one kv head (multi-query) by
every rank. A k/v projection then holds, per rank, ``1/KV`` of its bytes at the least: splitting it
finer cuts a head apart, and attention would have to gather it back on every token.

The solver cannot see that from the parameter alone (its search runs forward), so, as with fused
projections (``autotp/ops/fused.py``), the facts are read off the graph beforehand. A key/value
tensor shows itself where attention spreads its heads over the query heads:

* ``expand`` of a size-1 dim next to the heads, ``(B, KV, 1, S, D) -> (B, KV, H/KV, S, D)``, merged
  into ``(B, H, S, D)`` afterwards (transformers' ``repeat_kv``), or ``(B, 1, S, D) -> (B, H, S, D)``
  (one kv head broadcast, Falcon's multi-query attention once its SDPA is decomposed);
* scaled dot-product attention whose k and v have fewer heads than q (``enable_gqa``).

From that tensor the search walks back through everything but matmuls (views, rotary embeddings,
the KV cache's concatenation) to the matmuls that made it; a parameter feeding such a matmul is a
k/v projection when the matmul's output features are exactly ``KV * D`` (so a fused q|k|v weight,
which also makes q, is not one). Nothing here looks at names.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.fx

from autotp.ops._common import aten_ops
from autotp.ops.attention import LAYOUTS
from autotp.placement import GroupedShard

_EXPANDS = set(aten_ops("expand.default", "expand_copy.default"))
_MERGES = set(aten_ops("view.default", "view_copy.default", "_unsafe_view.default", "reshape.default"))
_PASS_TO_MERGE = set(aten_ops("clone.default", "contiguous.default", "alias.default"))
_MATMULS = set(
    aten_ops(
        "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "matmul.default", "linear.default"
    )
)
#: ops between a weight placeholder and its matmul (transposes, copies, the brackets)
_WEIGHT_PATH = set(
    aten_ops(
        "t.default",
        "t_copy.default",
        "permute.default",
        "permute_copy.default",
        "transpose.int",
        "transpose_copy.int",
        "clone.default",
        "view.default",
        "view_copy.default",
        "_unsafe_view.default",
        "alias.default",
        "_to_copy.default",
        "expand.default",
        "unsqueeze.default",
    )
)
_ATTENTION = {op for name in LAYOUTS for op in aten_ops(name)}
_WALK_LIMIT = 256  # nodes visited back from one key/value tensor


@dataclass(frozen=True)
class KvHeads:
    """What makes a parameter a k/v projection whose heads the ranks outnumber."""

    count: int  # kv heads (< N)
    head_dim: int

    def placements(self, shape: tuple[int, ...]) -> list[GroupedShard]:
        """The grouped shards of a parameter of ``shape``: its dims of ``count * head_dim``
        (a weight's output features, a bias), cut into ``count`` groups. None for one kv head
        (that is ``R``)."""
        if self.count < 2:
            return []
        return [
            GroupedShard(d, self.count) for d, size in enumerate(shape) if size == self.count * self.head_dim
        ]


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape):
        return tuple(int(s) for s in val.shape)
    return None


def _is_bracket(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and "autotp" in str(n.target)


def _merges(n: torch.fx.Node, dim: int, depth: int = 4) -> bool:
    """Whether ``n``'s dims ``dim - 1`` and ``dim`` are merged into one by a view among its users
    (through copies and brackets)."""
    shape = _shape(n)
    for u in n.users:
        if u.op != "call_function" or depth == 0:
            continue
        if u.target in _MERGES:
            out = _shape(u)
            if (
                shape
                and out is not None
                and out == shape[: dim - 1] + (shape[dim - 1] * shape[dim],) + shape[dim + 1 :]
            ):
                return True
        elif u.target in _PASS_TO_MERGE or _is_bracket(u):
            if _merges(u, dim, depth - 1):
                return True
    return False


def kv_spread(n: torch.fx.Node) -> tuple[tuple[int, ...], int] | None:
    """Where attention spreads kv heads over query heads: for ``repeat_kv``'s expand
    ``(.., KV, 1, ..) -> (.., KV, rep, ..)`` whose dims ``i - 1`` and ``i`` a view then merges into
    ``H``, the input shape and ``i``; for an expand of one such size-1 dim that no view merges (one
    kv head broadcast over the query heads), the input shape and ``-i``; else None."""
    if n.op != "call_function" or n.target not in _EXPANDS or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return None
    x, out = _shape(n.args[0]), _shape(n)
    if x is None or out is None or len(x) != len(out) or len(x) < 3:
        return None
    spread = [i for i in range(len(x)) if x[i] == 1 and out[i] > 1]
    if len(spread) != 1 or spread[0] < 1:
        return None
    i = spread[0]
    return (x, i) if _merges(n, i) else (x, -i)


def kv_sites(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, int, int]]:
    """(key/value tensor, kv heads, head dim) wherever attention spreads kv heads over q heads."""
    sites = []
    for n in graph.nodes:
        spread = kv_spread(n)
        if spread is not None:
            x, i = spread
            sites.append((n.args[0], x[i - 1] if i > 0 else 1, x[-1]))  # repeat_kv, or one kv head broadcast
        elif n.op == "call_function" and n.target in _ATTENTION and len(n.args) >= 3:
            q, k, v = (_shape(a) for a in n.args[:3])
            if q and k and v and len(q) == 4 and k[1] < q[1] and q[1] % k[1] == 0:
                sites += [(n.args[1], k[1], k[-1]), (n.args[2], v[1], v[-1])]
    return sites


def _weight_param(n: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder a matmul operand is, through transposes, copies and brackets."""
    for _ in range(16):
        if n.op == "placeholder":
            return n
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
            return None
        if not (n.target in _WEIGHT_PATH or _is_bracket(n)):
            return None
        n = n.args[0]
    return None


def kv_projections(graph: torch.fx.Graph, world_size: int) -> dict[torch.fx.Node, KvHeads]:
    """Placeholder -> :class:`KvHeads` for every k/v projection parameter (weight or bias) whose kv
    heads are fewer than ``world_size`` and divide it (see the module docstring)."""
    found: dict[torch.fx.Node, KvHeads] = {}
    for start, count, head_dim in kv_sites(graph):
        if count >= world_size or world_size % count:
            continue
        heads = KvHeads(count, head_dim)
        seen, queue = {start}, deque([start])
        while queue and len(seen) < _WALK_LIMIT:
            n = queue.popleft()
            if n.op != "call_function":
                continue
            if n.target in _MATMULS:
                out = _shape(n)
                if out and out[-1] == count * head_dim:
                    for a in n.args:
                        p = _weight_param(a) if isinstance(a, torch.fx.Node) else None
                        if p is not None:
                            found[p] = heads
                continue
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    queue.append(a)
    return found
