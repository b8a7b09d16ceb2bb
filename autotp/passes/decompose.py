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

import functools
import itertools
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
    # edges into an argument that their Dynamo node writes in place: the solver keeps them
    # identity, so the write lands in the tensor later readers see
    inplace_edges: set[torch.fx.Node] = field(default_factory=set)


@functools.cache
def decomposition_table() -> dict:
    """Core ATen decompositions minus SDPA (kept whole: the attention rules place it). Built once
    per process (it walks every registered op); callers must not mutate it."""
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
    """Decompose ``gm`` into a bracketed core-ATen shadow graph (see the module docstring).

    Node by node with memoization (:func:`decompose_by_node`) when every node is functional, which
    makes a model of ``L`` repeated blocks cost one block's tracing plus ``L`` cheap graph copies;
    the whole graph in one functionalized trace (:func:`decompose_whole`) when some node mutates
    a tensor or global state, because only a whole-graph trace sees the aliasing."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):  # a traced grad-mode switch must not leak
        try:
            return decompose_by_node(gm, example_inputs)
        except NotNodeLocal:
            return decompose_whole(gm, example_inputs)


def decompose_whole(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> ShadowGraph:
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


# --------------------------------------------------------------------------------------------------
# Node by node, memoized
# --------------------------------------------------------------------------------------------------


class NotNodeLocal(Exception):
    """A node whose decomposition is not a function of its own inputs (it mutates)."""


#: Dynamo-graph targets that change global state for the nodes after them.
_GLOBAL_STATE = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast", "set_grad_enabled",
                 "_enter_inference_mode", "_exit_inference_mode", "manual_seed")


@dataclass
class _NodeTrace:
    """One Dynamo node decomposed in isolation: an ATen graph over its flat tensor inputs, and how
    its flat outputs rebuild the node's value (:data:`_TENSOR` in ``values`` = the next graph output)."""

    graph: torch.fx.GraphModule
    spec: Any
    values: list[Any]
    mutated: frozenset[int] = frozenset()  # positions (among tensor inputs) the node writes in place


_TENSOR = object()  # in _NodeTrace.values: "the next tensor output of the trace"


class _Ref:
    """A tensor in the node-by-node walk: the ATen node that holds it and its (fake) value, which is
    only read for metadata and shared by every copy of the same trace."""

    __slots__ = ("node", "val")

    def __init__(self, node: torch.fx.Node, val: Tensor) -> None:
        self.node, self.val = node, val


def _tensor_key(t: Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.requires_grad)


def _node_key(n: torch.fx.Node, flat: list[Any], spec: Any) -> tuple | None:
    """What a node's decomposition depends on: op, target, argument structure, tensor metadata,
    constants. (Arguments never alias: every tensor argument is its own edge.) None when a constant
    is unhashable."""
    parts: list[Any] = []
    for v in flat:
        if isinstance(v, _Ref):
            parts.append(("T", _tensor_key(v.val)))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            parts.append((type(v), v))
    return (n.op, n.target, spec, tuple(parts), torch.is_grad_enabled())


def _call(n: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)


def _trace_node(n: torch.fx.Node, flat: list[Any], spec: Any, fake_mode: FakeTensorMode,
                table: dict) -> _NodeTrace:
    tensor_positions = [i for i, v in enumerate(flat) if isinstance(v, _Ref)]
    holder: dict[str, Any] = {}

    def run(*tensors: Tensor) -> list[Tensor]:
        leaves = list(flat)
        for i, t in zip(tensor_positions, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = _call(n, args, kwargs)
        out_flat, out_spec = pytree.tree_flatten(out)
        holder["spec"] = out_spec
        holder["values"] = [_TENSOR if isinstance(v, Tensor) else v for v in out_flat]
        return [v for v in out_flat if isinstance(v, Tensor)]

    with fake_mode:
        metas = [flat[i].val for i in tensor_positions]
        fakes = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)
                 for v in metas]
        graph = make_fx(torch.func.functionalize(run, remove="mutations_and_views"),
                        decomposition_table=table)(*fakes)
    inputs = [m for m in graph.graph.nodes if m.op == "placeholder"]
    mutated = set()
    for m in graph.graph.nodes:
        if m.op == "call_function" and m.target is torch.ops.aten.copy_.default and m.args[0] in inputs:
            mutated.add(inputs.index(m.args[0]))  # functionalization writes the new value back
        elif m.op == "call_function" and isinstance(m.target, torch._ops.OpOverload) and m.target._schema.is_mutable:
            raise NotNodeLocal(f"{n.format_node()} mutates through {m.target}")
    return _NodeTrace(graph=graph, spec=holder["spec"], values=holder["values"], mutated=frozenset(mutated))


