"""Rewrite: turn the annotated Dynamo graph into this rank's program.

* Parameters: each parameter placeholder is replaced by a ``get_attr`` of this rank's local shard
  (the placeholder stays in the signature so Dynamo's calling convention is unchanged; the
  global-shaped value Dynamo passes in is ignored). A linear whose weight is ``Shard(0)`` *is* a
  column-parallel linear and one with ``Shard(1)`` a row-parallel one: the local op on local shards
  plus the collectives on its edges; no module swap is needed for matmuls, whatever form they take.
* Edges: where a value arrives with a placement other than the one its consumer needs, a
  :class:`~autotp.layers.Redistribute` module is inserted (the collective and its backward
  conjugate). A replicated value that feeds a node with a sharded or partial output gets an
  identity-forward / all-reduce-backward ``Redistribute(R, R)`` when it requires grad, because its
  gradient from that consumer is a partial sum.
* Local rewrites named by the solver: ``shape`` divides the constant size on the sharded dim of
  view / reshape / expand calls (or a runtime size tuple, by a node that divides it);
  ``vocab_parallel`` swaps ``F.embedding`` for :class:`~autotp.layers.VocabParallelEmbedding`;
  ``replicated_share`` divides the Replicate summands of an add / bias whose result is Partial by
  N; ``rank_rng`` runs a node that draws random numbers for a shard on this rank's own stream
  (:class:`~autotp.rng.RankStreamCall`); ``split_sizes`` / ``slice_bounds`` cut a fused (strided)
  shard into its segments locally; ``sharded_softmax`` / ``vocab_gather`` swap a softmax, a gather
  or a cross-entropy / nll loss over a sharded class dim for :class:`~autotp.layers.ShardedSoftmax`,
  :class:`~autotp.layers.VocabGather` or :class:`~autotp.layers.VocabParallelLoss` (on the Dynamo
  targets listed in ``autotp/passes/hosts.py``); ``sharded_mean`` scales a mean over a sharded dim
  by this rank's share of that dim, so the ranks' results sum to the whole mean (a Partial). A local rewrite autotp cannot apply to a node is an
  error, never silently skipped.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from autotp.collectives import Comm, chunk_group, kind_of, refuse_gradient, refuses_gradient
from autotp.compat import legacy_get_string, linear_builtin
from autotp.context import meta_of
from autotp.errors import PassError
from autotp.layers import (
    ChunkGroupGradient,
    Redistribute,
    ShardedSoftmax,
    VocabGather,
    VocabParallelEmbedding,
    VocabParallelLoss,
    WholeSegmentGradient,
)
from autotp.ops.elementwise import REPLICATED_SHARE
from autotp.ops.indexing import (
    SLICE_BOUNDS,
    SPLIT_SIZES,
    VOCAB_GATHER,
    local_segment_bounds,
    local_segment_index,
    local_split_sizes,
)
from autotp.ops.norm import SHARDED_SOFTMAX
from autotp.ops.random import RANK_RNG
from autotp.ops.reduction import SHARDED_MEAN
from autotp.ops.shape import localize_sizes
from autotp.passes.annotate import Annotation
from autotp.passes.hosts import GATHER_FUNCTIONS, SOFTMAX_FUNCTIONS, SOFTMAX_METHODS
from autotp.placement import GroupedShard, HeadShard, Replicate, Shard, StridedShard, chunks, parse
from autotp.plan import gradient_node
from autotp.rng import RankStreamCall

SHAPE_METHODS = {"view", "reshape", "expand", "new_empty", "new_zeros", "new_ones"}
SHAPE_FUNCTIONS = {torch.reshape, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.expand}


@dataclass
class LocalParam:
    """A parameter placeholder's replacement: the attribute name and this rank's shard."""

    attr: str
    tensor: torch.nn.Parameter
    global_shape: tuple[int, ...]
    vocab_start: int = 0


@dataclass
class RewriteReport:
    collectives: Counter = field(default_factory=Counter)
    grad_only_collectives: int = 0
    local_rewrites: Counter = field(default_factory=Counter)


def _leaf_nodes(n: torch.fx.Node) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), out.append)
    return out


def _requires_grad(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return bool(value.requires_grad)
    return False


def rewrite(gm: torch.fx.GraphModule, annotation: Annotation, params: dict[torch.fx.Node, LocalParam],
            comm: Comm) -> RewriteReport:
    report = RewriteReport()
    graph = gm.graph
    counter = itertools.count()
    original = list(graph.nodes)
    requires_grad = {n: _requires_grad(n) for n in original}
    for ph, lp in params.items():
        requires_grad[ph] = lp.tensor.requires_grad

    # 1. parameters -> get_attr of the local shard (a grouped one sums its gradient over its group; a
    #    layout autotp cannot train through refuses one)
    trains = gradient_node(gm) is not None
    first_real = next(n for n in graph.nodes if n.op != "placeholder")
    attr_nodes: dict[torch.fx.Node, torch.fx.Node] = {}
    owners: set[torch.fx.Node] = set()  # projections whose whole segments' gradient rank 0 owns
    for ph, lp in params.items():
        if not hasattr(gm, lp.attr):
            gm.register_parameter(lp.attr, lp.tensor)
        with graph.inserting_before(first_real):
            attr_nodes[ph] = graph.get_attr(lp.attr)
            placement = meta_of(lp.tensor).placement
            if trains and isinstance(placement, StridedShard) and any(placement.groups) and not placement.whole:
                # fused kv heads held per group of ranks: their rows' gradient summed over each group
                for groups, rows in placement.grouped_local_bounds(comm.world_size, comm.rank).items():
                    chunk_group(comm, groups)  # made now, by every rank in compile order
                    name = f"autotp_group_gradient_{ph.name}_{groups}"
                    gm.add_submodule(name, ChunkGroupGradient(comm, groups, placement.dim, tuple(rows)))
                    attr_nodes[ph] = graph.call_module(name, (attr_nodes[ph],))
                    report.grad_only_collectives += 1
            elif trains and refuses_gradient(placement):  # whole segments: summed, unless a reader can't own them
                readers = _whole_segment_readers(ph, annotation) if not any(placement.groups) else None
                if readers is not None:
                    name = f"autotp_whole_gradient_{ph.name}"
                    gm.add_submodule(name, WholeSegmentGradient(placement, comm, owner=False))
                    attr_nodes[ph] = graph.call_module(name, (attr_nodes[ph],))
                    owners.update(readers)
                    report.grad_only_collectives += 1
                else:
                    attr_nodes[ph] = graph.call_function(refuse_gradient, (attr_nodes[ph],))
            elif trains and isinstance(placement, GroupedShard):  # its gradient summed over its group
                chunk_group(comm, placement.groups)  # made now, by every rank in compile order
                name = f"autotp_group_gradient_{ph.name}"
                gm.add_submodule(name, ChunkGroupGradient(comm, placement.groups))
                attr_nodes[ph] = graph.call_module(name, (attr_nodes[ph],))
                report.grad_only_collectives += 1

    # 2. edges -> Redistribute where the placement changes (or a partial gradient must be reduced)
    shared: dict[tuple, torch.fx.Node] = {}
    for n in original:
        if n.op == "placeholder":
            continue
        plan = annotation.plans[n]
        leaves = _leaf_nodes(n)
        replacement: dict[int, Any] = {}
        for k, leaf in enumerate(leaves):
            subs = sorted(s for (lk, s) in plan.edges if lk == k)
            if not subs:
                continue
            converted = []
            changed = False
            for s in subs:
                e = plan.edges[(k, s)]
                grad_partial = (isinstance(e.dst, Replicate) and plan.produces_non_replicated()
                                and requires_grad.get(leaf, False))
                source = attr_nodes.get(leaf, leaf)
                if len(subs) > 1 or _is_sequence_value(leaf):
                    with graph.inserting_before(n):
                        source = graph.call_function(_getitem, (source, s))
                if e.src != e.dst:
                    key = (leaf, s, e.src, e.dst)
                    if key not in shared:  # one collective per value and placement, shared by consumers
                        shared[key] = _insert_redistribute(gm, n, source, e.src, e.dst, False, comm, counter,
                                                           _sharded_size(leaf, s, e.src))
                        kind = kind_of(e.src, e.dst)
                        if kind:
                            report.collectives[kind] += 1
                    source = shared[key]
                    changed = True
                if grad_partial:
                    source = _insert_redistribute(gm, n, source, e.dst, e.dst, True, comm, counter)
                    report.grad_only_collectives += 1
                    changed = True
                converted.append(source)
            if changed:
                replacement[k] = converted[0] if len(converted) == 1 and not _is_sequence_value(leaf) \
                    else tuple(converted)
        _replace_leaves(n, replacement, attr_nodes)

        # 3. local rewrites
        if _globalize_size_query(n, plan, comm.world_size):
            report.local_rewrites["global_size"] += 1
        replacing = plan.local & {SHARDED_SOFTMAX, VOCAB_GATHER}
        if replacing or _loss_with_sharded_rows(n, plan):
            _apply_sharded_classes(gm, n, replacing, plan, comm, report)
        for tag in sorted(plan.local - replacing):
            if tag == REPLICATED_SHARE:
                _share_replicated_terms(n, plan, comm.world_size)
                report.local_rewrites[tag] += 1
                continue
            if tag == SPLIT_SIZES:
                _localize_split(n, plan, comm.rank, comm.world_size)
                report.local_rewrites[tag] += 1
                continue
            if tag == SLICE_BOUNDS:
                _localize_segment_slice(n, plan, comm.rank, comm.world_size)
                report.local_rewrites[tag] += 1
                continue
            if tag == RANK_RNG:
                n = _on_rank_stream(gm, n, comm.rank)
                report.local_rewrites[tag] += 1
                continue
            if tag == SHARDED_MEAN:
                _scale_to_share(gm, n, plan)
                report.local_rewrites[tag] += 1
                continue
            _apply_local(gm, n, tag, plan.output(), params, attr_nodes, comm, report)
        if n in owners:
            name = f"autotp_whole_owner_{n.name}"
            gm.add_submodule(name, WholeSegmentGradient(plan.output(), comm, owner=True))
            with graph.inserting_after(n):
                owned = graph.call_module(name, (n,))
            owned.meta = dict(n.meta)
            n.replace_all_uses_with(owned, delete_user_cb=lambda user, owned=owned: user is not owned)

    for ph in params:
        if ph.users:
            raise PassError(f"parameter placeholder {ph.name} still has users after rewrite: {list(ph.users)}")
    gm.recompile()
    return report


def _whole_segment_readers(ph: torch.fx.Node, annotation: Annotation) -> set[torch.fx.Node] | None:
    """The nodes where a parameter with whole segments (``StridedShard.whole``) meets an activation:
    its users, through ops on the parameter alone (``.T``, views, casts), that read another tensor
    and output the segments whole too (a fused projection, its bias add). None where some path
    loses the whole segments first: such a parameter refuses a gradient."""
    readers: set[torch.fx.Node] = set()
    derived, todo = {ph}, list(ph.users)
    while todo:
        u = todo.pop()
        out = annotation.plans[u].output()
        if not (isinstance(out, StridedShard) and out.whole):
            return None
        if any(isinstance(_example_value(leaf), torch.Tensor) and leaf not in derived for leaf in _leaf_nodes(u)):
            readers.add(u)  # reads an activation (or another parameter): the projection
        else:  # derived from the parameter alone
            derived.add(u)
            todo.extend(u.users)
    return readers


def _on_rank_stream(gm: torch.fx.GraphModule, n: torch.fx.Node, rank: int) -> torch.fx.Node:
    """Local rewrite ``rank_rng``: the node becomes a call of a :class:`RankStreamCall` module
    that runs the same function or method on this rank's own random stream."""
    if n.op not in ("call_function", "call_method"):
        raise PassError(f"node {n.name} ({n.op} {n.target}) draws random numbers for a shard, but autotp "
                        "only knows how to give a function or method call its own stream")
    name = f"autotp_rank_stream_{n.name}"
    gm.add_submodule(name, RankStreamCall(n.target, n.op == "call_method", rank))
    with gm.graph.inserting_before(n):
        new = gm.graph.call_module(name, n.args, n.kwargs)
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)
    return new


