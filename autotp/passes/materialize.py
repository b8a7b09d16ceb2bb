"""Materialize: give every parameter placeholder this rank's local shard.

The first graph that touches a parameter fixes its placement in its ``ParameterMeta``; the shard is
read from the checkpoint (only this rank's slice) or cut from the in-memory tensor, once, and kept
on the meta. Later graphs (recompiles, decode steps) find the placement pinned and reuse the same
local ``Parameter`` object, so the optimizer and ``model.parameters()`` see one tensor per shard.

Fused layout: when the fuse pass will run, each group of sibling linears it would fuse
(:func:`autotp.passes.fuse.sibling_linears`, asked here with the shards' future shapes) whose
shards are all still unread gets one buffer, and each shard is read straight into its rows. The fuse
pass then finds the group back to back and takes a view instead of concatenating, so a rank never
holds a group twice: without this the largest group (gate|up of a block) was a transient on top of
the loaded model (138 MB per rank for a 7.8 GB checkpoint at tp=2).
"""

from __future__ import annotations

import re

import torch
import torch.fx

from autotp.context import TPContext, attach_meta, meta_of
from autotp.passes.annotate import Annotation
from autotp.passes.fuse import is_training, sibling_linears
from autotp.passes.rewrite import LocalParam
from autotp.placement import Shard
from autotp.weights import ParameterMeta


def attr_name(fqn: str) -> str:
    return "autotp_param_" + re.sub(r"[^0-9a-zA-Z_]", "_", fqn)


def materialize(annotation: Annotation, param_inputs: dict[torch.fx.Node, torch.Tensor],
                ctx: TPContext, fused: torch.fx.Graph | None = None) -> dict[torch.fx.Node, LocalParam]:
    """Fix each parameter's placement and return its local shard, keyed by Dynamo placeholder.
    ``fused``: the graph the fuse pass will fuse (None: no fused layout)."""
    rank, world = ctx.rank, ctx.world_size
    for ph, value in param_inputs.items():
        meta = meta_of(value)
        if meta is None:
            raise AssertionError(f"parameter placeholder {ph.name} has no ParameterMeta")  # internal
        if meta.placement is None:
            meta.placement = annotation.placeholder_placements[ph]
    if fused is not None:
        for group in _unread_sibling_groups(fused, param_inputs, ctx):
            _read_into_one_buffer(group, ctx)
    out: dict[torch.fx.Node, LocalParam] = {}
    for ph, value in param_inputs.items():
        meta = meta_of(value)
        if meta.local is None:
            if meta.checkpoint is not None:
                local = meta.load_local(rank, world, dtype=ctx.config.dtype or meta.dtype, device=value.device)
            else:
                local = meta.shard_from(value.detach(), rank, world)
            _set_local(meta, local, value)
        start = 0
        if isinstance(meta.placement, Shard) and meta.placement.dim == 0:
            start = (meta.index_range(rank, world) or (0, 0))[0]
        out[ph] = LocalParam(attr=attr_name(meta.fqn), tensor=meta.local, global_shape=tuple(meta.global_shape),
                             vocab_start=start)
    return out


def _set_local(meta: ParameterMeta, local: torch.Tensor, value: torch.Tensor) -> None:
    meta.local = torch.nn.Parameter(local, requires_grad=value.requires_grad)
    attach_meta(meta.local, meta)  # the shard knows its placement (gathering grads, checkpoints)


def _unread_sibling_groups(graph: torch.fx.Graph, param_inputs: dict[torch.fx.Node, torch.Tensor],
                           ctx: TPContext) -> list[list[torch.Tensor]]:
    """The weight groups, then the bias groups, of the sibling linears the fuse pass will fuse
    (inference graphs only), each as its parameters' stand-ins, where no shard is read yet."""

    def future_shard(node: object) -> torch.Tensor | None:  # the shard's shape, dtype and (meta) device
        value = param_inputs.get(node) if isinstance(node, torch.fx.Node) else None
        meta = meta_of(value) if value is not None else None
        if meta is None:
            return None
        if meta.local is not None:
            return torch.empty(tuple(meta.local.shape), dtype=meta.local.dtype, device="meta")
        dtype = ctx.config.dtype or meta.dtype if meta.checkpoint is not None else value.dtype
        return torch.empty(meta.local_shape(ctx.world_size, ctx.rank), dtype=dtype, device="meta")

    groups = []
    for _, members in sibling_linears(graph, future_shard):
        if is_training(members):
            continue
        for nodes in ([m[1] for m in members], [m[2] for m in members]):
            values = [param_inputs[n] for n in nodes if n is not None]
            if len(values) == len(nodes) and all(meta_of(v).local is None for v in values):
                groups.append(values)
    return groups


def _read_into_one_buffer(values: list[torch.Tensor], ctx: TPContext) -> None:
    """Read each parameter's shard into consecutive rows of one new buffer (dim 0, in order)."""
    rank, world = ctx.rank, ctx.world_size
    metas = [meta_of(v) for v in values]
    shapes = [m.local_shape(world, rank) for m in metas]
    first = metas[0]
    dtype = ctx.config.dtype or first.dtype if first.checkpoint is not None else values[0].dtype
    rows = sum(s[0] for s in shapes)
    buffer = torch.empty((rows, *shapes[0][1:]), dtype=dtype, device=values[0].device)  # (sum of rows, ...)
    at = 0
    for meta, shape, value in zip(metas, shapes, values, strict=True):
        rows_of = buffer.narrow(0, at, shape[0])
        at += shape[0]
        if meta.checkpoint is not None:
            meta.load_local(rank, world, out=rows_of)
        else:
            rows_of.copy_(meta.shard_from(value.detach(), rank, world))
        _set_local(meta, rows_of, value)