def decompose_by_node(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> ShadowGraph:
    """Build the shadow graph by decomposing each Dynamo node on its own and copying the result.

    Each node's decomposition depends only on its target, its constants and its inputs' metadata
    (shape, stride, dtype, device, requires_grad, aliasing among its arguments), so nodes with equal
    keys share one trace: the cost is one trace per *distinct* node plus a copy per node. A node
    that writes one of its inputs in place (``add_``, ``index_copy_``) is traced functionally and
    its edge into that input is recorded in ``inplace_edges``: the solver may not redistribute it,
    so the local write lands in the very tensor later readers of that value see, with the
    placement they expect. A node that mutates otherwise, or changes global state, raises
    :class:`NotNodeLocal` and :func:`decompose` falls back to the whole-graph trace."""
    return _NodeByNode(gm, example_inputs).build()


class _NodeByNode:
    """The state of :func:`decompose_by_node`: the ATen graph being built, the traces by key, and
    the value of every Dynamo node seen so far (tensors as :class:`_Ref`)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        self.table = decomposition_table()
        self.memo: dict[tuple, _NodeTrace] = {}
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.constants = itertools.count()
        self.env: dict[torch.fx.Node, Any] = {}
        self.shadow = ShadowGraph(dynamo=gm, aten=None, dynamo_nodes=list(gm.graph.nodes),  # type: ignore[arg-type]
                                  example_inputs=list(example_inputs))

    def build(self) -> ShadowGraph:
        shadow = self.shadow
        for dst, n in enumerate(shadow.dynamo_nodes):
            if n.op == "placeholder":
                x = shadow.example_inputs[len(shadow.placeholders)]
                ph = self.graph.placeholder(n.name)
                ph.meta["stack_trace"] = n.meta.get("stack_trace")
                shadow.placeholders.append((ph, n))
                self.env[n] = _produced(ph, self.fake_mode.from_tensor(x)) if isinstance(x, Tensor) else _concrete(x)
                continue
            if n.op not in ("call_function", "call_method", "output"):
                raise NotNodeLocal(f"{n.op} node {n.name}")
            if n.op == "call_function" and any(name in str(getattr(n.target, "__name__", n.target))
                                               for name in _GLOBAL_STATE):
                raise NotNodeLocal(f"{n.name} changes global state")
            args, kwargs = self.bracket_inputs(n, dst)
            if n.op == "output":
                flat_out, spec_out = pytree.tree_flatten(args[0])
                self.graph.output(pytree.tree_unflatten(
                    [v.node if isinstance(v, _Ref) else v for v in flat_out], spec_out))
                break
            flat, spec = pytree.tree_flatten((args, kwargs))
            if not any(isinstance(v, _Ref) for v in flat) and not _makes_tensor(n):
                self.env[n] = _call(n, args, kwargs)  # Python arithmetic on sizes, getattr on a tuple, ...
                continue
            key = _node_key(n, flat, spec)
            traced = self.memo.get(key) if key is not None else None
            if traced is None:
                traced = _trace_node(n, flat, spec, self.fake_mode, self.table)
                if key is not None:
                    self.memo[key] = traced
            self.env[n] = self.copy_trace(n, dst, traced, [v.node for v in flat if isinstance(v, _Ref)])
        shadow.aten = torch.fx.GraphModule(self.root, self.graph)
        return shadow

    def bracket_inputs(self, n: torch.fx.Node, dst: int) -> tuple[Any, Any]:
        """``n``'s arguments with an edge on every tensor leaf of every Node argument (map_arg order)."""
        leaf_counter = itertools.count()

        def fetch(m: torch.fx.Node) -> Any:
            leaf = next(leaf_counter)
            flat_in, spec_in = pytree.tree_flatten(self.env[m])
            out = []
            for sub, v in enumerate(flat_in):
                if isinstance(v, _Ref):
                    e = self.graph.call_function(EDGE, (v.node, dst, leaf, sub))
                    self.shadow.edges[(dst, leaf, sub)] = e
                    self.shadow.owner[e] = dst
                    v = _produced(e, v.val)
                out.append(v)
            return pytree.tree_unflatten(out, spec_in)

        return torch.fx.node.map_arg(n.args, fetch), torch.fx.node.map_arg(n.kwargs, fetch)

    def copy_trace(self, n: torch.fx.Node, dst: int, traced: _NodeTrace, edges: list[torch.fx.Node]) -> Any:
        """Copy ``traced`` into the graph with its inputs bound to ``edges``; mark every tensor
        output; return the node's value."""
        self.shadow.inplace_edges.update(edges[k] for k in traced.mutated)
        inputs = iter(edges)
        mapping: dict[torch.fx.Node, torch.fx.Node] = {}
        outputs: list[torch.fx.Node] = []
        stack = n.meta.get("stack_trace")
        for m in traced.graph.graph.nodes:
            if m.op == "placeholder":
                mapping[m] = next(inputs)
            elif m.op == "output":
                outputs = list(m.args[0])
            elif m.target is torch.ops.aten.copy_.default and m.args[0].op == "placeholder":
                continue  # an in-place write-back: the edge is pinned instead (see inplace_edges)
            elif m.op == "get_attr":
                name = f"_constant{next(self.constants)}"
                setattr(self.root, name, getattr(traced.graph, m.target))
                mapping[m] = self.graph.get_attr(name)
                mapping[m].meta = dict(m.meta)
            else:
                copy = self.graph.node_copy(m, mapping.__getitem__)
                copy.meta = {"val": m.meta.get("val"), "stack_trace": stack}
                self.shadow.owner[copy] = dst
                mapping[m] = copy
        result, k = [], 0
        for sub, v in enumerate(traced.values):
            if v is _TENSOR:
                src = outputs[k]
                k += 1
                mk = self.graph.call_function(MARK, (mapping[src], dst, sub))
                self.shadow.marks[(dst, sub)] = mk
                self.shadow.owner[mk] = dst
                mk.meta["stack_trace"] = stack
                v = _produced(mk, mapping[src].meta["val"] if src.op == "placeholder" else src.meta["val"])
            result.append(v)
        return pytree.tree_unflatten(result, traced.spec)


def _produced(node: torch.fx.Node, val: Tensor) -> _Ref:
    node.meta["val"] = val
    return _Ref(node, val)


def _makes_tensor(n: torch.fx.Node) -> bool:
    value = n.meta.get("example_value")
    flat, _ = pytree.tree_flatten(value)
    return any(isinstance(v, Tensor) for v in flat)


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