def _scale_to_share(gm: torch.fx.GraphModule, n: torch.fx.Node, plan: Any) -> None:
    """Local rewrite ``sharded_mean``: a mean over the sharded dim of its input becomes this rank's
    summand of the whole mean, ``local mean * local size / global size`` of that dim (1/N for even
    shards), so the Partial the solver planned sums to the global mean."""
    x = n.args[0] if n.args else n.kwargs.get("input")
    placement = _arrival(n, plan, x)
    value = _example_value(x)
    if not isinstance(placement, Shard) or not isinstance(value, torch.Tensor):
        raise PassError(f"node {n.name}: a mean over a sharded dim needs its input's shard and size")
    with gm.graph.inserting_after(n):
        share = gm.graph.call_function(_mean_share, (n, x, placement.dim, int(value.shape[placement.dim])))
    share.meta = dict(n.meta)
    n.replace_all_uses_with(share, delete_user_cb=lambda user: user is not share)


def _mean_share(mean: torch.Tensor, x: torch.Tensor, dim: int, global_size: int) -> torch.Tensor:
    """This rank's summand of a mean over ``x``'s sharded ``dim``: its chunk's mean weighted by the
    chunk's share of the dim."""
    return mean * (x.shape[dim] / global_size)


def _insert_redistribute(gm: torch.fx.GraphModule, before: torch.fx.Node, source: torch.fx.Node, src: Any,
                         dst: Any, grad_partial: bool, comm: Comm, counter: itertools.count,
                         size: int | None = None) -> torch.fx.Node:
    name = f"autotp_redistribute_{next(counter)}"
    gm.add_submodule(name, Redistribute(src, dst, comm, grad_partial, size))
    with gm.graph.inserting_before(before):
        return gm.graph.call_module(name, (source,))


