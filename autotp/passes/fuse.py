"""Fuse: sibling matmuls that read the same input become one matmul per rank.

After the rewrite, a column-parallel q / k / v projection is a plain local ``linear`` on this
rank's shard, and so are gate / up. Linears that read the *same input node* with weights of the
same in-features, dtype and device (and all with or all without a bias) compute

    linear(x, W_1), ..., linear(x, W_k)  ==  split(linear(x, cat([W_1, ..., W_k])), [o_1, ..., o_k], -1)

so the pass replaces them with one ``linear`` on a concatenated weight followed by a split. The
identity holds for any placement (the local op is the same whatever the shards mean), so the pass
is keyed on graph structure only: no module names, no architectures. It runs on the rewritten
per-rank graph, after the plan is fixed, and changes no placement and no collective.

Results: each output element is the same dot product over the same in-features, computed by one
GEMM instead of k; the kernel may block the reduction differently, so results are equal to the
unfused ones up to fp32 rounding (the tests use ``atol=1e-5, rtol=1e-4``), bitwise on most
inputs.

Memory: a group lives in one storage. Normally materialize has already read the group's shards
into consecutive rows of one buffer (it asks :func:`sibling_linears` before reading), so the pass
finds them back to back and takes a view: no copy, no transient. Shards loaded apart (a training
graph compiled first) are concatenated once and each original local shard (the ``Parameter``
objects ``model.parameters()``, optimizers, checkpoints and other graphs hold) is re-pointed at its
rows (``p.data = fused[a:b]``), so the old storages are freed and parameter bytes are unchanged.
A later graph (a decode step, a recompile) that fuses
the same siblings finds them already back to back in one storage and takes a view, no copy; a
sibling set that is laid out differently (part of another fused group) is left unfused and noted.

Inference only: a graph whose linear outputs require grad (a training graph) is not fused,
because autograd would deliver the gradient to the fused tensor instead of the ``Parameter``
objects the optimizer holds. Such groups are reported as skipped. Because the shards stay
``Parameter`` views, a training graph compiled later still reads and updates the same bytes.

``view`` consumers of a split piece become ``reshape`` (a piece of the fused output is a strided
view along the last dim; ``reshape`` returns the same view whenever ``view`` would succeed).
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from autotp.compat import linear_builtin
from autotp.memory import trim_heap

LINEAR_FUNCTIONS = {linear_builtin, F.linear}


@dataclass
class FuseReport:
    """What the pass did: one entry per fused group (the input node, the weights' attribute names,
    the local output sizes) and one reason per group left alone."""

    fused: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    @property
    def removed_matmuls(self) -> int:
        return sum(len(g["weights"]) - 1 for g in self.fused)

    def as_dict(self) -> dict[str, Any]:
        return {"fused_groups": len(self.fused), "removed_matmuls": self.removed_matmuls,
                "groups": self.fused, "skipped": self.skipped}


def _linear_parts(n: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    """``(input, weight, bias)`` of a linear call node, else None."""
    if n.op != "call_function" or n.target not in LINEAR_FUNCTIONS:
        return None
    names = ("input", "weight", "bias")
    values = list(n.args) + [n.kwargs.get(k) for k in names[len(n.args):]]
    if len(values) < 2 or any(k not in names for k in n.kwargs):
        return None
    x, w = values[0], values[1]
    b = values[2] if len(values) > 2 else None
    return x, w, b


def _attr_tensor(gm: torch.fx.GraphModule, node: Any) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = getattr(gm, str(node.target), None)
    return value if isinstance(value, torch.Tensor) else None


def _back_to_back(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A view of the concatenation along dim 0 when the tensors already lie back to back, in
    order, in one storage (a group fused by an earlier graph), else None."""
    first = tensors[0]
    if first.device.type == "meta" or not all(t.is_contiguous() for t in tensors):
        return None
    ptr = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    shape = (rows, *first.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return torch.as_strided(first.detach(), shape, stride, first.storage_offset())


def _owns_storage(t: torch.Tensor) -> bool:
    """The tensor is the whole of its storage (not already a view into some fused group)."""
    if t.device.type == "meta":
        return True
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def fused_storage(tensors: list[torch.Tensor]) -> tuple[torch.Tensor | None, str]:
    """The concatenation of ``tensors`` along dim 0, owning the storage that the tensors become
    views of; ``(None, reason)`` when that is not possible without a second copy."""
    view = _back_to_back(tensors)
    if view is not None:
        return view, "view"
    if not all(_owns_storage(t) for t in tensors):
        return None, "a weight is already a view into another fused group laid out differently"
    with torch.no_grad():
        fused = torch.cat([t.detach() for t in tensors], 0)
        start = 0
        for t in tensors:
            t.data = fused.narrow(0, start, t.shape[0])  # the shard now lives inside the fused weight
            start += t.shape[0]
    # The replaced shards' storages are free now; hand their pages back at once, group by group,
    # so laying out a model's fused weights grows the rank by about one group, not by the heap's
    # fragments of all of them (autotp/memory.py). Meta tensors (the planner's) free nothing, and
    # a trim walks the whole heap: hundreds of them made a 70B-shape plan ~20 s slower.
    if fused.device.type != "meta":
        trim_heap()
    return fused, "new"


def _sanitize(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


Member = tuple[torch.fx.Node, torch.fx.Node, Any]  # (linear call, weight node, bias node or None)


def sibling_linears(graph: torch.fx.Graph, tensor_of: Callable[[Any], torch.Tensor | None],
                    ) -> list[tuple[torch.fx.Node, list[Member]]]:
    """The groups of two or more linears the pass fuses, in graph order: same input node, 2-D
    weights of the same in-features, dtype and device, all with or all without a bias of one dtype;
    each weight once. ``tensor_of`` gives a weight or bias node's local tensor (None: not a
    parameter). The fuse pass calls it on the rewritten graph (``get_attr`` shards); materialize
    calls it before reading, with the shards' future shapes, to lay each group out in one buffer."""
    groups: dict[tuple, list[Member]] = defaultdict(list)
    for n in graph.nodes:
        parts = _linear_parts(n)
        if parts is None:
            continue
        x, w_node, b_node = parts
        w = tensor_of(w_node)
        b = tensor_of(b_node) if b_node is not None else None
        if not isinstance(x, torch.fx.Node) or w is None or w.dim() != 2 or (b_node is not None and b is None):
            continue
        key = (x, w.shape[1], w.dtype, w.device, b is not None, b.dtype if b is not None else None)
        groups[key].append((n, w_node, b_node))
    out = []
    for (x, *_), members in groups.items():
        seen: set[Any] = set()
        members = [m for m in members if not (m[1].target in seen or seen.add(m[1].target))]
        if len(members) >= 2:
            out.append((x, members))
    return out


def is_training(members: list[Member]) -> bool:
    """The linears' outputs require grad (or are unknown): autograd must reach each Parameter."""
    value = [m[0].meta.get("example_value") for m in members]
    return any(not isinstance(v, torch.Tensor) or v.requires_grad for v in value)


def fuse_sibling_matmuls(gm: torch.fx.GraphModule) -> FuseReport:
    """Fuse the sibling linears of ``gm`` (see the module docstring); returns what it did."""
    report = FuseReport()
    graph = gm.graph
    for x, members in sibling_linears(graph, lambda node: _attr_tensor(gm, node)):
        names = [str(m[1].target) for m in members]
        if is_training(members):
            report.skipped.append({"input": x.name, "weights": names,
                                   "reason": "training graph (outputs require grad): not fused"})
            continue
        weights = [getattr(gm, str(m[1].target)) for m in members]
        fused_w, how = fused_storage(weights)
        if fused_w is None:
            report.skipped.append({"input": x.name, "weights": names, "reason": how})
            continue
        fused_b = None
        if members[0][2] is not None:
            fused_b, how_b = fused_storage([getattr(gm, str(m[2].target)) for m in members])
            if fused_b is None:
                report.skipped.append({"input": x.name, "weights": names, "reason": f"bias: {how_b}"})
                continue
        sizes = [int(w.shape[0]) for w in weights]
        _replace(gm, x, members, fused_w, fused_b, sizes)
        report.fused.append({"input": x.name, "weights": names, "out_features": sizes, "storage": how})
    graph.lint()
    gm.recompile()
    return report


def _replace(gm: torch.fx.GraphModule, x: torch.fx.Node, members: list[tuple[torch.fx.Node, torch.fx.Node, Any]],
             fused_w: torch.Tensor, fused_b: torch.Tensor | None, sizes: list[int]) -> None:
    graph = gm.graph
    base = "autotp_fused_" + _sanitize(str(members[0][1].target).removeprefix("autotp_param_"))
    w_name, b_name = base, base + "_bias"
    gm.register_buffer(w_name, fused_w, persistent=False)
    if fused_b is not None:
        gm.register_buffer(b_name, fused_b, persistent=False)
    first = members[0][0]
    with graph.inserting_before(first):
        w = graph.get_attr(w_name)
        b = graph.get_attr(b_name) if fused_b is not None else None
        out = graph.call_function(linear_builtin, (x, w, b))  # (..., sum of out features)
        pieces = graph.call_function(torch.split, (out, sizes, -1))
        taken = []
        for i, (lin, _, _) in enumerate(members):
            piece = graph.call_function(operator.getitem, (pieces, i))  # (..., o_i), strided
            piece.meta = dict(lin.meta)
            taken.append((lin, piece))
    for lin, piece in taken:
        lin.replace_all_uses_with(piece)
        for user in list(piece.users):
            if user.op == "call_method" and user.target == "view":
                user.target = "reshape"
            elif user.op == "call_function" and user.target is torch.Tensor.view:
                user.target = torch.Tensor.reshape
        graph.erase_node(lin)
    for _, w_node, b_node in members:
        for node in (w_node, b_node):
            if isinstance(node, torch.fx.Node) and not node.users:
                graph.erase_node(node)
