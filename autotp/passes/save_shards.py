"""Save shards: a column-parallel matmul keeps its sequence-sharded input for backward, not the
gathered one (sequence parallelism, as in Megatron-LM).

Under ``sequence_parallel=True`` the residual stream and the norms live on sequence shards
(``S(d)``) and are all-gathered before each column-parallel matmul (q / k / v, gate / up). A plain
``linear`` saves its whole input for the weight's gradient, so every rank would keep the gathered
activation (N x the shard) until backward. This pass, on the rewritten per-rank graph of a
training graph, finds each ``linear`` whose input is an all-gather ``Redistribute(S(d) -> R)``,
through any identity edges (``R -> R``, whose backward all-reduces), and calls
:class:`~autotp.layers.LinearOnGatheredInput` instead: the same forward, with the shard saved and
gathered again in backward (one more all-gather per matmul in backward, the price Megatron pays
too). The gathered tensor is then saved by nobody and freed after the matmuls that read it.

Planning is untouched (the plan, its collectives and the plan cache are those of the rewrite);
the pass is keyed on graph structure, like the fuse pass, and runs only when the graph trains
(some value requires grad) and ``sequence_parallel`` is on. What it did is in the trace
(``save_shards.json``) and ``CompiledGraph.save_shards``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from autotp.collectives import Comm
from autotp.layers import LinearOnGatheredInput, Redistribute
from autotp.passes.fuse import LINEAR_FUNCTIONS
from autotp.placement import R, Shard, StridedShard


@dataclass
class SaveShardsReport:
    """Each rewritten ``linear`` (node name) with the all-gather whose shard it saves."""

    linears: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {"linears": dict(self.linears)}


def _redistribute(gm: torch.fx.GraphModule, node: object) -> Redistribute | None:
    if not isinstance(node, torch.fx.Node) or node.op != "call_module":
        return None
    module = gm.get_submodule(str(node.target))
    return module if isinstance(module, Redistribute) else None


def _gathered_from(gm: torch.fx.GraphModule, node: object) -> tuple[torch.fx.Node, int] | None:
    """The shard node and dim when ``node`` is an all-gather ``S(d) -> R`` of it, seen through
    identity edges ``R -> R``; None otherwise."""
    module = _redistribute(gm, node)
    while module is not None and module.src == R and module.dst == R:
        node = node.args[0]
        module = _redistribute(gm, node)
    if (
        module is None
        or module.dst != R
        or not isinstance(module.src, Shard)
        or isinstance(module.src, StridedShard)
    ):
        return None
    shard = node.args[0]
    return (shard, module.src.dim) if isinstance(shard, torch.fx.Node) else None


def save_input_shards(gm: torch.fx.GraphModule, comm: Comm) -> SaveShardsReport:
    """Rewrite, in place, each ``linear`` of an all-gathered input (see the module docstring)."""
    report = SaveShardsReport()
    modules: dict[int, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_FUNCTIONS or node.kwargs.keys() - {"bias"}:
            continue
        found = _gathered_from(gm, node.args[0])
        if found is None:
            continue
        shard, dim = found
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if dim not in modules:
            modules[dim] = f"autotp_save_shard_{dim}"
            gm.add_submodule(modules[dim], LinearOnGatheredInput(dim, comm))
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_module(modules[dim], (node.args[0], shard, weight, bias))
        replacement.meta = dict(node.meta)  # shapes, checkpoint regions
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        report.linears[replacement.name] = shard.name
    if report.linears:
        gm.graph.lint()
        gm.recompile()
    return report