def _example_value(node: Any) -> Any:
    """Dynamo's (global) example value of ``node``, looking through the collectives the rewrite put
    in front of it."""
    while isinstance(node, torch.fx.Node) and node.op == "call_module" and str(node.target).startswith(
            "autotp_redistribute"):
        node = node.args[0]
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _static_size(node: Any, dim: int, sub: int = 0) -> int | None:
    """The global size of ``dim`` (negative counts from the end) of a Dynamo node's value (item
    ``sub`` of a tuple), None when it is symbolic or unknown. A dim that may be split unevenly (a
    vocabulary) is always static."""
    value = _example_value(node)
    if isinstance(value, (tuple, list)):
        value = value[sub] if sub < len(value) else None
    if not isinstance(value, torch.Tensor) or not -value.dim() <= dim < value.dim():
        return None
    size = value.shape[dim]
    return size if isinstance(size, int) else None


def _sharded_size(leaf: torch.fx.Node, sub: int, src: Any) -> int | None:
    """What a ``Redistribute`` out of ``src`` needs to know of an uneven shard: the global size."""
    return _static_size(leaf, src.dim, sub) if isinstance(src, Shard) else None


def _getitem(value: Any, index: int) -> Any:
    return value[index]


def _is_sequence_value(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (tuple, list))


