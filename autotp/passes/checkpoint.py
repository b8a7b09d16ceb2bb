"""Activation checkpointing: plan through a checkpointed block, recompute it in backward.

``torch.utils.checkpoint`` (and transformers' ``gradient_checkpointing_enable()``) reach the
backend as one higher-order op per checkpointed block, ``tag_activation_checkpoint(body, *args)``,
whose body is a sub-``GraphModule``. As one Dynamo node the block would be opaque to the solver:
no collective could sit inside it. So the checkpoint is taken apart and put back around the plan:

* :func:`inline_checkpoints` (before decomposition) copies each body's nodes into the graph in
  place of its op, each copy tagged ``node.meta["autotp_checkpoint"] = region`` (one region per
  op call); the solver and the rewrite then see an ordinary graph.
* :func:`outline_checkpoints` (after the rewrite) cuts each region back out — its tagged nodes and
  everything the rewrite put between them (the collectives on its edges, replaced nodes) — into a
  sub-``GraphModule`` called through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  (:class:`CheckpointedRegion`). Forward runs it without saving its intermediate activations;
  backward runs it again, collectives included, as Megatron's activation recomputation does:
  every rank recomputes the same regions in the same order, so the collectives match. The random
  state is restored for the recomputation (``preserve_rng_state``), so dropout draws the same
  masks, autotp's per-rank streams included (they derive from the default generator).

A region whose span holds another region's nodes (the rewrite never interleaves blocks, but a
graph could) is left inlined, with the reason in the report: correct, without the memory saving.
A nested checkpoint is refused with an :class:`~autotp.errors.AutoTPError`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint

from autotp.passes.inline import inline_body

__all__ = ["CheckpointReport", "CheckpointedRegion", "inline_checkpoints", "outline_checkpoints"]

REGION = "autotp_checkpoint"


def _is_checkpoint_op(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "tag_activation_checkpoint"


def inline_checkpoints(gm: torch.fx.GraphModule) -> int:
    """Replace each ``tag_activation_checkpoint(body, *args)`` by a copy of ``body``'s nodes tagged
    with its region number (``autotp/passes/inline.py``); returns how many regions there are. A
    body holding another checkpoint is refused there."""
    regions = 0
    for hop in [n for n in gm.graph.nodes if _is_checkpoint_op(n)]:
        body_node, *args = hop.args

        def tag(copy: torch.fx.Node, original: torch.fx.Node, region: int = regions) -> None:
            copy.meta[REGION] = region

        inline_body(gm, hop, body_node, args, "activation checkpoint", tag)
        regions += 1
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions


class CheckpointedRegion(torch.nn.Module):
    """One checkpointed block of a rewritten graph: its forward keeps only its inputs for
    backward and recomputes the block (collectives included) when the gradient arrives."""

    def __init__(self, body: torch.fx.GraphModule) -> None:
        super().__init__()
        self.body = body

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*args)
        return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False)


@dataclass
class CheckpointReport:
    """Which regions run checkpointed, and why any other stays inlined."""

    outlined: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"outlined": self.outlined, "skipped": {str(k): v for k, v in self.skipped.items()}}


def outline_checkpoints(gm: torch.fx.GraphModule) -> CheckpointReport:
    """Cut each tagged region (from its first to its last tagged node, in graph order) into a
    :class:`CheckpointedRegion` call; see the module docstring."""
    report = CheckpointReport()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    spans: dict[int, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if REGION in n.meta:
            spans.setdefault(n.meta[REGION], []).append(n)
    cuts: list[tuple[int, list[torch.fx.Node]]] = []
    for region, tagged in sorted(spans.items()):  # every span first: outlining changes the graph
        first, last = order[tagged[0]], order[tagged[-1]]
        span = [n for n in gm.graph.nodes if first <= order[n] <= last and n.op not in ("placeholder", "get_attr")]
        foreign = [n for n in span if n.meta.get(REGION, region) != region]
        if foreign:
            report.skipped[region] = f"its span holds {foreign[0].name} of region {foreign[0].meta[REGION]}"
        else:
            cuts.append((region, span))
    for region, span in cuts:
        _outline(gm, region, span)
        report.outlined.append(region)
    if report.outlined:
        gm.graph.lint()
        gm.recompile()
    return report


def _outline(gm: torch.fx.GraphModule, region: int, span: list[torch.fx.Node]) -> None:
    inside = set(span)
    inputs: list[torch.fx.Node] = []
    for n in span:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in span:
        env[n] = body.node_copy(n, env.__getitem__)
    body.output(tuple(env[n] for n in outputs))
    name = f"autotp_checkpoint_{region}"
    gm.add_submodule(name, CheckpointedRegion(torch.fx.GraphModule(gm, body)))
    with gm.graph.inserting_after(span[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    with gm.graph.inserting_after(call):
        for i, n in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = {k: v for k, v in n.meta.items() if k != REGION}
            n.replace_all_uses_with(item, delete_user_cb=lambda u: u is not call and u not in inside)
    for n in reversed(span):
        gm.graph.erase_node(n)
