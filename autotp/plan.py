"""The plan: the per-parameter outcome of a solve, in words users know (colwise, rowwise, vocab).

A style is read off the placement and the op that consumes the parameter, never off its name:
a matmul weight stored ``(out, in)`` (``linear``) sharded on ``out`` is column-parallel, on ``in``
row-parallel; stored ``(in, out)`` (``addmm`` / ``matmul`` with the weight second, e.g. GPT-2's
Conv1D) the other way round; an embedding table sharded on rows is vocab-parallel.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from autotp.compat import linear_builtin
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Placement,
    Replicate,
    Shard,
    local_shape,
    uneven_note,
    uneven_rows,
)

LINEAR_LIKE = {F.linear, linear_builtin}
MATMUL_LIKE = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.Tensor.matmul, torch.einsum}


def style_of(placement: Placement | None, consumer: torch.fx.Node | None, ndim: int) -> str:
    if placement is None or isinstance(placement, Replicate):
        return "replicate"
    if isinstance(placement, GroupedShard):
        return "kv_grouped"  # a k/v projection's heads, each held by a group of ranks (autotp/ops/kv_heads.py)
    if isinstance(placement, HeadShard):  # heads no tp divides: the column / row split of whole heads
        placement = Shard(placement.dim)
    if not isinstance(placement, Shard):
        return str(placement)
    target = consumer.target if consumer is not None else None
    d = placement.dim
    if target is F.embedding:
        return "vocab" if d == 0 else "colwise"
    if target in LINEAR_LIKE:
        if ndim == 1:
            return "colwise"
        return "colwise" if d == 0 else "rowwise"
    if target in MATMUL_LIKE or target in ("matmul", "mm", "addmm", "__matmul__"):
        if ndim == 1:
            return "colwise"
        return "colwise" if d == ndim - 1 else "rowwise"
    if ndim == 1:
        return "colwise"
    return f"shard({d})"


def first_consumer(ph: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(ph.users), None)


def gradient_node(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first computed value of a Dynamo graph that requires grad (the graph trains: a backward
    follows), or None for an inference graph. Parameters require grad; what is computed from them
    does only when autograd records it. An attribute read (``getattr``: Falcon's ``weight.T``) is
    not a computation: its example value requires grad as its parameter does, even under no_grad."""
    for n in gm.graph.nodes:
        value = n.meta.get("example_value")
        if n.op.startswith("call_") and n.target is not getattr and isinstance(value, torch.Tensor) \
                and value.requires_grad:
            return n
    return None


def build_plan(world_size: int, params: dict[str, dict[str, Any]], collectives: Counter,
               sharded_outputs: int = 0) -> dict[str, Any]:
    """``collectives`` are those inside the graph; ``sharded_outputs`` counts results that leave
    it sharded: ``parallelize_model`` gathers the ones the user reads (one all-gather each, at the
    model boundary) and keeps KV-cache entries sharded. ``uneven`` (only when some parameter is
    split unevenly, a vocabulary no tp divides) says where ranks carry unequal work."""
    plan = {
        "world_size": world_size,
        "parameters": dict(sorted(params.items())),
        "collectives": dict(sorted(collectives.items())),
        "sharded_outputs": sharded_outputs,
    }
    uneven = {fqn: e["uneven"] for fqn, e in plan["parameters"].items() if e.get("uneven")}
    if uneven:
        plan["uneven"] = uneven
    return plan


def parameter_entry(placement: Placement | None, consumer: torch.fx.Node | None,
                    global_shape: tuple[int, ...], world_size: int) -> dict[str, Any]:
    """One parameter of the plan; ``local_shape`` is rank 0's (the largest chunk). A parameter split
    unevenly also carries ``rows_per_rank`` and the ``uneven`` note."""
    entry = {
        "style": style_of(placement, consumer, len(global_shape)),
        "placement": str(placement),
        "shard_dim": placement.dim if isinstance(placement, (Shard, GroupedShard, HeadShard)) else None,
        "global_shape": list(global_shape),
        "local_shape": list(local_shape(global_shape, placement, world_size)),
    }
    rows = uneven_rows(global_shape, placement, world_size)
    if rows is not None:
        entry["rows_per_rank"] = rows
        entry["uneven"] = uneven_note(global_shape, placement, world_size)
    return entry