def _replace_leaves(n: torch.fx.Node, replacement: dict[int, Any], attr_nodes: dict) -> None:
    counter = itertools.count()

    def swap(m: torch.fx.Node) -> Any:
        k = next(counter)
        if k in replacement:
            return replacement[k]
        return attr_nodes.get(m, m)

    n.args = torch.fx.node.map_arg(n.args, swap)
    n.kwargs = torch.fx.node.map_arg(n.kwargs, swap)


def _apply_local(gm: torch.fx.GraphModule, n: torch.fx.Node, tag: str, out: Any,
                 params: dict[torch.fx.Node, LocalParam], attr_nodes: dict, comm: Comm,
                 report: RewriteReport) -> None:
    if tag == "shape":
        if not isinstance(out, (Shard, GroupedShard, HeadShard)):
            return
        if n.op == "call_method" and n.target in SHAPE_METHODS or n.op == "call_function" and n.target in SHAPE_FUNCTIONS:
            _localize_shape_args(n, out, comm)
            report.local_rewrites["shape"] += 1
            return
        # composite ops (attention, norms) derive their sizes from their (local) inputs
        report.local_rewrites["shape(derived)"] += 1
        return
    if tag == "vocab_parallel":
        if n.op != "call_function" or n.target is not F.embedding:
            raise PassError(f"node {n.name} ({n.target}) needs a vocab-parallel rewrite, "
                            "but autotp only knows how to apply it to torch.nn.functional.embedding")
        ids, weight = n.args[0], n.args[1]
        lp = next((lp for ph, lp in params.items() if attr_nodes.get(ph) is weight), None)
        if lp is None:
            raise PassError(f"vocab-parallel embedding {n.name}: its weight is not a parameter")
        padding_idx = n.args[2] if len(n.args) > 2 else n.kwargs.get("padding_idx")
        name = f"autotp_vocab_embedding_{n.name}"
        gm.add_submodule(name, VocabParallelEmbedding(lp.tensor, lp.global_shape[0], lp.vocab_start, padding_idx))
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(name, (ids,))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        report.local_rewrites["vocab_parallel"] += 1
        return
    raise PassError(f"unknown local rewrite {tag!r} requested for node {n.name}")


