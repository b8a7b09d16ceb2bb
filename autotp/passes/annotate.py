"""Annotate: map the ATen-level solution back onto the Dynamo graph.

Because decomposition bracketed every Dynamo node with edges and marks, the mapping is a lookup:
a Dynamo node's output placements are its marks' placements; the placement each of its tensor
arguments must have is its edge's placement, and the placement that argument arrives with is the
placement of the edge's input (the producer's mark, or a placeholder). The local rewrites its ATen
ops chose are collected per Dynamo node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx

from autotp.passes.decompose import ShadowGraph
from autotp.passes.solve import Solution
from autotp.placement import Placement


@dataclass
class EdgePlan:
    src: Any  # placement the value arrives with
    dst: Any  # placement the consumer needs


@dataclass
class NodePlan:
    """The plan for one Dynamo node."""

    outputs: dict[int, Any] = field(default_factory=dict)  # output sub-position -> placement
    edges: dict[tuple[int, int], EdgePlan] = field(default_factory=dict)  # (leaf, sub) -> edge
    local: set[str] = field(default_factory=set)

    def output(self) -> Any:
        """The single output placement (or a tuple for multi-output nodes)."""
        if not self.outputs:
            return None
        if list(self.outputs) == [0]:
            return self.outputs[0]
        return tuple(self.outputs[k] for k in sorted(self.outputs))

    def produces_non_replicated(self) -> bool:
        from autotp.placement import Replicate

        return any(p is not None and not isinstance(p, Replicate) for p in self.outputs.values())


@dataclass
class Annotation:
    plans: dict[torch.fx.Node, NodePlan]
    placeholder_placements: dict[torch.fx.Node, Placement]


def annotate(shadow: ShadowGraph, solution: Solution) -> Annotation:
    plans: dict[torch.fx.Node, NodePlan] = {n: NodePlan() for n in shadow.dynamo_nodes}
    for (src, sub), m in shadow.marks.items():
        plans[shadow.dynamo_nodes[src]].outputs[sub] = solution.placements[m]
    for (dst, leaf, sub), e in shadow.edges.items():
        producer = e.args[0]
        plans[shadow.dynamo_nodes[dst]].edges[(leaf, sub)] = EdgePlan(
            src=solution.placements.get(producer), dst=solution.placements[e]
        )
    for aten_node, tag in solution.local.items():
        owner = shadow.owner.get(aten_node)
        if owner is not None:
            plans[shadow.dynamo_nodes[owner]].local.add(tag)
    ph = {dyn: solution.placements[aten] for aten, dyn in shadow.placeholders}
    for dyn, p in ph.items():
        plans[dyn].outputs[0] = p
    return Annotation(plans=plans, placeholder_placements=ph)


def replicated_annotation(gm: torch.fx.GraphModule) -> Annotation:
    """The plan at world size 1: every value replicated, no collectives, no local rewrites."""
    from autotp.placement import R

    plans = {n: NodePlan(outputs={0: R}) for n in gm.graph.nodes}
    placeholders = {n: R for n in gm.graph.nodes if n.op == "placeholder"}
    return Annotation(plans=plans, placeholder_placements=placeholders)
