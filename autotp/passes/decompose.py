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
decomposition minus scaled-dot-product attention, which stays one node with one head-dim rule,
and ``empty_like``, which keeps its input's placement (:func:`decomposition_table`).

Runs in a fresh ``FakeTensorMode`` (no real data is touched), with ``preserve_node_meta`` so every
ATen node carries ``from_node`` / ``stack_trace`` back to its Dynamo origin.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from autotp.compat import (
    FakeTensor,
    FakeTensorMode,
    LazyGraphModule,
    OpOverload,
    core_aten_decompositions,
    lazy_traced_graphs,
    pytree,
    traced_node_count,
)
from autotp.ops.registry import CONSTANT_VALUE


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
    #: how the dims whose size is symbolic were found (see :func:`mark_symbolic_dims`); each such
    #: ATen node carries them as ``meta["autotp_symbolic_dims"]``
    symbolic_sizes: str = "static graph"


@functools.cache
def decomposition_table() -> dict:
    """Core ATen decompositions minus SDPA (kept whole: the attention rules place it) and
    ``empty_like`` (kept whole so that its result keeps its input's placement: decomposed, it is a
    factory of no input, replicated, and the dropout SDPA's math kernel draws as
    ``empty_like(attn).bernoulli_(1 - p)`` could not follow the attention's head shards). Built once
    per process (it walks every registered op); callers must not mutate it."""
    table = dict(core_aten_decompositions())
    for op in list(table):
        if "scaled_dot_product" in str(op) or str(op).startswith("aten.empty_like"):
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


def decompose(gm: torch.fx.GraphModule, example_inputs: list[Any], *, batched: bool = True) -> ShadowGraph:
    """Decompose ``gm`` into a bracketed core-ATen shadow graph (see the module docstring).

    Node by node with memoization (:func:`decompose_by_node`) when every node is functional, which
    makes a model of ``L`` repeated blocks cost one block's tracing plus ``L`` cheap graph copies;
    the whole graph in one functionalized trace (:func:`decompose_whole`) when some node mutates
    a tensor or global state, because only a whole-graph trace sees the aliasing.

    A dynamic-shape graph (Dynamo made some sizes symbolic, e.g. the sequence length) is decomposed
    at the current sizes and then once more at shifted sizes, to find which dims of which values
    are symbolic (:func:`mark_symbolic_dims`): the solver never shards those, because the graph is
    reused for every length and a length that does not divide by the world size could not be split.

    ``batched`` (default): each pass traces its predicted distinct nodes in one ``make_fx`` call
    (:meth:`_NodeByNode.prefetch`); False traces each distinct node alone, the same shadow graph."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):  # a traced grad-mode switch must not leak
        try:
            builder = _NodeByNode(gm, example_inputs, {}, {}, batched=batched)
            shadow = builder.build()
            nodes_at = builder.nodes_at
        except NotNodeLocal:
            shadow = decompose_whole(gm, example_inputs)

            def nodes_at(resized: dict[int, Any], shifted: dict[Any, int] | None = None) -> list[Any]:
                return list(decompose_whole(gm, example_inputs, resized).aten.graph.nodes)
        mark_symbolic_dims(shadow, nodes_at)
    return shadow


def decompose_whole(gm: torch.fx.GraphModule, example_inputs: list[Any],
                    resized: dict[int, Any] | None = None) -> ShadowGraph:
    """Trace ``gm`` on fake copies of ``example_inputs`` into a bracketed core-ATen graph
    (``resized``: see :func:`_fake_input`)."""
    interpreter = _Bracketing(gm)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_inputs = [_fake_input(fake_mode, x, (resized or {}).get(i)) for i, x in enumerate(example_inputs)]

    def run(*args: Any) -> Any:
        return interpreter.run(*args)

    with fake_mode, torch.fx.traceback.preserve_node_meta(), lazy_traced_graphs():  # code written only if read
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


def _not_node_local(n: torch.fx.Node) -> str | None:
    """Why the node-by-node walk cannot decompose ``n`` on its own (None: it can): a node that is not
    a call, or one that changes global state (grad mode, autocast), which only a whole-graph
    trace sees applied to the nodes after it."""
    if n.op not in ("call_function", "call_method", "output"):
        return f"{n.op} node {n.name}"
    if n.op == "call_function" and any(name in str(getattr(n.target, "__name__", n.target)) for name in _GLOBAL_STATE):
        return f"{n.name} changes global state"
    return None


def _tensor_key(t: Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.requires_grad)


def _node_key(n: torch.fx.Node, flat: list[Any], spec: Any) -> tuple | None:
    """What a node's decomposition depends on: op, target, argument structure, tensor metadata,
    constants (a slice by its bounds). (Arguments never alias: every tensor argument is its own
    edge.) None when a constant is unhashable."""
    parts: list[Any] = []
    for v in flat:
        if isinstance(v, _Ref):
            parts.append(("T", _tensor_key(v.val)))
        elif isinstance(v, slice):  # unhashable before Python 3.12: rotary's x[..., :half] in every layer
            parts.append((slice, (v.start, v.stop, v.step)))
            try:
                hash(parts[-1])
            except TypeError:
                return None
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


def _fresh_fake(v: Any) -> Tensor:
    """A fresh fake tensor (under the caller's fake mode) with ``v``'s layout and ``requires_grad``:
    a node's own input in its trace, sharing no storage with any other."""
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)


