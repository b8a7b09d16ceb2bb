"""The node-by-node (memoized) decomposition builds the same shadow graph as one whole-graph trace,
and falls back to the whole-graph trace when a node mutates a tensor."""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any

import pytest
import torch

from autotp.passes.decompose import (
    EDGE,
    MARK,
    SYMBOLIC_DIMS,
    NotNodeLocal,
    ShadowGraph,
    _NodeByNode,
    _resized_inputs,
    _symbols,
    decompose,
    decompose_by_node,
    decompose_whole,
)
from tests._capture import captured_graphs
from tests._tiny import tiny_model


def _capture(fn: Any, *args: Any, dynamic: bool | None = None, **kwargs: Any) -> tuple[torch.fx.GraphModule, list]:
    return captured_graphs(fn, lambda compiled: compiled(*args, **kwargs), dynamic=dynamic)[0]


def _ops_per_dynamo_node(shadow: ShadowGraph) -> dict[int, Counter]:
    """For each Dynamo node: the multiset of (ATen op, output shape) it decomposed into, without
    ``aten.alias`` (an identity the whole-graph functionalization leaves behind some views)."""
    out: dict[int, Counter] = {}
    for n in shadow.aten.graph.nodes:
        if n.op == "call_function" and n in shadow.owner and n.target is not torch.ops.aten.alias.default:
            val = n.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            out.setdefault(shadow.owner[n], Counter())[(str(n.target), shape)] += 1
    return out


def test_node_by_node_and_whole_graph_decompositions_agree_on_a_llama_block() -> None:
    model = tiny_model("llama", num_hidden_layers=3)
    gm, example = _capture(model, input_ids=torch.arange(1, 6).unsqueeze(0), use_cache=False)
    by_node, whole = decompose_by_node(gm, example), decompose_whole(gm, example)
    assert set(by_node.edges) == set(whole.edges)
    assert set(by_node.marks) == set(whole.marks)
    assert [d.name for _, d in by_node.placeholders] == [d.name for _, d in whole.placeholders]
    assert _ops_per_dynamo_node(by_node) == _ops_per_dynamo_node(whole)
    # every edge reads the node the whole-graph trace says it reads (by Dynamo owner and position)
    def producer(shadow: ShadowGraph, e: torch.fx.Node) -> Any:
        src, inputs = e.args[0], {aten: dyn.name for aten, dyn in shadow.placeholders}
        return ("mark", src.args[1], src.args[2]) if src.target is MARK else ("input", inputs[src])
    assert ({k: producer(by_node, e) for k, e in by_node.edges.items()}
            == {k: producer(whole, e) for k, e in whole.edges.items()})


def test_repeated_blocks_are_traced_once_and_copied() -> None:
    """Three identical layers decompose into three identical op sequences (one trace, three copies)."""
    model = tiny_model("llama", num_hidden_layers=3)
    gm, example = _capture(model, input_ids=torch.arange(1, 6).unsqueeze(0), use_cache=False)
    shadow = decompose_by_node(gm, example)
    ops = [str(n.target) for n in shadow.aten.graph.nodes if n.op == "call_function" and n.target not in (EDGE, MARK)]
    assert ops.count("aten.rsqrt.default") == 2 * 3 + 1  # two norms per layer and the final norm


def test_an_in_place_write_pins_its_edge_so_the_write_lands_where_later_readers_look() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x * 2
        z.add_(y)  # writes z in place; the sum below reads z
        return z.sum(-1)

    gm, example = _capture(f, torch.randn(4, 8), torch.randn(4, 8))
    shadow = decompose_by_node(gm, example)
    dyn = {n.name: i for i, n in enumerate(shadow.dynamo_nodes)}
    (inplace,) = [n for n in shadow.dynamo_nodes if n.target == "add_"]
    assert shadow.inplace_edges == {shadow.edges[(dyn[inplace.name], 0, 0)]}
    assert not any(n.target is torch.ops.aten.copy_.default for n in shadow.aten.graph.nodes)


def test_a_node_that_changes_global_state_falls_back_to_the_whole_graph_trace() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            y = x * 2
        return y.sum()

    gm, example = _capture(f, torch.randn(4, 8))
    grad_mode = torch.is_grad_enabled()
    with pytest.raises(NotNodeLocal, match="global state"):
        decompose_by_node(gm, example)
    assert torch.is_grad_enabled() == grad_mode  # nothing ran the switch (the batched prediction did, once)
    shadow = decompose(gm, example)
    assert torch.is_grad_enabled() == grad_mode  # the traced switch did not leak out
    (out,) = torch.fx.Interpreter(shadow.aten).run(*example)
    torch.testing.assert_close(out, (example[0] * 2).sum(), atol=1e-6, rtol=1e-6)


