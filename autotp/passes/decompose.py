"""Decompose: the Dynamo graph -> a functional core-ATen *shadow graph* on fake tensors.

The shadow graph is for analysis only; the program that runs is the (rewritten) Dynamo graph. To
map the analysis back without guessing, the decomposition interprets the Dynamo graph node by node
and brackets every Dynamo node with two identity custom ops that survive decomposition:

* ``autotp.edge(x, dst, leaf, sub)`` on every tensor a Dynamo node *reads* (``dst`` = the Dynamo
  node's index, ``leaf`` = the ordinal of the Node argument in ``map_arg`` order, ``sub`` = the
  tensor's position inside that argument's value). Edges are the only places where the solver may
  change a placement, i.e. where the rewrite may insert a collective.
* ``autotp.mark(x, src, sub)`` on every tensor a Dynamo node *produces*. A mark's placement is the
  placement of that Dynamo output.

Everything between a node's edges and its marks is the node's ATen decomposition; it must run on
local shards unchanged (or with a local rewrite a rule names). The table is torch's core-ATen
decomposition minus scaled-dot-product attention, which stays one node with one head-dim rule.

Runs in a fresh ``FakeTensorMode`` (no real data is touched), with ``preserve_node_meta`` so every
ATen node carries ``from_node`` / ``stack_trace`` back to its Dynamo origin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import Tensor
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree


@torch.library.custom_op("autotp::edge", mutates_args=())
def edge(x: Tensor, dst: int, leaf: int, sub: int) -> Tensor:
    """Analysis-only identity: tensor ``x`` flowing into Dynamo node ``dst``."""
    return x.clone()


@edge.register_fake
def _edge_fake(x: Tensor, dst: int, leaf: int, sub: int) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("autotp::mark", mutates_args=())
def mark(x: Tensor, src: int, sub: int) -> Tensor:
    """Analysis-only identity: output ``sub`` of Dynamo node ``src``."""
    return x.clone()


@mark.register_fake
def _mark_fake(x: Tensor, src: int, sub: int) -> Tensor:
    return torch.empty_like(x)


EDGE = torch.ops.autotp.edge.default
MARK = torch.ops.autotp.mark.default


@dataclass
class ShadowGraph:
    """The ATen shadow graph plus the tables that tie it to the Dynamo graph."""

    dynamo: torch.fx.GraphModule
    aten: torch.fx.GraphModule
    dynamo_nodes: list[torch.fx.Node]
    example_inputs: list[Any]
    # ATen node -> index of the Dynamo node it belongs to (edges: their consumer; marks: producer)
    owner: dict[torch.fx.Node, int] = field(default_factory=dict)
    # (dynamo index, leaf, sub) -> edge node ; (dynamo index, sub) -> mark node
    edges: dict[tuple[int, int, int], torch.fx.Node] = field(default_factory=dict)
    marks: dict[tuple[int, int], torch.fx.Node] = field(default_factory=dict)
    # ATen placeholder i <-> Dynamo placeholder i (same order as example_inputs)
    placeholders: list[tuple[torch.fx.Node, torch.fx.Node]] = field(default_factory=list)


def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    for op in list(table):
        if "scaled_dot_product" in str(op):
            del table[op]
    return table


class _Bracketing(torch.fx.Interpreter):
    """Runs the Dynamo graph, wrapping each node's tensor inputs in edges and outputs in marks."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def run_node(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            if n.op == "placeholder":
                return super().run_node(n)
            dst = self.index[n]
            leaf_counter = iter(range(1 << 30))

            def fetch(m: torch.fx.Node) -> Any:
                leaf = next(leaf_counter)
                value = self.env[m]
                flat, spec = pytree.tree_flatten(value)
                flat = [edge(v, dst, leaf, sub) if isinstance(v, Tensor) else v for sub, v in enumerate(flat)]
                return pytree.tree_unflatten(flat, spec)

            args = torch.fx.node.map_arg(n.args, fetch)
            kwargs = torch.fx.node.map_arg(n.kwargs, fetch)
            result = getattr(self, n.op)(n.target, args, kwargs)
            if n.op == "output":
                return result
            flat, spec = pytree.tree_flatten(result)
            flat = [mark(v, dst, sub) if isinstance(v, Tensor) else v for sub, v in enumerate(flat)]
            return pytree.tree_unflatten(flat, spec)


def decompose(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> ShadowGraph:
    """Trace ``gm`` on fake copies of ``example_inputs`` into a bracketed core-ATen graph."""
    interpreter = _Bracketing(gm)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, Tensor) else _concrete(x) for x in example_inputs]

    def run(*args: Any) -> Any:
        return interpreter.run(*args)

    with fake_mode, torch.fx.traceback.preserve_node_meta():
        aten = make_fx(
            torch.func.functionalize(run, remove="mutations_and_views"),
            decomposition_table=decomposition_table(),
        )(*fake_inputs)

    dynamo_nodes = list(gm.graph.nodes)
    shadow = ShadowGraph(dynamo=gm, aten=aten, dynamo_nodes=dynamo_nodes, example_inputs=list(example_inputs))
    name_to_index = {n.name: i for i, n in enumerate(dynamo_nodes)}
    aten_ph = [n for n in aten.graph.nodes if n.op == "placeholder"]
    dyn_ph = [n for n in dynamo_nodes if n.op == "placeholder"]
    shadow.placeholders = list(zip(aten_ph, dyn_ph, strict=True))
    pending: list[torch.fx.Node] = []
    for n in aten.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is EDGE:
            dst, leaf, sub = n.args[1], n.args[2], n.args[3]
            shadow.edges[(dst, leaf, sub)] = n
            shadow.owner[n] = dst
        elif n.target is MARK:
            src, sub = n.args[1], n.args[2]
            shadow.marks[(src, sub)] = n
            shadow.owner[n] = src
            for p in pending:
                shadow.owner.setdefault(p, src)
            pending.clear()
        else:
            origin = _origin_name(n)
            if origin in name_to_index:
                shadow.owner[n] = name_to_index[origin]
            else:
                pending.append(n)
    return shadow


def _concrete(x: Any) -> Any:
    """A dynamic-shape graph receives SymInts for its size inputs; analysis runs on their current
    values (placements do not depend on sizes, and the rewritten graph keeps the symbols)."""
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else int(x.node.shape_env.size_hint(x.node.expr))
    return x


def _origin_name(n: torch.fx.Node) -> str | None:
    sources = n.meta.get("from_node") or []
    return getattr(sources[0], "name", None) if sources else None