def _mutates(m: torch.fx.Node) -> bool:
    """Whether a traced ATen node writes through a mutable op (functionalization left it)."""
    return m.op == "call_function" and isinstance(m.target, OpOverload) and m.target._schema.is_mutable


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

    with fake_mode, lazy_traced_graphs():  # the trace is read and copied, never run: no Python code
        metas = [flat[i].val for i in tensor_positions]
        fakes = [_fresh_fake(v) for v in metas]
        graph = make_fx(torch.func.functionalize(run, remove="mutations_and_views"),
                        decomposition_table=table)(*fakes)
    inputs = [m for m in graph.graph.nodes if m.op == "placeholder"]
    mutated = set()
    for m in graph.graph.nodes:
        if m.op == "call_function" and m.target is torch.ops.aten.copy_.default and m.args[0] in inputs:
            mutated.add(inputs.index(m.args[0]))  # functionalization writes the new value back
        elif _mutates(m):
            raise NotNodeLocal(f"{n.format_node()} mutates through {m.target}")
    return _NodeTrace(graph=graph, spec=holder["spec"], values=holder["values"], mutated=frozenset(mutated))


#: rounds of :meth:`_NodeByNode.prefetch` (each one ``make_fx`` call): the first traces what
#: Dynamo's example values predict; each later one what the traces so far show instead (a
#: decomposed view is a contiguous ``*_copy``, so the nodes after a transpose see other strides)
_WAVES = 4


def _traced_value(traced: _NodeTrace, flat: list[Any]) -> Any:
    """The value the walk gets from copying ``traced`` (:meth:`_NodeByNode.copy_trace`), as
    :class:`_Ref` s without nodes: a traced output's ``val``, or the argument it passes through."""
    inputs = [v for v in flat if isinstance(v, _Ref)]
    placeholders = [m for m in traced.graph.graph.nodes if m.op == "placeholder"]
    outputs = iter(next(m for m in reversed(traced.graph.graph.nodes) if m.op == "output").args[0])
    result = []
    for v in traced.values:
        if v is _TENSOR:
            src = next(outputs)
            v = inputs[placeholders.index(src)] if src.op == "placeholder" else _Ref(None, src.meta["val"])  # type: ignore[arg-type]
        result.append(v)
    return pytree.tree_unflatten(result, traced.spec)


def _layouts(value: Any) -> list[Any]:
    """What of a (predicted or traced) value the keys of later nodes read."""
    return [("T", _tensor_key(v.val)) if isinstance(v, _Ref) else (type(v), v) for v in pytree.tree_leaves(value)]


class _Layout:
    """A predicted tensor (:meth:`_NodeByNode.prefetch`): what :func:`_tensor_key` and
    :func:`_trace_node` read of one, sizes concrete (``size`` maps a symbolic size to an int)."""

    __slots__ = ("shape", "_stride", "dtype", "device", "requires_grad")

    def __init__(self, shape: Any, stride: Any, like: Tensor, size: Callable[[Any], int] = int) -> None:
        self.shape = torch.Size(size(s) for s in shape)
        if stride is None:  # contiguous
            stride, step = [], 1
            for s in reversed(self.shape):
                stride.append(step)
                step *= max(s, 1)
            stride.reverse()
        self._stride = tuple(size(s) for s in stride)
        self.dtype, self.device, self.requires_grad = like.dtype, like.device, like.requires_grad

    def stride(self) -> tuple[int, ...]:
        return self._stride


