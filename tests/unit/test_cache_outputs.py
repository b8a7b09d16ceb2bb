"""``autotp.cache_outputs.cache_entry_leaves`` on graphs Dynamo captures from code that grows a
cache as transformers' ``DynamicCache`` does: which outputs stay sharded stand-ins in the
``torch.compile`` entry (the rest are gathered when the call returns)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from autotp.cache_outputs import cache_entry_leaves
from tests._capture import captured_graphs


class _Layer:
    """A cache layer: starts from the empty legacy ``(0,)`` tensor, grows by concatenation."""

    def __init__(self, keys: torch.Tensor | None = None, window: int | None = None) -> None:
        self.keys = keys
        self.window = window

    def update(self, k: torch.Tensor) -> torch.Tensor:
        if self.keys is None:
            self.keys = torch.tensor([], dtype=k.dtype, device=k.device)
        full = torch.cat([self.keys, k], dim=-2)
        self.keys = full[:, -self.window:] if self.window else full
        return full


def _capture(fn: Any, *args: Any) -> tuple[torch.fx.GraphModule, list[Any]]:
    return captured_graphs(fn, lambda compiled: compiled(*args))[0]


def _leaf_shapes(gm: torch.fx.GraphModule, leaves: frozenset[int]) -> list[tuple[int, ...]]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg(output.args[0], nodes.append)
    return sorted(tuple(nodes[k].meta["example_value"].shape) for k in leaves)


def test_a_fresh_layers_concatenation_and_its_window_are_cache_entries_and_the_logits_are_not() -> None:
    k, x = torch.randn(1, 3, 4), torch.randn(5, 6)
    full, window = _Layer(), _Layer(window=2)

    def prefill(k: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full.update(k)
        window.update(k * 2)
        return x @ x.T, torch.cat([x, x])  # logits, and a concatenation onto no cache

    gm, _ = _capture(prefill, k, x)

    assert _leaf_shapes(gm, cache_entry_leaves(gm, [])) == [(1, 2, 4), (1, 3, 4)]


def test_a_decode_steps_concatenation_onto_a_cache_input_is_a_cache_entry_only_when_that_input_is_one() -> None:
    k, x = torch.randn(1, 1, 4), torch.randn(5, 6)
    layer = _Layer(keys=torch.randn(1, 3, 4))

    def step(k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        layer.update(k)
        return x @ x.T

    gm, example_inputs = _capture(step, k, x)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cached = [ph for ph, v in zip(placeholders, example_inputs, strict=True) if tuple(v.shape) == (1, 3, 4)]

    assert len(cached) == 1
    assert _leaf_shapes(gm, cache_entry_leaves(gm, cached)) == [(1, 4, 4)]
    assert cache_entry_leaves(gm, []) == frozenset()  # a plain input (a cache the user replaced) is no source