def _loss_with_sharded_rows(n: torch.fx.Node, plan: Any) -> bool:
    """A cross-entropy / nll loss whose input arrives split along a dim other than the classes: run
    locally it would divide a ``mean`` by the local row count, so it is replaced too."""
    if n.op != "call_function" or n.target not in (F.cross_entropy, F.nll_loss):
        return False
    x = n.args[0] if n.args else n.kwargs.get("input")
    placement = _arrival(n, plan, x)
    value = _example_value(x)
    class_dim = 0 if isinstance(value, torch.Tensor) and value.dim() == 1 else 1
    return isinstance(placement, Shard) and placement.dim != class_dim


def _arrival(n: torch.fx.Node, plan: Any, arg: Any) -> Any:
    """The placement the node receives ``arg`` (one of its node arguments) in."""
    for k, leaf in enumerate(_leaf_nodes(n)):
        if leaf is arg and (k, 0) in plan.edges:
            return plan.edges[(k, 0)].dst
    return None


def _apply_sharded_classes(gm: torch.fx.GraphModule, n: torch.fx.Node, tags: set[str], plan: Any, comm: Comm,
                           report: RewriteReport) -> None:
    """Local rewrites ``sharded_softmax`` / ``vocab_gather``: replace a softmax, a gather or a loss
    whose class dim is sharded by its parallel layer (``autotp/layers.py``); the hosts are listed in
    ``autotp/passes/hosts.py``, and the solver only picks these rewrites on those nodes."""
    if n.op == "call_function" and n.target in (F.cross_entropy, F.nll_loss):
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs).arguments
        reduction = bound.get("reduction", "mean")
        if bound.get("size_average") is not None or bound.get("reduce") is not None:
            reduction = legacy_get_string(bound.get("size_average"), bound.get("reduce"))
        weight = bound.get("weight")
        weight_sharded = weight is not None and isinstance(_arrival(n, plan, weight), Shard)
        logits = bound["input"]
        scores = _example_value(logits)
        classes = _static_size(logits, 0 if isinstance(scores, torch.Tensor) and scores.dim() == 1 else 1)
        if classes is None:
            raise PassError(f"node {n.name}: a loss over sharded scores needs a static number of classes")
        module: torch.nn.Module = VocabParallelLoss(
            comm, classes=classes, from_logits=n.target is F.cross_entropy, ignore_index=bound.get("ignore_index", -100),
            reduction=reduction, label_smoothing=bound.get("label_smoothing", 0.0), weight_sharded=weight_sharded,
            classes_sharded=bool(tags), rows_per_rank=1 if tags else comm.world_size)
        args = (bound["input"], bound["target"]) + ((bound["weight"],) if bound.get("weight") is not None else ())
        kind = n.target.__name__
    elif n.op == "call_function" and n.target in SOFTMAX_FUNCTIONS or n.op == "call_method" and n.target in SOFTMAX_METHODS:
        log = SOFTMAX_FUNCTIONS[n.target] if n.op == "call_function" else SOFTMAX_METHODS[n.target]
        x = n.args[0] if n.args else n.kwargs["input"]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        dtype = n.kwargs.get("dtype")
        if dtype is None and len(n.args) > 2 and isinstance(n.args[-1], torch.dtype):
            dtype = n.args[-1]
        if not isinstance(dim, int):
            raise PassError(f"node {n.name}: a softmax over a sharded dim needs an explicit integer dim, got {dim!r}")
        module, args, kind = ShardedSoftmax(dim, log, comm, dtype), (x,), "log_softmax" if log else "softmax"
    elif n.op == "call_function" and n.target in GATHER_FUNCTIONS or n.op == "call_method" and n.target == "gather":
        x = n.args[0] if n.args else n.kwargs["input"]
        dim = n.args[1] if len(n.args) > 1 else n.kwargs["dim"]
        index = n.args[2] if len(n.args) > 2 else n.kwargs["index"]
        size = _static_size(x, dim)
        if size is None:
            raise PassError(f"node {n.name}: a gather along a sharded dim needs that dim's size to be static")
        module, args, kind = VocabGather(dim, size, comm), (x, index), "gather"
    else:
        raise PassError(f"node {n.name} ({n.target}) needs the local rewrites {sorted(tags)}, which autotp "
                        "applies only to the hosts in autotp/passes/hosts.py")
    name = f"autotp_sharded_{kind}_{n.name}"
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(n):
        new = gm.graph.call_module(name, args)
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    gm.graph.erase_node(n)
    if SHARDED_SOFTMAX in tags:
        report.collectives["all_reduce"] += 2  # the row max and the row sum (ShardedSoftmax)
    for tag in sorted(tags):
        report.local_rewrites[tag] += 1