def _trace_batch(items: list[tuple[tuple, tuple[torch.fx.Node, list[Any], Any]]], fake_mode: FakeTensorMode,
                 table: dict) -> dict[tuple, _NodeTrace]:
    """Trace several Dynamo nodes in ONE ``make_fx`` call and split the joint graph into the
    :class:`_NodeTrace` each would have had alone (``items``: key -> the node, its flat
    arguments and their spec, as :func:`_trace_node` takes them).

    Why: the per-trace setup (functionalization, the proxy mode, the GraphModule) dominates a small
    node's trace (measured: ``make_fx`` of one ``add`` ~4 ms, of one ``linear`` ~9 ms, 100 ops in
    one trace ~2.3 ms per op). Each node reads its own fresh placeholders (fakes made as
    :func:`_trace_node` makes them), so no op of one node reads another's values; the traced
    function counts the recorded graph's nodes before and after each node's call
    (:func:`autotp.compat.traced_node_count`), and the nodes in between are that node's
    decomposition. Placeholder and op names are given back as a lone trace names them (the copies
    in the shadow graph are named after them). A node left out of the result (the walk traces it
    alone, as before): one whose ops read anything outside its window, that mutates through an op
    (:class:`NotNodeLocal` is the lone trace's to raise), or that writes an input (the
    functionalized write-back comes at the end of the whole function, not in its window). If the
    joint trace fails, nothing is returned."""
    plans = []
    fakes: list[Tensor] = []
    with fake_mode:
        for key, (n, flat, spec) in items:
            positions = [i for i, v in enumerate(flat) if isinstance(v, _Ref)]
            plans.append((key, n, flat, spec, positions, len(fakes)))
            for i in positions:
                v = flat[i].val
                fakes.append(_fresh_fake(v))
    windows: list[tuple[int, int, Any, list[Any], int]] = []

    def run(*tensors: Tensor) -> list[Tensor]:
        outs: list[Tensor] = []
        for _, n, flat, spec, positions, first in plans:
            start = traced_node_count()
            leaves = list(flat)
            for k, i in enumerate(positions):
                leaves[i] = tensors[first + k]
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            out_flat, out_spec = pytree.tree_flatten(_call(n, args, kwargs))
            produced = [v for v in out_flat if isinstance(v, Tensor)]
            windows.append((start, traced_node_count(), out_spec,
                            [_TENSOR if isinstance(v, Tensor) else v for v in out_flat], len(produced)))
            outs.extend(produced)
        return outs

    try:
        with fake_mode, lazy_traced_graphs():
            joint = make_fx(torch.func.functionalize(run, remove="mutations_and_views"), decomposition_table=table)(*fakes)
    except Exception:
        return {}
    nodes = list(joint.graph.nodes)
    placeholders = [m for m in nodes if m.op == "placeholder"]
    output = nodes[-1]
    tail = nodes[windows[-1][1]:-1] if windows else []
    if len(placeholders) != len(fakes) or any(m.target is not torch.ops.aten.copy_.default or m.args[0].op != "placeholder"
                                              for m in tail):
        return {}
    written = {m.args[0] for m in tail}  # functionalization's write-backs into the nodes' inputs
    results: dict[tuple, _NodeTrace] = {}
    k = 0
    for (key, _n, _flat, _spec, positions, first), (start, end, out_spec, values, count) in zip(plans, windows, strict=True):
        own_inputs = placeholders[first:first + len(positions)]
        outs = list(output.args[0][k:k + count])
        k += count
        body = nodes[start:end]
        if written & set(own_inputs) or any(_mutates(m) for m in body):
            continue
        graph = torch.fx.Graph()
        mapping: dict[torch.fx.Node, torch.fx.Node] = {}
        for i, m in enumerate(own_inputs):
            mapping[m] = graph.placeholder(f"arg{i}_1")
            mapping[m].meta = dict(m.meta)
        try:
            for m in body:
                copy = graph.create_node(m.op, m.target, torch.fx.node.map_arg(m.args, mapping.__getitem__),
                                         torch.fx.node.map_arg(m.kwargs, mapping.__getitem__),
                                         re.sub(r"_\d+$", "", m.name), m.type)
                copy.meta = dict(m.meta)
                mapping[m] = copy
            graph.output([mapping[o] for o in outs])
        except KeyError:  # an op read a value outside its node's window
            continue
        with lazy_traced_graphs():
            results[key] = _NodeTrace(graph=LazyGraphModule(joint, graph), spec=out_spec, values=values)
    return results


