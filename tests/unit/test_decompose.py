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
    NotNodeLocal,
    ShadowGraph,
    decompose,
    decompose_by_node,
    decompose_whole,
)
from tests._tiny import tiny_model


def _capture(fn: Any, *args: Any, **kwargs: Any) -> tuple[torch.fx.GraphModule, list]:
    captured: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return captured[0]


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
    with pytest.raises(NotNodeLocal, match="global state"):
        decompose_by_node(gm, example)
    grad_mode = torch.is_grad_enabled()
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
