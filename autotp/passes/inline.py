"""Inline a higher-order op's body into the graph that calls it.

Two higher-order ops reach the backend with a sub-``GraphModule`` body that the solver must see
through: ``tag_activation_checkpoint(body, *args)`` (a checkpointed block,
``autotp/passes/checkpoint.py``, which tags the copies and cuts them back out after the rewrite)
and ``invoke_subgraph(body, identifier, *operands)`` (a repeated layer Dynamo traced once and
called once per layer, ``autotp/regions.py``). Both are replaced, before decomposition, by a copy
of the body's nodes wired to the call's operands (:func:`inline_body`); the call's ``getitem``
users read the copied outputs. After :func:`inline_subgraphs` the graph is the one Dynamo would
have traced without the region, up to node names, so planning and lowering are unchanged.

Each copy of a subgraph body carries the module path of its own call: the body was traced for
the first layer (its nodes' ``nn_module_stack`` names ``model.layers.0...``), so a copy made for
layer ``i`` has that layer's path put in front (:func:`_restacked`), as the planner's report and
depth checks read it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from autotp.errors import AutoTPError

__all__ = ["inline_body", "inline_subgraphs", "is_subgraph_call"]

STACK = "nn_module_stack"


def inline_body(gm: torch.fx.GraphModule, hop: torch.fx.Node, body_node: torch.fx.Node, operands: list[Any],
                what: str, tag: Callable[[torch.fx.Node, torch.fx.Node], None] | None = None) -> None:
    """Replace ``hop`` (a call of the body ``gm.<body_node.target>`` on ``operands``) by a copy of
    the body's nodes; ``tag(copy, original)`` annotates each copy. The body submodule is deleted
    once no call uses it. ``what`` names the op in errors."""
    graph = gm.graph
    if body_node.op != "get_attr":
        raise AutoTPError(f"{what} {hop.name}: its body is not a submodule ({body_node.op})")
    body: torch.fx.GraphModule = getattr(gm, body_node.target)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise AutoTPError(f"{what} {hop.name}: {len(operands)} inputs for {len(placeholders)} body placeholders")
    env: dict[torch.fx.Node, Any] = dict(zip(placeholders, operands, strict=True))
    outputs: Any = None
    with graph.inserting_before(hop):
        for n in body.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = torch.fx.node.map_arg(n.args[0], env.__getitem__)
                continue
            if n.op in ("get_attr", "call_module"):
                raise AutoTPError(
                    f"{what} {hop.name} holds a {n.op} ({n.target}), e.g. a nested checkpoint or region: autotp "
                    "plans flat blocks only; checkpoint the outer or the inner blocks, not both")
            copy = graph.node_copy(n, env.__getitem__)
            if tag is not None:
                tag(copy, n)
            env[n] = copy
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(hop.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        else:
            raise AutoTPError(f"{what} {hop.name}: its result is used whole by {user.name}")
    graph.erase_node(hop)
    if not body_node.users:  # Dynamo may read one body through several get_attr nodes
        graph.erase_node(body_node)
        if not any(n.op == "get_attr" and n.target == body_node.target for n in graph.nodes):
            delattr(gm, body_node.target)


def is_subgraph_call(n: torch.fx.Node) -> bool:
    """Whether ``n`` calls a subgraph Dynamo stamped out (``torch.ops.higher_order.invoke_subgraph``)."""
    return n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph


def _restacked(call_stack: dict[str, Any] | None, body_stack: dict[str, Any] | None) -> dict[str, Any] | None:
    """The module stack of a body node copied for a call whose own stack is ``call_stack``: the
    call's entries, then the body node's entries below the called module, their paths moved from
    the module the body was traced in to the called one."""
    if not call_stack or not body_stack:
        return call_stack or body_stack
    calls, entries = list(call_stack.items()), list(body_stack.items())
    depth = len(calls)
    if len(entries) < depth:
        return dict(call_stack)
    traced_in, called = entries[depth - 1][1][0], calls[-1][1][0]
    out = dict(calls)
    for key, (path, cls) in entries[depth:]:
        moved = called + path[len(traced_in):] if isinstance(path, str) and path.startswith(traced_in) else path
        out[f"{key}@{called}"] = (moved, cls)
    return out


def inline_subgraphs(gm: torch.fx.GraphModule) -> int:
    """Replace every ``invoke_subgraph(body, identifier, *operands)`` by a copy of its body (see
    the module docstring); returns how many calls were inlined."""
    calls = [n for n in gm.graph.nodes if is_subgraph_call(n)]
    for hop in calls:
        body_node, _identifier, *operands = hop.args
        call_stack = hop.meta.get(STACK)

        def tag(copy: torch.fx.Node, original: torch.fx.Node, call_stack: Any = call_stack) -> None:
            copy.meta[STACK] = _restacked(call_stack, original.meta.get(STACK))  # node_copy copied meta

        inline_body(gm, hop, body_node, operands, "layer region", tag)
    if calls:
        gm.graph.lint()
        gm.recompile()
    return len(calls)