def decompose_by_node(gm: torch.fx.GraphModule, example_inputs: list[Any],
                      resized: dict[int, Any] | None = None) -> ShadowGraph:
    """Build the shadow graph by decomposing each Dynamo node on its own and copying the result.

    Each node's decomposition depends only on its target, its constants and its inputs' metadata
    (shape, stride, dtype, device, requires_grad, aliasing among its arguments), so nodes with equal
    keys share one trace: the cost is one trace per *distinct* node plus a copy per node. A node
    that writes one of its inputs in place (``add_``, ``index_copy_``) is traced functionally and
    its edge into that input is recorded in ``inplace_edges``: the solver may not redistribute it,
    so the local write lands in the very tensor later readers of that value see, with the
    placement they expect. A node that mutates otherwise, or changes global state, raises
    :class:`NotNodeLocal` and :func:`decompose` falls back to the whole-graph trace. ``resized``:
    see :func:`_fake_input`. (:func:`decompose` keeps the builder, whose traces by node key its
    shifted-size second pass shares: :meth:`_NodeByNode.nodes_at`.)"""
    return _NodeByNode(gm, example_inputs, resized or {}, {}).build()


class _NodeByNode:
    """The state of :func:`decompose_by_node`: the ATen graph being built, the traces by key, and
    the value of every Dynamo node seen so far (tensors as :class:`_Ref`)."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], resized: dict[int, Any],
                 memo: dict[tuple, _NodeTrace], like: _NodeByNode | None = None, *, batched: bool = True,
                 shifted: dict[Any, int] | None = None) -> None:
        # ``like``: the build at the current sizes whose fake mode and fake inputs (all but the
        # resized ones) this one shares, and which it only records (:meth:`nodes_at`)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=False) if like is None else like.fake_mode
        self.fake_inputs: list[Any] = []  # by placeholder position
        self.like = like
        self.resized = resized
        self.batched = batched  # trace the predicted distinct nodes together first (:meth:`prefetch`)
        self.shifted = shifted  # the symbol values ``resized`` was made at (predicts the walk's sizes)
        self.traces = 0  # make_fx calls this build made (batched and alone)
        self.table = decomposition_table()
        self.memo = memo
        self.graph: Any = torch.fx.Graph() if like is None else _Recorder()
        self.root = torch.nn.Module()
        self.constants = itertools.count()
        self.env: dict[torch.fx.Node, Any] = {}
        self.shadow = ShadowGraph(dynamo=gm, aten=None, dynamo_nodes=list(gm.graph.nodes),  # type: ignore[arg-type]
                                  example_inputs=list(example_inputs))

    def build(self) -> ShadowGraph:
        self.walk()
        self.shadow.aten = LazyGraphModule(self.root, self.graph)  # code written only if read (a trace folder)
        return self.shadow

    def nodes_at(self, resized: dict[int, Any], shifted: dict[Any, int] | None = None) -> list[Any]:
        """The nodes this build made, in order, as they come out at the sizes ``resized`` gives
        (see :func:`_fake_input`): each with ``op``, ``target`` and ``meta["val"]``, which is all
        :func:`mark_symbolic_dims` compares. Shares this build's traces (a node whose inputs'
        sizes do not move, in a decode step all but attention over the cache, is not traced
        again), its fake mode and its unresized fake inputs (a parameter is faked once), and
        records the nodes instead of building a graph (fx's naming, argument checks and use lists
        were most of the second build's cost after its traces)."""
        other = _NodeByNode(self.shadow.dynamo, self.shadow.example_inputs, resized, self.memo, like=self,
                            batched=self.batched, shifted=shifted)
        other.walk()
        self.traces += other.traces
        return other.graph.nodes

    def walk(self) -> None:
        """Decompose every Dynamo node into ``self.graph``, in order."""
        shadow = self.shadow
        if self.batched:
            self.prefetch()
        for dst, n in enumerate(shadow.dynamo_nodes):
            if n.op == "placeholder":
                position = len(shadow.placeholders)
                if self.like is not None and position not in self.resized:
                    x = self.like.fake_inputs[position]
                else:
                    x = _fake_input(self.fake_mode, shadow.example_inputs[position], self.resized.get(position))
                self.fake_inputs.append(x)
                ph = self.graph.placeholder(n.name)
                ph.meta["stack_trace"] = n.meta.get("stack_trace")
                shadow.placeholders.append((ph, n))
                self.env[n] = _produced(ph, x) if isinstance(x, Tensor) else x
                continue
            refused = _not_node_local(n)
            if refused is not None:
                raise NotNodeLocal(refused)
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
                self.traces += 1
                if key is not None:
                    self.memo[key] = traced
            self.env[n] = self.copy_trace(n, dst, traced, [v.node for v in flat if isinstance(v, _Ref)])

    def prefetch(self) -> None:
        """Trace every distinct node the walk is predicted to meet, together (:func:`_trace_batch`),
        into ``self.memo``.

        Why: a trace's fixed cost dominates a small node's (measured: the 150m startup model's
        shape, static prefill 45 lone traces 0.258 -> one joint trace 0.193 CPU s; tiny Llama
        prefill 73 -> 1, 0.397 -> 0.169; docs/architecture.md "Decomposing node by node").

        The prediction walks the Dynamo graph on metadata only: placeholders as the walk fakes
        them, a traced node's value as its trace gives it, every other value with the sizes of
        Dynamo's ``meta["example_value"]`` at the current (or, for :meth:`nodes_at`, the shifted)
        symbol values and contiguous strides (functionalization turns every view into a
        ``*_copy``, so Dynamo's strides would mispredict every node after a transpose), and keys
        as :func:`_node_key` makes them. When a joint trace shows a guessed layout wrong, the
        prediction runs again on the traces so far (at most :data:`_WAVES` rounds). It is only a
        prediction: the walk stays authoritative, and a node whose actual key has no trace is
        traced alone there. The prediction stops at the first node it cannot follow (no example
        value, a node the walk rejects)."""
        for _ in range(_WAVES):
            pending, complete = self.predict()
            if len(pending) < 2:  # one node: the walk's lone trace costs the same
                return
            found = _trace_batch([(key, item[:3]) for key, item in pending.items()], self.fake_mode, self.table)
            self.traces += 1
            self.memo.update(found)
            if complete and len(found) == len(pending) and all(
                    _layouts(_traced_value(found[key], flat)) == _layouts(guess)
                    for key, (_, flat, _, guess) in pending.items()):
                return  # every guess was right: the next prediction would be the walk itself
            if not found:
                return

    def predict(self) -> tuple[dict[tuple, tuple[torch.fx.Node, list[Any], Any, Any]], bool]:
        """The keys the walk is predicted to trace, each with the node, its flat arguments, their
        spec and the guessed value (see :meth:`prefetch`); and whether the prediction reached the
        graph's output."""
        size = functools.partial(_evaluate, shifted=self.shifted) if self.shifted else _concrete
        env: dict[torch.fx.Node, Any] = {}
        pending: dict[tuple, tuple[torch.fx.Node, list[Any], Any, Any]] = {}
        position = 0
        for n in self.shadow.dynamo_nodes:
            try:
                if n.op == "placeholder":
                    x = self.shadow.example_inputs[position]
                    resized = self.resized.get(position)
                    position += 1
                    if isinstance(x, Tensor):
                        shape, stride = resized if resized is not None else (x.shape, x.stride())
                        env[n] = _Ref(None, _Layout(shape, stride, x))  # type: ignore[arg-type]
                    else:
                        env[n] = resized if resized is not None else _concrete(x)
                    continue
                if n.op not in ("call_function", "call_method"):
                    return pending, n.op == "output"
                if _not_node_local(n) is not None:  # the walk refuses it; running it here would, e.g.,
                    return pending, False  # switch grad mode for real (``_set_grad_enabled``)
                args = torch.fx.node.map_arg(n.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
                flat, spec = pytree.tree_flatten((args, kwargs))
                if not any(isinstance(v, _Ref) for v in flat) and not _makes_tensor(n):
                    env[n] = _call(n, args, kwargs)
                    continue
                key = _node_key(n, flat, spec)
                traced = self.memo.get(key) if key is not None else None
                if traced is not None:
                    env[n] = _traced_value(traced, flat)
                    continue
                # a decomposed view is a ``*_copy``: Dynamo's value gives the sizes, contiguous strides
                env[n] = pytree.tree_map(lambda v: _Ref(None, _Layout(v.shape, None, v, size))  # type: ignore[arg-type]
                                         if isinstance(v, Tensor) else size(v) if isinstance(v, torch.SymInt) else v,
                                         n.meta["example_value"])
                if key is not None:
                    pending.setdefault(key, (n, flat, spec, env[n]))
            except Exception:  # anything the prediction cannot follow: the walk traces the rest alone
                break
        return pending, False

    def bracket_inputs(self, n: torch.fx.Node, dst: int) -> tuple[Any, Any]:
        """``n``'s arguments with an edge on every tensor leaf of every Node argument (map_arg order)."""
        leaf_counter = itertools.count()

        def fetch(m: torch.fx.Node) -> Any:
            leaf = next(leaf_counter)
            value = self.env[m]
            if isinstance(value, _Ref):  # one tensor, most arguments: its own leaf (sub 0), no pytree walk
                return self.edge(value, dst, leaf, 0)
            flat_in, spec_in = pytree.tree_flatten(value)
            return pytree.tree_unflatten([self.edge(v, dst, leaf, sub) if isinstance(v, _Ref) else v
                                          for sub, v in enumerate(flat_in)], spec_in)

        return torch.fx.node.map_arg(n.args, fetch), torch.fx.node.map_arg(n.kwargs, fetch)

    def edge(self, v: _Ref, dst: int, leaf: int, sub: int) -> _Ref:
        e = self.graph.call_function(EDGE, (v.node, dst, leaf, sub))
        self.shadow.edges[(dst, leaf, sub)] = e
        self.shadow.owner[e] = dst
        return _produced(e, v.val)

    def copy_trace(self, n: torch.fx.Node, dst: int, traced: _NodeTrace, edges: list[torch.fx.Node]) -> Any:
        """Copy ``traced`` into the graph with its inputs bound to ``edges``; mark every tensor
        output; return the node's value."""
        self.shadow.inplace_edges.update(edges[k] for k in traced.mutated)
        inputs = iter(edges)
        mapping: dict[torch.fx.Node, torch.fx.Node] = {}
        outputs: list[torch.fx.Node] = []
        stack = n.meta.get("stack_trace")
        values = _constant_values(traced.graph, n)
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
                if m.target in values:
                    mapping[m].meta[CONSTANT_VALUE] = values[m.target]
            else:
                copy = self.graph.node_copy(m, mapping.__getitem__)
                copy.meta = {"val": m.meta.get("val"), "stack_trace": stack}
                if m.target in _CONSTANT_COPIES and CONSTANT_VALUE in copy.args[0].meta:  # a real constant's copy
                    copy.meta[CONSTANT_VALUE] = copy.args[0].meta[CONSTANT_VALUE]
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


class _Recorded:
    """A node of a recording build (:meth:`_NodeByNode.nodes_at`): op, target, arguments, meta."""

    __slots__ = ("op", "target", "args", "meta")

    def __init__(self, op: str, target: Any, args: tuple) -> None:
        self.op, self.target, self.args, self.meta = op, target, args, {}


class _Recorder:
    """Stands in for the ``torch.fx.Graph`` of a recording build: the nodes it would make, in order.
    A copied node's arguments are mapped one level deep (a copy's own ``args[0]`` is all the
    walk reads back: a lifted constant's value)."""

    def __init__(self) -> None:
        self.nodes: list[_Recorded] = []

    def _add(self, op: str, target: Any, args: tuple = ()) -> _Recorded:
        node = _Recorded(op, target, args)
        self.nodes.append(node)
        return node

    def placeholder(self, name: str) -> _Recorded:
        return self._add("placeholder", name)

    def get_attr(self, name: str) -> _Recorded:
        return self._add("get_attr", name)

    def call_function(self, target: Any, args: tuple) -> _Recorded:
        return self._add("call_function", target, args)

    def node_copy(self, node: torch.fx.Node, arg_transform: Any) -> _Recorded:
        return self._add(node.op, node.target,
                         tuple(arg_transform(a) if isinstance(a, torch.fx.Node) else a for a in node.args))

    def output(self, result: Any) -> _Recorded:
        return self._add("output", "output", (result,))


_CONSTANT_LIMIT = 64  # elements: index lists, not tables
#: ops a traced constant passes through before its use (a real constant is lifted by a copy)
_CONSTANT_COPIES = {torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift_fresh.default}


def _constant_values(traced: torch.fx.GraphModule, n: torch.fx.Node) -> dict[str, tuple[int, ...]]:
    """Attribute name -> flat values of each small integer constant of ``n``'s trace: a list index
    (Falcon's ``qkv[..., [-2], :]``) becomes one, and a rule needs its values to know which rows it
    reads. A constant with data gives its own; on the meta device (the planner) it holds none, and
    the values are the lists of ints in ``n``'s arguments, in order, where they match the
    constants one for one."""
    constants = [(m.target, getattr(traced, m.target)) for m in traced.graph.nodes if m.op == "get_attr"]
    constants = [(name, c) for name, c in constants if isinstance(c, Tensor) and c.numel() <= _CONSTANT_LIMIT
                 and not (c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool)]
    out = {name: tuple(int(v) for v in c.flatten().tolist()) for name, c in constants
           if c.device.type != "meta" and not isinstance(c, FakeTensor)}
    empty = [(name, c) for name, c in constants if name not in out]
    if not empty:  # nearly every node: no walk of its arguments
        return out
    lists = _int_lists((n.args, n.kwargs))
    if len(lists) == len(empty) and all(len(v) == c.numel() for v, (_, c) in zip(lists, empty, strict=True)):
        out.update((name, v) for v, (name, _) in zip(lists, empty, strict=True))
    return out


def _int_lists(arg: Any) -> list[tuple[int, ...]]:
    """The non-empty lists of ints inside ``arg`` (through tuples, lists and dicts), in order."""
    if isinstance(arg, list) and arg and all(type(k) is int for k in arg):
        return [tuple(arg)]
    if isinstance(arg, (tuple, list)):
        return [v for a in arg for v in _int_lists(a)]
    if isinstance(arg, dict):
        return [v for a in arg.values() for v in _int_lists(a)]
    return []


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


def _fake_input(fake_mode: FakeTensorMode, x: Any, resized: Any = None) -> Any:
    """The analysis value of one graph input: a fake copy of tensor ``x`` (with the sizes and
    strides ``resized`` gives, if any), or a size input's int (``resized``, or the SymInt's value)."""
    if not isinstance(x, Tensor):
        return resized if resized is not None else _concrete(x)
    if resized is None:
        return fake_mode.from_tensor(x)
    sizes, strides = resized
    with fake_mode:
        return torch.empty_strided(sizes, strides, dtype=x.dtype, device=x.device).requires_grad_(x.requires_grad)


# --------------------------------------------------------------------------------------------------
# Symbolic sizes
# --------------------------------------------------------------------------------------------------

#: ``node.meta`` key: the dims of an ATen value whose size is symbolic (a frozenset, or a tuple of
#: them for an op with several outputs)
SYMBOLIC_DIMS = "autotp_symbolic_dims"


def _symbols(gm: torch.fx.GraphModule) -> tuple[Any, dict[Any, int]] | None:
    """The shape environment of a dynamic-shape Dynamo graph and other values for its free size
    symbols (:func:`_shifted_values`); None for a static graph."""
    import sympy

    shape_env, free = None, set()
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        value = n.meta.get("example_value")
        sizes = list(value.shape) + list(value.stride()) if isinstance(value, Tensor) else [value]
        for s in sizes:
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Expr):
                shape_env = s.node.shape_env
                free |= shape_env.simplify(s.node.expr).free_symbols  # a symbol a guard fixed is no longer free
    if shape_env is None or not free:
        return None
    return shape_env, _shifted_values(shape_env, sorted(free, key=str))


#: how many assignments :func:`_shifted_values` tries before it settles for a partial one
_SHIFT_TRIES = 2048


def _shifted_values(shape_env: Any, symbols: list[Any]) -> dict[Any, int]:
    """Values for ``symbols`` at which the graph is still valid (every guard of ``shape_env`` holds,
    every symbol within its range) and which differ from the current ones, for as many symbols as
    possible: first every symbol + 1 (or - 1), then a bounded search (a guard such as
    ``Eq(batch * length, 16)`` admits only other factorizations). A symbol no tried assignment
    could move keeps its value; the graph's guards then hold it (almost) fixed."""
    import sympy

    current = {sym: int(shape_env.backed_var_to_val[sym]) for sym in symbols}
    guards = [shape_env.simplify(g.expr) for g in shape_env.guards]  # replacements applied (s17 -> s27*s77)

    def as_int(x: Any, unbounded: int) -> int:
        try:
            return int(x)
        except (TypeError, ValueError, AttributeError, OverflowError):  # +-oo (sympy's or torch's)
            return unbounded

    def bounds(sym: Any) -> tuple[int, int]:
        r = shape_env.var_to_range.get(sym)
        if r is None:
            return 0, 1 << 62
        return as_int(r.lower, 0), as_int(r.upper, 1 << 62)

    def valid(assign: dict[Any, int]) -> bool:
        if any(not (bounds(k)[0] <= v <= bounds(k)[1]) for k, v in assign.items()):
            return False
        subs = {k: sympy.Integer(v) for k, v in assign.items()}
        try:
            return all(bool(g.xreplace(subs) == sympy.true) for g in guards)
        except (TypeError, ValueError):
            return False

    for step in (1, -1):
        trial = {k: v + step for k, v in current.items()}
        if valid(trial):
            return trial
    choices = [[v + d for d in (1, -1, 2, -2)] + [c for c in range(2, 65) if abs(c - v) > 2] for v in current.values()]
    best = dict(current)
    for tries, combo in enumerate(itertools.product(*choices)):
        if tries >= _SHIFT_TRIES:
            break
        trial = dict(zip(current, combo, strict=True))
        if valid(trial):
            return trial  # every symbol moved
    for sym in symbols:  # one symbol at a time, the others where the best so far put them
        for value in choices[symbols.index(sym)]:
            trial = {**best, sym: value}
            if valid(trial):
                best = trial
                break
    return best


def _evaluate(size: Any, shifted: dict[Any, int]) -> int:
    if isinstance(size, torch.SymInt):
        return int(size.node.shape_env.simplify(size.node.expr).xreplace(shifted))
    return int(size)


def _resized_inputs(gm: torch.fx.GraphModule, shifted: dict[Any, int]) -> dict[int, Any]:
    """Per placeholder position with a symbolic size: its sizes and strides (tensors) or its value
    (size inputs) with every symbol at its shifted value."""
    out: dict[int, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        value = n.meta.get("example_value")
        if isinstance(value, Tensor):
            if any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
                out[i] = ([_evaluate(s, shifted) for s in value.shape], [_evaluate(s, shifted) for s in value.stride()])
        elif isinstance(value, torch.SymInt):
            out[i] = _evaluate(value, shifted)
    return out


def _differing_dims(a: Any, b: Any) -> Any:
    """Dims where two values of the same node differ in size (per output for a tuple)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() == b.dim():
        return frozenset(d for d, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return tuple(_differing_dims(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Tensor):
        return frozenset(range(a.dim()))  # shapes that do not even agree in rank: every dim is suspect
    return None


def _equal_sized_dims(value: Any, sizes: set[int]) -> Any:
    if isinstance(value, Tensor):
        return frozenset(d for d, s in enumerate(value.shape) if int(s) in sizes)
    if isinstance(value, (tuple, list)):
        return tuple(_equal_sized_dims(v, sizes) for v in value)
    return None


def mark_symbolic_dims(shadow: ShadowGraph, nodes_at: Callable[[dict[int, Any], dict[Any, int]], list[Any]]) -> None:
    """Record, on every ATen value of a dynamic-shape graph, the dims whose size is symbolic.

    Dynamo compiles a graph once and reuses it for every size its guards admit, but the shadow
    graph is traced at the current sizes, where a sequence of 8 tokens divides by 2. So the graph
    is decomposed a second time (``nodes_at``: the same decomposer, which returns the nodes it
    would make at the sizes of :func:`_resized_inputs`) with every size symbol shifted by one; the
    two ATen graphs are node-for-node the same program, and a dim whose size differs between them
    depends on a symbol. If the second decomposition fails or differs in structure,
    every dim whose size equals the current size of an input's symbolic dim is marked instead
    (conservative: such a dim may be symbolic), and ``shadow.symbolic_sizes`` says so."""
    found = _symbols(shadow.dynamo)
    if found is None:
        return
    _, shifted = found
    ours = list(shadow.aten.graph.nodes)
    reason = None
    try:
        other = nodes_at(_resized_inputs(shadow.dynamo, shifted), shifted)
        if len(other) != len(ours) or any(m.op != n.op or m.target != n.target for m, n in zip(ours, other, strict=True)):
            reason = "the graph decomposes differently at shifted sizes"
    except Exception as e:  # any failure only makes the marking conservative
        reason = f"decomposing at shifted sizes failed ({type(e).__name__})"
    if reason is None:
        for m, n in zip(ours, other, strict=True):
            dims = _differing_dims(m.meta.get("val"), n.meta.get("val"))
            if dims:
                m.meta[SYMBOLIC_DIMS] = dims
        shadow.symbolic_sizes = f"dynamic: symbolic dims found by decomposing at shifted sizes {_names(shifted)}"
        return
    current = {int(v) for v in found[0].backed_var_to_val.values()}
    sizes = {int(s.node.expr.xreplace(found[0].backed_var_to_val)) for ph in shadow.dynamo.graph.nodes
             if ph.op == "placeholder" and isinstance(ph.meta.get("example_value"), Tensor)
             for s in ph.meta["example_value"].shape if isinstance(s, torch.SymInt)} | current
    for m in ours:
        dims = _equal_sized_dims(m.meta.get("val"), sizes)
        if dims:
            m.meta[SYMBOLIC_DIMS] = dims
    shadow.symbolic_sizes = f"dynamic: {reason}; every dim of size {sorted(sizes)} is treated as symbolic"


def _names(shifted: dict[Any, int]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(shifted.items(), key=lambda kv: str(kv[0]))) + "}"