def test_an_index_assignment_returns_nothing_and_pins_its_target() -> None:
    """``z[idx] = y`` is an ``operator.setitem`` node with no output (MoE routers build inverse
    permutations this way)."""

    def f(x: torch.Tensor, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x * 2
        z[idx] = y
        return z.sum(-1)

    gm, example = _capture(f, torch.randn(4, 8), torch.tensor([0, 2]), torch.randn(2, 8))
    shadow = decompose_by_node(gm, example)
    (setitem,) = [n for n in shadow.dynamo_nodes if n.op == "call_function" and n.target is operator.setitem]
    dyn = shadow.dynamo_nodes.index(setitem)
    assert shadow.inplace_edges == {shadow.edges[(dyn, 0, 0)]}
    assert not any(key[0] == dyn for key in shadow.marks)  # nothing produced, nothing marked


def _capture_recompiled(model: torch.nn.Module, first: torch.Tensor, second: torch.Tensor) -> tuple:
    """The graph Dynamo compiles for a second call whose sequence length differs from the first:
    automatic dynamic shapes make the length symbolic (what parallelize_model's calls after the
    warm-up get)."""
    return captured_graphs(model, lambda compiled: (compiled(input_ids=first, use_cache=False),
                                                    compiled(input_ids=second, use_cache=False)))[-1]


def _symbolic(shadow: ShadowGraph) -> dict[str, Any]:
    return {n.name: n.meta[SYMBOLIC_DIMS] for n in shadow.aten.graph.nodes if SYMBOLIC_DIMS in n.meta}


def test_a_dynamic_graph_marks_the_sequence_dims_symbolic_and_nothing_else() -> None:
    model = tiny_model("llama", num_hidden_layers=1).eval()
    gm, example = _capture_recompiled(model, torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    shadow = decompose(gm, example)
    assert shadow.symbolic_sizes.startswith("dynamic: symbolic dims found by decomposing at shifted sizes")
    marked = _symbolic(shadow)
    vals = {n.name: n.meta.get("val") for n in shadow.aten.graph.nodes}
    for name, dims in marked.items():
        for d in dims if isinstance(dims, frozenset) else ():  # the length S = 8, or S + 1 (a mask's width)
            assert vals[name].shape[d] in (8, 9), f"{name}: dim {d} of {tuple(vals[name].shape)} is not the sequence"
    for name, v in vals.items():  # and every value with a dim of size S has it marked
        if isinstance(v, torch.Tensor) and 8 in v.shape:
            assert name in marked, f"{name} {tuple(v.shape)} has a sequence dim but no mark"
    # the embedding's output (1, S, 64) and the q/k/v projections' (1, S, 64) outputs are marked on S
    q_proj = [n for n in shadow.aten.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default]
    assert q_proj and all(marked.get(n.name) == frozenset({0}) for n in q_proj)  # (S, out) after the flatten
    # a parameter's edge is never symbolic
    params = {ph.name for ph, dyn in shadow.placeholders if "parameters" in dyn.name}
    assert not any(name in marked for name in params)


def test_the_shifted_size_recording_has_the_nodes_and_values_of_a_full_decomposition_at_those_sizes() -> None:
    """``mark_symbolic_dims`` compares the shadow graph with a recording of the nodes (not an fx
    graph) at shifted sizes, which shares the first build's traces, fake mode and unresized fake
    inputs; it must be the graph a fresh decomposition at those sizes builds, node for node."""
    model = tiny_model("llama", num_hidden_layers=2).eval()
    gm, example = _capture_recompiled(model, torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    builder = _NodeByNode(gm, example, {}, {})
    builder.build()
    found = _symbols(gm)
    assert found is not None
    resized = _resized_inputs(gm, found[1])
    recorded = builder.nodes_at(resized)
    fresh = list(decompose_by_node(gm, example, resized).aten.graph.nodes)

    def signature(n: Any) -> tuple:
        val = n.meta.get("val")
        return (n.op, str(n.target), tuple(val.shape) if isinstance(val, torch.Tensor) else None)

    assert [signature(n) for n in recorded] == [signature(n) for n in fresh]
    assert any(signature(n) != signature(m) for n, m in zip(recorded, builder.shadow.aten.graph.nodes, strict=True))


def test_a_static_graph_marks_no_dim_symbolic() -> None:
    model = tiny_model("llama", num_hidden_layers=1).eval()
    gm, example = _capture(model, input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), use_cache=False, dynamic=False)
    shadow = decompose(gm, example)
    assert shadow.symbolic_sizes == "static graph"
    assert _symbolic(shadow) == {}


def test_sizes_a_guard_ties_together_move_together_and_their_product_stays_static() -> None:
    """``x.view(16)`` guards ``batch * length == 16``: the second decomposition picks another
    factorization, so batch and length are symbolic while the flat 16 is not."""

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.reshape(16) * y

    torch._dynamo.reset()
    gm, example = _capture(fn, torch.ones(2, 8), torch.ones(16), dynamic=True)
    shadow = decompose(gm, example)
    assert "found by decomposing" in shadow.symbolic_sizes
    vals = {n.name: n.meta.get("val") for n in shadow.aten.graph.nodes}
    marked = _symbolic(shadow)
    two_d = [name for name, v in vals.items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    flat = [name for name, v in vals.items() if isinstance(v, torch.Tensor) and v.dim() == 1]
    assert two_d and all(marked.get(name) == frozenset({0, 1}) for name in two_d)
    assert flat and not any(name in marked for name in flat)