#: Dynamo targets whose tensor arguments are all plain summands of the result
ADD_LIKE_FUNCTIONS = {operator.add, operator.sub, operator.iadd, operator.isub, torch.add, torch.sub,
                      torch.Tensor.add, torch.Tensor.sub}
ADD_LIKE_METHODS = {"add", "sub", "add_", "sub_", "__add__", "__radd__", "__sub__", "__rsub__", "__iadd__",
                    "__isub__"}
#: Dynamo targets with one additive argument (position, keyword): a bias
BIAS_ARGUMENT: dict[Any, tuple[int, str]] = {
    F.linear: (2, "bias"), linear_builtin: (2, "bias"), torch.addmm: (0, "input"),
    torch.baddbmm: (0, "input"), torch.Tensor.addmm: (0, "self"), "addmm": (0, "self"), "baddbmm": (0, "self"),
}


def _share_replicated_terms(n: torch.fx.Node, plan: Any, world_size: int) -> None:
    """Local rewrite ``replicated_share`` (``autotp/ops/elementwise.py``): the node's result is
    Partial, so each Replicate summand (a residual added to a row-parallel result, the bias of a
    row-parallel layer) is divided by N on every rank; the ranks' results then sum to the true one."""
    if n.op == "call_function" and n.target in ADD_LIKE_FUNCTIONS or n.op == "call_method" and n.target in ADD_LIKE_METHODS:
        additive = None  # every argument
    elif n.target in BIAS_ARGUMENT and n.op in ("call_function", "call_method"):
        additive = set(BIAS_ARGUMENT[n.target])
    else:
        raise PassError(f"node {n.name} ({n.target}) needs its Replicate summands divided by the world size "
                        "(replicated_share), but autotp only knows the summands of add/sub, linear and addmm")
    counter = itertools.count()
    graph = n.graph

    def visit(position: int | str) -> Any:
        def swap(m: torch.fx.Node) -> Any:
            edge = plan.edges.get((next(counter), 0))
            if (additive is None or position in additive) and edge is not None and isinstance(edge.dst, Replicate):
                with graph.inserting_before(n):
                    return graph.call_function(operator.truediv, (m, world_size))  # this rank's share
            return m
        return swap

    n.args = tuple(torch.fx.node.map_arg(a, visit(i)) for i, a in enumerate(n.args))
    n.kwargs = {k: torch.fx.node.map_arg(v, visit(k)) for k, v in n.kwargs.items()}


SPLIT_FUNCTIONS = {torch.split, torch.functional.split, torch.Tensor.split, torch.Tensor.split_with_sizes}
CHUNK_LIKE = {torch.chunk, torch.Tensor.chunk, "chunk"}


def _localize_split(n: torch.fx.Node, plan: Any, rank: int, world_size: int) -> None:
    """Local rewrite ``split_sizes``: a fused shard split into its segments; each rank splits its
    own chunks, so the piece sizes are its segments' local lengths: divided by N, or its heads'
    rows where the segments are split in whole heads (``chunk(k)`` keeps its count)."""
    if n.target in CHUNK_LIKE:
        return
    if not (n.op == "call_method" and n.target in ("split", "split_with_sizes")
            or n.op == "call_function" and n.target in SPLIT_FUNCTIONS):
        raise PassError(f"node {n.name} ({n.target}) splits a fused shard, but autotp only knows how to "
                        "divide the sizes of split / split_with_sizes / chunk")
    args, kwargs = list(n.args), dict(n.kwargs)
    key = next((k for k in ("split_size_or_sections", "split_size", "split_sizes") if k in kwargs), None)
    sizes = args[1] if key is None else kwargs[key]
    edge = plan.edges.get((0, 0))
    fused = edge.dst if edge is not None else None
    if isinstance(fused, StridedShard) and fused.heads and not isinstance(sizes, torch.fx.Node):
        sizes = local_split_sizes(sizes, fused, rank, world_size)
    elif isinstance(sizes, torch.fx.Node):
        with n.graph.inserting_before(n):
            sizes = n.graph.call_function(_divide_sizes, (sizes, world_size))
    else:
        sizes = _divide_sizes(sizes, world_size)
    if key is None:
        args[1] = sizes
    else:
        kwargs[key] = sizes
    n.args, n.kwargs = tuple(args), kwargs


def _divide_sizes(sizes: Any, world_size: int) -> Any:
    """A split size (int) or list of sizes, divided by N."""
    return sizes // world_size if isinstance(sizes, int) else [s // world_size for s in sizes]


