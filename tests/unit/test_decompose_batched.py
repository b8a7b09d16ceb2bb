"""Tracing a graph's distinct nodes together (one ``make_fx`` call, split per node) builds the same
shadow graph as tracing each distinct node alone: node for node the same names, ops, arguments,
values (shape, stride, dtype), symbolic dims and lifted constants, and the same edge, mark and
in-place tables; and it traces fewer times."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autotp.ops.registry import CONSTANT_VALUE
from autotp.passes.decompose import SYMBOLIC_DIMS, ShadowGraph, _NodeByNode, decompose, mark_symbolic_dims
from tests._capture import captured_graphs
from tests._tiny import tiny_model
from tests.unit.test_decompose import _capture, _capture_recompiled


def _build(gm: torch.fx.GraphModule, example: list, batched: bool) -> tuple[ShadowGraph, int]:
    """The shadow graph as :func:`decompose` builds it (symbolic dims included), and how many
    ``make_fx`` calls the build made."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        builder = _NodeByNode(gm, example, {}, {}, batched=batched)
        shadow = builder.build()
        mark_symbolic_dims(shadow, builder.nodes_at)
    return shadow, builder.traces


def _signature(shadow: ShadowGraph) -> list[tuple]:
    def value(v: Any) -> Any:
        return (tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else None

    return [(n.name, n.op, str(n.target), str(torch.fx.node.map_arg((n.args, n.kwargs), lambda m: m.name)),
             value(n.meta.get("val")), n.meta.get(SYMBOLIC_DIMS), n.meta.get(CONSTANT_VALUE))
            for n in shadow.aten.graph.nodes]


def _tables(shadow: ShadowGraph) -> tuple:
    return ({k: v.name for k, v in shadow.edges.items()}, {k: v.name for k, v in shadow.marks.items()},
            {n.name for n in shadow.inplace_edges}, {n.name: i for n, i in shadow.owner.items()},
            [(a.name, d.name) for a, d in shadow.placeholders], shadow.symbolic_sizes)


def _decode_step(model: torch.nn.Module) -> tuple[torch.fx.GraphModule, list]:
    """The graph of one cached decode step (after a prefill)."""

    def run(compiled: Any) -> Any:
        out = compiled(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True)
        return compiled(input_ids=torch.tensor([[6]]), past_key_values=out.past_key_values, use_cache=True)

    return captured_graphs(model, run)[-1]


def _with_in_place_writes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(3):  # repeated nodes (one shared trace each) around an in-place write
        y = torch.nn.functional.linear(x, w).relu()
        y.add_(x)
        x = y.transpose(0, 1).contiguous().transpose(0, 1) * 2
    return x


GRAPHS = {
    "llama prefill": lambda: _capture(tiny_model("llama"), input_ids=torch.arange(1, 6).unsqueeze(0), use_cache=False),
    "llama prefill, symbolic length": lambda: _capture_recompiled(
        tiny_model("llama").eval(), torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])),
    "llama decode step": lambda: _decode_step(tiny_model("llama").eval()),
    "mixtral prefill": lambda: _capture(tiny_model("mixtral"), input_ids=torch.arange(1, 6).unsqueeze(0), use_cache=False),
    "gpt2 prefill, symbolic length": lambda: _capture_recompiled(
        tiny_model("gpt2").eval(), torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])),
    "falcon prefill (a list index constant)": lambda: _capture(
        tiny_model("falcon"), input_ids=torch.arange(1, 6).unsqueeze(0), use_cache=False),
    "in-place writes": lambda: _capture(_with_in_place_writes, torch.randn(4, 4), torch.randn(4, 4)),
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_batched_tracing_builds_the_shadow_graph_that_tracing_each_node_alone_builds(name: str) -> None:
    gm, example = GRAPHS[name]()
    alone, alone_traces = _build(gm, example, batched=False)
    batched, batched_traces = _build(gm, example, batched=True)
    assert _signature(batched) == _signature(alone)
    assert _tables(batched) == _tables(alone)
    assert batched_traces < alone_traces


def test_a_graph_with_an_in_place_write_keeps_its_pinned_edge_when_batched() -> None:
    gm, example = GRAPHS["in-place writes"]()
    shadow = decompose(gm, example)
    assert len(shadow.inplace_edges) == 3  # one per add_, each traced alone (its write-back is not in its window)
