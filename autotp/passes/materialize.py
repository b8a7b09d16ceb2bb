"""Materialize: give every parameter placeholder this rank's local shard.

The first graph that touches a parameter fixes its placement in its ``ParameterMeta``; the shard is
read from the checkpoint (only this rank's slice) or cut from the in-memory tensor, once, and kept
on the meta. Later graphs (recompiles, decode steps) find the placement pinned and reuse the same
local ``Parameter`` object, so the optimizer and ``model.parameters()`` see one tensor per shard.
"""

from __future__ import annotations

import re

import torch
import torch.fx

from autotp.context import TPContext, attach_meta, meta_of
from autotp.passes.annotate import Annotation
from autotp.passes.rewrite import LocalParam
from autotp.placement import Shard


def attr_name(fqn: str) -> str:
    return "autotp_param_" + re.sub(r"[^0-9a-zA-Z_]", "_", fqn)


def materialize(annotation: Annotation, param_inputs: dict[torch.fx.Node, torch.Tensor],
                ctx: TPContext) -> dict[torch.fx.Node, LocalParam]:
    """Fix each parameter's placement and return its local shard, keyed by Dynamo placeholder."""
    out: dict[torch.fx.Node, LocalParam] = {}
    rank, world = ctx.rank, ctx.world_size
    for ph, value in param_inputs.items():
        meta = meta_of(value)
        if meta is None:
            raise AssertionError(f"parameter placeholder {ph.name} has no ParameterMeta")  # internal
        if meta.placement is None:
            meta.placement = annotation.placeholder_placements[ph]
        if meta.local is None:
            if meta.checkpoint is not None:
                local = meta.load_local(rank, world, dtype=ctx.config.dtype or meta.dtype, device=value.device)
            else:
                local = meta.shard_from(value.detach(), rank, world)
            meta.local = torch.nn.Parameter(local, requires_grad=value.requires_grad)
            attach_meta(meta.local, meta)  # the shard knows its placement (gathering grads, checkpoints)
        start = 0
        if isinstance(meta.placement, Shard) and meta.placement.dim == 0:
            start = (meta.index_range(rank, world) or (0, 0))[0]
        out[ph] = LocalParam(attr=attr_name(meta.fqn), tensor=meta.local, global_shape=tuple(meta.global_shape),
                             vocab_start=start)
    return out