def _localize_segment_slice(n: torch.fx.Node, plan: Any, rank: int, world_size: int) -> None:
    """Local rewrite ``slice_bounds``: ``x[..., a:b]`` takes one segment of a fused shard; each rank
    takes its piece of it (its chunk, or the whole segment where every rank holds it); a constant
    list index ``x[..., [i], :]`` into a segment every rank holds whole reads it where it lies in
    the local shard (Falcon's k and v heads behind its q heads)."""
    edge = plan.edges.get((0, 0))
    value = n.args[0].meta.get("example_value") if n.args and isinstance(n.args[0], torch.fx.Node) else None
    fused = edge.dst if edge else None
    if not (n.op == "call_function" and n.target is operator.getitem and isinstance(fused, StridedShard)
            and isinstance(value, torch.Tensor)):
        raise PassError(f"node {n.name} ({n.target}) slices a fused shard, but autotp only knows how to "
                        "rewrite the bounds of x[..., a:b] and x[..., [i], :]")
    dim, ndim = fused.dim, value.dim()
    index = n.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
    d = 0
    for i, it in enumerate(items):
        if it is None:
            continue
        if it is Ellipsis:
            d += ndim - consuming
            continue
        if d == dim:
            if isinstance(it, slice) and all(isinstance(b, (int, type(None))) for b in (it.start, it.stop)):
                items[i] = slice(*local_segment_bounds(fused, it.start, it.stop, world_size, rank), it.step)
            elif isinstance(it, list) and all(isinstance(k, int) for k in it):
                items[i] = [local_segment_index(fused, k, world_size, rank) for k in it]
            else:
                raise PassError(f"node {n.name}: the fused dim {dim} is indexed by {it!r}, not a constant slice "
                                "or list")
            n.args = (n.args[0], tuple(items) if isinstance(index, tuple) else items[0])
            return
        d += 1
    raise PassError(f"node {n.name}: could not find the fused dim {dim} in the index {index!r}")


def _localize_shape_args(n: torch.fx.Node, out: Shard | GroupedShard | HeadShard, comm: Comm) -> None:
    """Divide the size on the output's sharded dim by the chunks it is cut in: constants directly
    (to this rank's chunk, which may be short, see :func:`autotp.placement.chunk_range`; a grouped
    shard's size by its groups; a head shard's to this rank's heads), a symbolic size (a Node
    computed from global sizes, see :func:`_globalize_size_query`; never uneven) by a floordiv node."""
    world_size = comm.world_size
    args = list(n.args)
    if len(args) == 2 and isinstance(args[1], torch.fx.Node):
        # the whole size is one runtime value (``x.view(x.size()[:-1] + (nf,))``): divide it at run time
        with n.graph.inserting_before(n):
            if isinstance(out, HeadShard):
                args[1] = n.graph.call_function(_localize_at, (args[1], out.dim, out.heads, out.groups, comm.rank,
                                                               world_size))
            elif isinstance(out, StridedShard) and not out.even:  # this rank's q_r | k | v
                args[1] = n.graph.call_function(_strided_size_at, (args[1], str(out), comm.rank, world_size))
            else:
                rank, parts = (0, chunks(out, world_size)) if isinstance(out, GroupedShard) else (comm.rank, world_size)
                args[1] = n.graph.call_function(_divide_size_at, (args[1], out.dim, rank, parts))
        n.args = tuple(args)
        return
    packed = n.target in ("new_empty", "new_zeros", "new_ones") or (
        len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)))
    sizes = list(args[1]) if packed else args[1:]
    if isinstance(sizes[out.dim], torch.fx.Node) and isinstance(out, HeadShard):
        raise PassError(f"node {n.name}: a symbolic size on a dim split in whole heads ({out})")
    if isinstance(sizes[out.dim], torch.fx.Node) and isinstance(out, StridedShard) and not out.even:
        with n.graph.inserting_before(n):  # a dynamic batch merged with heads split in whole heads
            sizes[out.dim] = n.graph.call_function(_strided_length, (sizes[out.dim], str(out), comm.rank, world_size))
    if isinstance(sizes[out.dim], torch.fx.Node):
        with n.graph.inserting_before(n):
            sizes[out.dim] = n.graph.call_function(operator.floordiv, (sizes[out.dim], chunks(out, world_size)))
    else:
        sizes = localize_sizes(sizes, out, world_size, comm.rank)
    if packed:
        args[1] = tuple(sizes)
    else:
        args[1:] = sizes
    n.args = tuple(args)


def _divide_size_at(sizes: Any, dim: int, rank: int, world_size: int) -> tuple:
    """A size list computed at run time (in global sizes), with the size at ``dim`` made this
    rank's chunk (``-1`` stays ``-1``)."""
    return tuple(localize_sizes(list(sizes), Shard(dim), world_size, rank))


def _strided_size_at(sizes: Any, placement: str, rank: int, world_size: int) -> tuple:
    """A size list computed at run time (in global sizes), with the size at the fused shard's dim
    made this rank's length (``StridedShard.local_length_of``; ``placement`` as text: FX code
    prints its args; ``-1`` stays ``-1``)."""
    return tuple(localize_sizes(list(sizes), parse(placement), world_size, rank))


def _strided_length(size: Any, placement: str, rank: int, world_size: int) -> Any:
    """One symbolic size at a fused shard's dim made this rank's length."""
    return parse(placement).local_length_of(size, world_size, rank)


def _localize_at(sizes: Any, dim: int, heads: int, groups: int, rank: int, world_size: int) -> tuple:
    """A size list computed at run time (in global sizes), with the size at ``dim`` made this
    rank's heads of ``HeadShard(dim, heads, groups)`` (passed as numbers: FX code prints its args)."""
    return tuple(localize_sizes(list(sizes), HeadShard(dim, heads, groups), world_size, rank))


def _global_size(size: torch.Size, dim: int, world_size: int, total: int | None = None) -> torch.Size:
    """A local ``x.size()`` of a tensor sharded on ``dim``, turned back into the global size
    (``total``, when the dim is static: an uneven chunk times N is not the global size)."""
    out = list(size)
    out[dim] = out[dim] * world_size if total is None else total
    return torch.Size(out)


def _global_numel(numel: int, local: int, total: int) -> int:
    """``x.numel()`` of a tensor split unevenly on a dim whose local size is ``local`` (every rank
    holds at least one index of it) and global size ``total``."""
    return numel // local * total


def _global_size_at(local: int, total: int) -> int:
    """``x.size(d)`` of a dim split unevenly: the static global size (``local`` is ignored)."""
    return total


def _globalize_size_query(n: torch.fx.Node, plan: Any, world_size: int) -> bool:
    """The original program reasons in global sizes; ``x.size()``, ``x.size(d)``, ``x.shape`` and
    ``x.numel()`` on a sharded ``x`` return local ones at run time. Rescale them right after the
    query (symbolic sizes only: static sizes were constants in the trace already)."""
    is_size = n.op == "call_method" and n.target in ("size", "numel")
    is_shape = n.op == "call_function" and n.target is getattr and len(n.args) == 2 and n.args[1] == "shape"
    if not (is_size or is_shape):
        return False
    edge = plan.edges.get((0, 0))
    if edge is None or not isinstance(edge.dst, (Shard, GroupedShard, HeadShard)):
        return False
    d, world_size = edge.dst.dim, chunks(edge.dst, world_size)
    graph = n.graph
    users = list(n.users)
    total = _static_size(n.args[0], d)
    whole = isinstance(edge.dst, StridedShard) and not edge.dst.even  # its local length is not total / N
    if total is not None and total % world_size == 0 and not whole and not isinstance(edge.dst, HeadShard):
        total = None  # an even shard: local size x N, as for a symbolic dim
    if total is None and whole:
        raise PassError(f"node {n.name}: the size of a symbolic dim of the fused shard {edge.dst} is queried; its "
                        "ranks hold unequal lengths, so local x N is not its global size")
    with graph.inserting_after(n):
        if n.target == "numel" and total is not None:  # uneven: the local count over its local dim size
            with graph.inserting_before(n):
                local = graph.call_method("size", (n.args[0], d))
            fixed = graph.call_function(_global_numel, (n, local, total))
        elif n.target == "numel":
            fixed = graph.call_function(operator.mul, (n, world_size))
        elif is_size and (len(n.args) > 1 or "dim" in n.kwargs):
            k = n.args[1] if len(n.args) > 1 else n.kwargs["dim"]
            ndim = len(_edge_shape(n))
            if k % ndim != d:
                return False
            fixed = graph.call_function(operator.mul, (n, world_size)) if total is None else \
                graph.call_function(_global_size_at, (n, total))
        else:
            fixed = graph.call_function(_global_size, (n, d, world_size, total))
    for u in users:
        u.replace_input_with(n, fixed)
    return True


def _edge_shape(n: torch.fx.Node) -> tuple:
    value = n.args[0].meta.get("example_value") if isinstance(n.args[0], torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()
