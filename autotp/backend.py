"""The Dynamo backend ``autotp``: one call per graph Dynamo captures.

``torch.compile(model, backend="autotp")`` reaches :func:`autotp_backend` through the
``torch_dynamo_backends`` entry point; ``parallelize_model`` passes its own :class:`TPContext`.
Per graph: decompose -> solve -> annotate -> materialize -> rewrite (see ``autotp/passes``), with
a trace folder per graph when a trace dir is configured. The callable returned is the rewritten
graph; it ignores the global-shaped parameter values Dynamo passes and reads the local shards.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import os
import pickle
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.fx

from autotp.cache_outputs import cache_entry_leaves, refuse_spent_standins
from autotp.collectives import DEFAULT_TIMEOUT, Comm, attach_health, broadcast_object, redistribute
from autotp.compat import maybe_mark_dynamic
from autotp.config import AutoTPConfig
from autotp.context import CompiledGraph, TPContext, attach_meta, meta_of, shard_of, sharded_standin, standin
from autotp.errors import AutoTPError, SolverError
from autotp.inner import inner_compile
from autotp.memory import collecting_new_objects_only, on_a_fresh_stack, release_free_memory
from autotp.mesh import check_layout
from autotp.ops.embedding import rows_only, vocabulary_sizes, vocabulary_tables
from autotp.ops.fused import fused_segmentations, strided_candidates
from autotp.ops.heads import head_candidates, head_splits
from autotp.ops.kv_heads import kv_projections
from autotp.passes.annotate import Annotation, annotate, replicated_annotation
from autotp.passes.checkpoint import inline_checkpoints, outline_checkpoints
from autotp.passes.decompose import decompose
from autotp.passes.fuse import fuse_sibling_matmuls
from autotp.passes.inline import inline_subgraphs
from autotp.passes.materialize import materialize
from autotp.passes.pipeline import PassRunner
from autotp.passes.rewrite import rewrite
from autotp.passes.save_shards import save_input_shards
from autotp.passes.solve import ParamChoice, Solution, SolverOptions, solve
from autotp.placement import GroupedShard, HeadShard, Placement, R, Shard, shard_candidates
from autotp.plan import build_plan, first_consumer, gradient_node, parameter_entry, style_of
from autotp.plan_cache import Lookup, Uncacheable, decode_annotation, encode_annotation, summary_elsewhere
from autotp.released import refuse_eager_calls
from autotp.trace import graph_folder, write_json, write_solver_trace, write_text
from autotp.verify import verified
from autotp.weights import ParameterMeta

_SOURCE_TOKEN = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]|\['([^']+)'\]")


def grapharg_source(ph: torch.fx.Node) -> str:
    """The name of the source Dynamo read a placeholder from (``L['self']._modules[...]...``), or
    the placeholder's name."""
    grapharg = ph.meta.get("grapharg")
    return grapharg.source.name if grapharg is not None and hasattr(grapharg, "source") else ph.name


def fqn_of(source_name: str) -> str:
    """``L['self']._modules['model']._parameters['weight']`` -> ``model.weight``."""
    root = re.match(r"^[A-Z]\['[^']*'\]", source_name)
    rest = source_name[root.end():] if root else source_name
    parts = [next(g for g in m.groups() if g is not None) for m in _SOURCE_TOKEN.finditer(rest)]
    return ".".join(parts)


#: with ``sequence_parallel``, one byte of a full-size activation per rank costs as much as one
#: communicated byte per token (the second solve prices no collective latency, so any weight > 0
#: makes sequence shards win where they are feasible)
SEQUENCE_PARALLEL_WEIGHT = 1.0

#: ``torch.compile(..., backend="autotp", options={...})`` keys -> AutoTPConfig fields
BACKEND_OPTIONS = ("fuse", "compile_inner", "verify", "trace_dir", "memory_weight", "beam_width", "overrides",
                   "sequence_parallel")


def autotp_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                   options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Entry point for ``torch.compile(model, backend="autotp")``: uses the default process group
    (or runs single-process), ``AUTOTP_TRACE_DIR`` for traces and ``AUTOTP_VERIFY=1`` for
    verification (see ``autotp/verify.py``). ``options={"fuse": False, "compile_inner": "eager",
    ...}`` (any of :data:`BACKEND_OPTIONS`) set the matching :class:`AutoTPConfig` fields, and
    ``options={"mesh": mesh}`` runs tensor parallelism on ``mesh["tp"]`` (:func:`_backend_comm`).
    Rank 0 plans each graph for the group where the group's timeout lets the others wait that
    long (:func:`waits_for_a_plan`).

    One session per model: a graph whose parameters an earlier graph of this backend already met
    joins that graph's session (:func:`session_of_graph`: same group size and options), so the
    model's graphs share one graph counter, trace folder sequence, plan records and override
    bookkeeping; a graph of new parameters starts a session."""
    options = dict(options or {})
    mesh = options.pop("mesh", None)
    unknown = sorted(set(options) - set(BACKEND_OPTIONS))
    if unknown:
        raise AutoTPError(f"unknown autotp backend options {unknown}; known: {[*BACKEND_OPTIONS, 'mesh']}")
    trace_dir = os.environ.get("AUTOTP_TRACE_DIR")
    verify = os.environ.get("AUTOTP_VERIFY", "") not in ("", "0")
    fields: dict[str, Any] = {"trace_dir": Path(trace_dir) if trace_dir else None, "verify": verify, **options}
    config = AutoTPConfig(**fields)
    ctx = session_of_graph(example_inputs, config)
    if ctx is None:
        comm = _backend_comm(mesh)
        attach_health(comm)  # a failed collective names the rank that failed (autotp.health)
        # outputs may stay sharded, as under parallelize_model; the returned callable gathers all
        # but the KV-cache entries (TPContext.gather_outputs), so the cache stays sharded across steps
        ctx = TPContext(comm=comm, config=config, sharded_outputs=True, gather_outputs=True,
                        plan_once=waits_for_a_plan(comm))
    return compile_graph(gm, example_inputs, ctx)


def waits_for_a_plan(comm: Comm) -> bool:
    """May the other ranks of the caller's group wait in a collective while rank 0 plans a graph
    (``TPContext.plan_once``)? Where its timeout is at least :data:`~autotp.collectives.DEFAULT_TIMEOUT`
    (10 minutes: what autotp starts a group with, NCCL's default; gloo's is 30): a group made
    with a shorter one means it to bound how far ranks drift apart, not a plan's search, so its
    ranks each plan on their own, as a group whose timeout torch does not tell."""
    timeout = comm.timeout
    return timeout is not None and timeout >= DEFAULT_TIMEOUT


def session_of_graph(example_inputs: list[Any], config: AutoTPConfig) -> TPContext | None:
    """The session an earlier graph of the same model made: the one that placed any of these
    parameters, if its options are ``config``."""
    for value in example_inputs:
        meta = meta_of(value) if isinstance(value, torch.Tensor) else None
        if meta is not None and meta.session is not None and meta.session.config == config:
            return meta.session
    return None


def session_of(module: torch.nn.Module) -> TPContext | None:
    """The session (graphs, plans, options) of a model compiled with ``backend="autotp"`` or
    ``parallelize_model``: the one that placed its parameters; None before its first graph."""
    for p in module.parameters():
        meta = meta_of(p)
        if meta is not None and meta.session is not None:
            return meta.session
    return None


def _backend_comm(mesh: Any) -> Comm:
    """The tp group of ``options={"mesh": mesh}``: ``mesh["tp"]`` of a ``DeviceMesh`` with dims
    ``("dp", "tp")`` or ``("tp",)`` (each dp replica runs its own tensor-parallel copy of the
    model on its inputs); without a mesh the default group, or one process."""
    joined = dist.is_available() and dist.is_initialized()
    if mesh is None:
        return Comm.from_default_group() if joined else Comm.single()
    layout = check_layout(mesh, dist.get_world_size() if joined else 1, None)
    return Comm.from_group(layout.tp_group())


def make_backend(ctx: TPContext) -> Callable[..., Any]:
    """A backend bound to ``ctx`` (what ``parallelize_model`` compiles with)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return compile_graph(gm, example_inputs, ctx)

    return backend


def _is_standin(t: torch.Tensor) -> bool:
    """A zero-memory parameter: a ``standin`` (stride 0) or any meta tensor (the planner's)."""
    return t.device.type == "meta" or (t.numel() > 1 and all(s == 0 for s in t.stride()))


def _tokens(inputs: list[tuple[torch.fx.Node, Any]]) -> int:
    for _, x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and not x.dtype.is_floating_point:
            return max(int(x.numel()), 1)
    for _, x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return max(int(x.numel() // x.shape[-1]), 1)
    return 1


@dataclass
class GraphInputs:
    """A Dynamo graph's placeholders split into parameters (each with its ``ParameterMeta``) and
    the user's inputs (token ids, masks, KV-cache entries), in placeholder order."""

    placeholders: list[torch.fx.Node]
    params: dict[torch.fx.Node, torch.Tensor]
    user: list[tuple[torch.fx.Node, Any]]


@dataclass
class GraphPlan:
    """One graph's plan, as data: the placement of every value and every collective's site (the
    :class:`~autotp.passes.annotate.Annotation`), where it came from (``origin``: ``"solved"``,
    ``"plan cache"``, ``"rank 0"`` or ``"one rank"``), the plan-cache lookup that keys it, and,
    where this process solved, the solver's record and summary (where rank 0 planned it, the
    summary rank 0 sent). :func:`plan_graph` makes it without
    touching weights; :func:`lower_graph` turns it into per-rank code. The annotation serializes
    (``plan_cache.encode_annotation``): that is what the plan cache stores and rank 0 broadcasts."""

    graph_id: int
    annotation: Annotation
    origin: str
    lookup: Lookup | None = None
    record: SolveRecord | None = None
    summary: dict[str, Any] | None = None


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: TPContext) -> Callable[..., Any]:
    """Compile one Dynamo graph for this rank: :func:`plan_graph`, then :func:`lower_graph`; the
    result is recorded in the session (``ctx.graphs``)."""
    graph_id = ctx.next_graph_id()
    folder = graph_folder(ctx.config.trace_dir, ctx.rank, graph_id) if ctx.config.trace_dir else None
    runner = PassRunner(folder)
    inline_subgraphs(gm)  # a repeated layer Dynamo traced once is planned per call (passes/inline.py)
    if folder:
        write_text(folder, "dynamo_graph.py", gm.code)  # as planned: layer regions inlined
    inputs = graph_inputs(gm, example_inputs, ctx)
    if ctx.gather_outputs:  # the torch.compile entry: no boundary of its own sees a changed cache
        refuse_spent_standins((str(grapharg_source(ph)), x) for ph, x in inputs.user)
    checkpoints = inline_checkpoints(gm)  # checkpointed blocks are planned through (passes/checkpoint.py)
    with collecting_new_objects_only():  # the collector skips the model and Dynamo (autotp/memory.py)
        plan = plan_graph(gm, example_inputs, inputs, ctx, graph_id, runner, folder)
    return lower_graph(gm, example_inputs, inputs, plan, ctx, runner, folder, bool(checkpoints))


def graph_inputs(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: TPContext) -> GraphInputs:
    """Split the placeholders (see :class:`GraphInputs`). A parameter of an in-memory model meets
    autotp here: it gets its ``ParameterMeta`` (FQN from Dynamo's source), owned by this session."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params: dict[torch.fx.Node, torch.Tensor] = {}
    user: list[tuple[torch.fx.Node, Any]] = []
    for ph, value in zip(placeholders, example_inputs, strict=True):
        if isinstance(value, torch.Tensor) and (isinstance(value, torch.nn.Parameter) or meta_of(value)):
            meta = meta_of(value)
            if meta is None:
                fqn = fqn_of(grapharg_source(ph))
                meta = ParameterMeta(fqn=fqn, global_shape=tuple(value.shape), dtype=value.dtype, checkpoint_key=None,
                                     checkpoint=None, placement=None, tied=(fqn,))
                attach_meta(value, meta)
            if meta.session is None:
                meta.session = ctx
            params[ph] = value
        else:
            user.append((ph, value))
    return GraphInputs(placeholders, params, user)


def plan_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], inputs: GraphInputs, ctx: TPContext,
               graph_id: int, runner: PassRunner, folder: Path | None) -> GraphPlan:
    """The plan of one graph, reading no weight: one rank needs none; else the plan cache's entry,
    or the plan rank 0 made for the group (``_plans_once``), or a solve (:func:`_solve`) whose
    result the cache stores. Parameters an earlier graph placed are pinned."""
    if ctx.world_size == 1:  # one rank: every placement is R
        return GraphPlan(graph_id, replicated_annotation(gm), "one rank")
    lookup = _cache_lookup(gm, example_inputs, inputs.params, inputs.placeholders, ctx)
    shared = _plans_once(ctx)
    received = _receive_plan(gm, inputs.params, lookup, ctx, graph_id) if shared and ctx.rank != 0 else None
    if received is not None:  # rank 0's plan; where this rank hit the same entry, its own decode of it
        annotation, summary = received
        mine = lookup.cached is not None and annotation is lookup.cached.annotation
        plan = GraphPlan(graph_id, annotation, "plan cache", lookup) if mine else \
            GraphPlan(graph_id, annotation, "rank 0", lookup, summary=summary)
    elif lookup.cached is not None:  # a hit: the stored plan, checked against this graph
        plan = GraphPlan(graph_id, lookup.cached.annotation, "plan cache", lookup)
    else:
        timings: dict[str, float] = {}
        try:
            # on a fresh stack: planning's hot loops (decompose's, the search's) must not run at whatever
            # depth Dynamo calls the backend (``memory.on_a_fresh_stack``)
            record, annotation = on_a_fresh_stack(_solve)(gm, example_inputs, inputs.params, inputs.user, ctx, runner,
                                                          timings, folder)
        except BaseException as e:
            if shared and ctx.rank == 0:
                broadcast_object(("error", _picklable(e), None), ctx.comm)  # the others raise it too, not hang
            raise
        summary = _solve_summary(record.solution, record.shadow, record.opts, timings)
        if ctx.config.overrides:  # patterns no graph of this model named so far (a later graph may)
            summary["overrides_unmatched"] = sorted(set(ctx.config.overrides) - ctx.overrides_matched)
        ctx.plan_cache.solved(lookup, gm, annotation, summary)
        plan = GraphPlan(graph_id, annotation, "solved", lookup, record, summary)
    if shared and ctx.rank == 0:
        _send_plan(gm, plan.annotation, lookup, plan.summary, ctx)
    return plan


def lower_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], inputs: GraphInputs, plan: GraphPlan,
                ctx: TPContext, runner: PassRunner, folder: Path | None, checkpointed: bool) -> Callable[..., Any]:
    """Turn ``plan`` into this rank's code: materialize (read this rank's shards), rewrite (local
    ops and collectives), fuse sibling matmuls, save sequence shards, outline checkpointed blocks,
    then the inner compiler. Records a :class:`~autotp.context.CompiledGraph` in the session and
    writes the trace folder."""
    world = ctx.world_size
    annotation, param_inputs = plan.annotation, inputs.params
    consumers = {ph: first_consumer(ph) for ph in param_inputs}
    # read off the graph as Dynamo captured it, before the rewrite replaces its nodes
    cache_leaves = cache_entry_leaves(gm, [ph for ph, x in inputs.user if shard_of(x) is not None]) \
        if ctx.gather_outputs else None
    dynamic = _dynamic_outputs(gm)
    check = _verification(gm, annotation, inputs.placeholders, param_inputs, example_inputs, ctx) \
        if ctx.config.verify and world > 1 else None
    record = plan.record
    solver_trace = record.solution.trace if folder and record is not None else None
    if not ctx.keep_solve_records and plan.origin in ("solved", "rank 0"):
        # Memory: the shadow ATen graph and its fake tensors are garbage from here on; free them
        # and hand the pages back (autotp/memory.py). A full collection (~0.9 s with the benchmark
        # model loaded) only when this rank is about to read shards, so that the reads do not
        # stack on the tracing's garbage; a later graph (recompile, decode step) only trims.
        record = plan.record = None
        reads = any(meta_of(v).local is None and meta_of(v).checkpoint is not None for v in param_inputs.values())
        release_free_memory(collect=reads)
    # with fusion on, materialize reads each group the fuse pass will fuse into one buffer
    locals_ = runner.run("materialize", materialize, annotation, param_inputs, ctx,
                         gm.graph if ctx.config.fuse else None)
    report = runner.run("rewrite", rewrite, gm, annotation, locals_, ctx.comm, lint=gm)
    fusion = runner.run("fuse", fuse_sibling_matmuls, gm, lint=gm) if ctx.config.fuse else None
    # sequence parallelism: column-parallel matmuls save their input's sequence shard for backward
    save_shards = runner.run("save_shards", save_input_shards, gm, ctx.comm, lint=gm).as_dict() \
        if ctx.config.sequence_parallel and world > 1 and gradient_node(gm) is not None else None
    checkpoints = runner.run("checkpoint", outline_checkpoints, gm, lint=gm).as_dict() if checkpointed else None
    sharded_outputs = _sharded_outputs(gm, annotation)
    parameters = build_plan(world, {
        meta_of(v).fqn: parameter_entry(meta_of(v).placement, consumers[ph], tuple(v.shape), world)
        for ph, v in param_inputs.items()
    }, report.collectives, sharded_outputs=len(sharded_outputs))
    if world > 1:
        ctx.plan_cache.finish(plan.lookup, parameters)
    forward, inner_info = inner_compile(gm, ctx.config.compile_inner, ctx.comm)
    compiled = CompiledGraph(plan.graph_id, parameters, fusion.as_dict() if fusion is not None else None,
                             save_shards, checkpoints, sharded_outputs, inner_info, record)
    ctx.graphs.append(compiled)
    if folder:
        _write_trace(folder, gm, plan, compiled, report, solver_trace, world)
    run = _release_after_first_call(gm, param_inputs, forward)
    if check is not None:
        run = check(run, gm)
    gathered = frozenset(w.leaf for w in sharded_outputs if w.leaf not in cache_leaves) \
        if cache_leaves is not None else frozenset()
    return _bind_sharded_values(run, sharded_outputs, example_inputs, ctx.comm, gathered, dynamic)


def _write_trace(folder: Path, gm: torch.fx.GraphModule, plan: GraphPlan, compiled: CompiledGraph, report: Any,
                 solver_trace: Any, world: int) -> None:
    """One graph's trace folder (``docs/architecture.md``, "Traces"), after lowering."""
    if world > 1:
        write_json(folder, "plan_cache.json", plan.lookup.outcome.as_dict())
        if plan.origin == "plan cache":  # the solve's summary as stored; no decisions (nothing was searched)
            write_json(folder, "summary.json", {**plan.lookup.cached.trace_summary(),
                                                "local_rewrites": dict(report.local_rewrites)})
        elif plan.origin == "rank 0":  # rank 0's summary; the decisions are in rank 0's trace of this graph
            write_json(folder, "summary.json", {
                **summary_elsewhere(plan.summary or {}, "solve_timings"), "plan_from": "rank 0",
                "rank0_trace": f"rank0/{folder.name}", "plan_cache": plan.lookup.outcome.status,
                "local_rewrites": dict(report.local_rewrites), "uneven_shards": compiled.plan.get("uneven", {})})
    modules = "".join(f"# {name}: {mod.extra_repr()}\n" for name, mod in gm.named_children())
    write_text(folder, "rewritten_graph.py", modules + gm.code)
    write_json(folder, "plan.json", compiled.plan)
    write_json(folder, "fusion.json", compiled.fusion or {"disabled": True})
    if compiled.save_shards is not None:
        write_json(folder, "save_shards.json", compiled.save_shards)
    if solver_trace is not None:
        write_solver_trace(folder, solver_trace, {**plan.summary, "plan_cache": plan.lookup.outcome.status,
                                                  "local_rewrites": dict(report.local_rewrites),
                                                  "uneven_shards": compiled.plan.get("uneven", {})})
    write_json(folder, "inner.json", compiled.inner)  # the fallback of a failed first call is added then


def _plans_once(ctx: TPContext) -> bool:
    """Does rank 0 plan each graph for the group (:func:`_send_plan`, :func:`_receive_plan`)?

    Every rank of a tensor-parallel group compiles the same graphs in the same order with the same
    inputs' shapes, and the solve is deterministic, so N ranks solving the same graph did the same
    work N times (N x the CPU of decompose + solve on a machine whose ranks share cores). Rank 0
    plans (from the plan cache or by solving) and broadcasts the annotation; the others rebuild it
    on their own graph, checked like a cache entry. Only where the context asks for it
    (``TPContext.plan_once``: the other ranks wait while rank 0 plans); not for a simulated group
    (one process) nor for tools that keep solver records (they read this process's solve). With a
    trace folder, rank 0's trace holds the solve (``aten_graph.py``, ``decisions.jsonl``) and the
    others' say where their plan came from (:func:`_write_trace`)."""
    return ctx.plan_once and not ctx.comm.simulated and not ctx.keep_solve_records


def _send_plan(gm: torch.fx.GraphModule, annotation: Annotation, lookup: Lookup, summary: dict[str, Any] | None,
               ctx: TPContext) -> None:
    """Rank 0: broadcast this graph's plan (the JSON annotation the plan cache stores, and the
    solve's summary), or, for a plan JSON cannot carry, ask every rank to solve on its own."""
    try:
        if lookup.pending is not None:  # a miss: what the cache stores
            encoded = lookup.pending[0]
        elif lookup.cached is not None:  # a hit: the entry as stored, not encoded again
            encoded = lookup.cached.encoded
        else:
            encoded = encode_annotation(gm, annotation)
    except (Uncacheable, ValueError):
        broadcast_object(("solve", None, None), ctx.comm)
        return
    solve_summary = lookup.pending[1] if lookup.pending is not None else \
        (lookup.cached.solve if lookup.cached is not None else summary)
    broadcast_object(("plan", encoded, solve_summary), ctx.comm)


def _receive_plan(gm: torch.fx.GraphModule, param_inputs: dict[torch.fx.Node, torch.Tensor], lookup: Lookup,
                  ctx: TPContext, graph_id: int) -> tuple[Annotation, dict[str, Any] | None] | None:
    """Ranks other than 0: the annotation rank 0 planned, rebuilt on this rank's graph, and the
    solve's summary rank 0 sent (None: rank 0 asks every rank to solve). After a cache miss the
    entry is stored here too, as if solved."""
    kind, encoded, summary = broadcast_object(None, ctx.comm)
    if kind == "error":
        raise encoded
    if kind == "solve":
        return None
    if lookup.cached is not None and lookup.cached.encoded == encoded:
        return lookup.cached.annotation, summary  # this rank hit the same entry: already decoded and checked
    params = {ph.name: (tuple(meta_of(v).global_shape), meta_of(v).placement) for ph, v in param_inputs.items()}
    try:
        annotation = decode_annotation(gm, encoded, ctx.world_size, params)
    except (KeyError, TypeError, ValueError) as e:
        raise AutoTPError(f"rank {ctx.rank} could not use the plan rank 0 made for graph {graph_id} "
                          f"({type(e).__name__}: {e}); the ranks compiled different graphs") from e
    if lookup.key is not None and lookup.cached is None and summary is not None:
        lookup.pending = (encoded, summary)
    return annotation, summary


def _picklable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (to reach the other ranks), else an AutoTPError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception may fail to pickle
        return AutoTPError(f"rank 0 failed planning: {type(e).__name__}: {e}")


#: AutoTPConfig fields that cannot change a graph's plan (placements, collectives, local
#: rewrites), left out of the plan cache's key; every other field is in it
PLAN_NEUTRAL_OPTIONS = ("trace_dir", "verify", "compile_inner", "tp_size")


def plan_options(ctx: TPContext) -> dict[str, str | bool]:
    """The session's options that can change a plan, as the plan cache and the stored graphs key
    them: every ``AutoTPConfig`` field not in :data:`PLAN_NEUTRAL_OPTIONS` (a new option is in the
    key until listed there) and whether outputs may stay sharded."""
    config = ctx.config
    options: dict[str, str | bool] = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)
                                      if f.name not in PLAN_NEUTRAL_OPTIONS}
    options.update(sharded_outputs=ctx.sharded_outputs)
    return options


def _cache_lookup(gm: torch.fx.GraphModule, example_inputs: list[Any], param_inputs: dict[torch.fx.Node, torch.Tensor],
                  placeholders: list[torch.fx.Node], ctx: TPContext) -> Lookup:
    """Key this graph for the plan cache (``autotp/plan_cache.py``) with every option that can
    change its plan, and read its entry. Tools that re-solve from the solver's record (``autotp
    plan``) bypass the cache: a hit has no solver record."""
    options = plan_options(ctx)
    params = {i: meta_of(param_inputs[ph]) for i, ph in enumerate(placeholders) if ph in param_inputs}
    sharded = {i: shard[1] for i, x in enumerate(example_inputs) if (shard := shard_of(x)) is not None}
    bypass = "solver records kept for tools" if ctx.keep_solve_records else None
    return ctx.plan_cache.lookup(gm, example_inputs, params, sharded, ctx.world_size, options, bypass)


def _solve_summary(solution: Solution, shadow: Any, opts: SolverOptions, timings: dict[str, float]) -> dict[str, Any]:
    """What a solve reports in the trace (kept in the plan cache for a hit's trace)."""
    return {"cost": solution.cost, "comm_cost": solution.comm_cost, "memory_cost": solution.memory_cost,
            "lower_bound": solution.lower_bound, "gap": solution.gap, "replicated_bytes": solution.replicated_bytes,
            "tokens": opts.tokens, "aten_nodes": len(shadow.aten.graph.nodes),
            "dynamo_nodes": len(shadow.dynamo_nodes), **timings}


def _verification(gm: torch.fx.GraphModule, annotation: Any, placeholders: list[torch.fx.Node],
                  param_inputs: dict[torch.fx.Node, torch.Tensor], example_inputs: list[Any],
                  ctx: TPContext) -> Callable[..., Callable[..., Any]] | None:
    """``verify=True``: keep the graph as it was before the rewrite and how to read each parameter
    in full, so the first call can be compared node by node (``autotp/verify.py``). Graphs that
    receive a sharded KV cache are not verified (their reference would need the gathered cache);
    the prefill graph that produced it was."""
    if any(shard_of(x) is not None for x in example_inputs):
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # nodes keep their names; the rewrite edits gm only
    reference = torch.fx.GraphModule(gm, graph)
    placements = {n.name: plan.output() for n, plan in annotation.plans.items()}
    full: dict[int, Callable[[], torch.Tensor]] = {}
    for i, ph in enumerate(placeholders):
        if ph in param_inputs:
            meta, value = meta_of(param_inputs[ph]), param_inputs[ph]
            if meta.checkpoint is not None:
                full[i] = lambda m=meta, v=value: m.checkpoint.read_slice(
                    m.checkpoint_key, None, 0, 0, dtype=ctx.config.dtype or m.dtype).to(v.device)
            else:
                full[i] = lambda v=value: v.detach()
    return lambda run, rewritten: verified(run, reference, rewritten, placements, full, ctx.comm)


#: transformers' spellings of the styles autotp understands (``DistributedConfig(tp_plan=...)``).
STYLE_ALIASES = {
    "colwise_gather_output": "colwise", "colwise_rep": "colwise", "rowwise_rep": "rowwise",
    "rowwise_split_input": "rowwise", "embedding_rowwise": "vocab", "embedding_colwise": "colwise",
    "replicated": "replicate", "packed_colwise": "colwise", "packed_rowwise": "rowwise",
}
_SHARD_STYLE = re.compile(r"^(?:shard|s)\((-?\d+)\)$")


@dataclass
class SolveRecord:
    """What :func:`_solve` made, kept for tools such as ``autotp plan`` (``CompiledGraph.solve``): the shadow graph and the exact solver inputs (so a caller can re-solve with
    one parameter pinned, e.g. to cost an alternative), the solution, and the cost of the
    overrides (``free_cost`` is the unconstrained optimum, None without overrides)."""

    shadow: Any
    opts: SolverOptions
    fixed: dict[torch.fx.Node, Any]
    free: dict[torch.fx.Node, ParamChoice]
    param_nodes: set[torch.fx.Node]
    solution: Any
    fqn_of_aten: dict[torch.fx.Node, str]
    consumers: dict[torch.fx.Node, torch.fx.Node | None]
    overrides: dict[str, list[str]] = field(default_factory=dict)
    free_cost: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


def override_placements(style: str, options: list[tuple[Any, float]], consumer: torch.fx.Node | None,
                        ndim: int) -> list[tuple[Any, float]]:
    """The options of one parameter that a style override allows.

    ``replicate`` -> ``R``; ``shard(d)`` -> ``Shard(d)``; a named style (``colwise``, ``rowwise``,
    ``vocab``, or transformers' spelling of them) -> every option whose style, read off the
    parameter's consumer op exactly as the plan reads it (:func:`autotp.plan.style_of`), is that
    style. A 1-D parameter (a bias) under ``rowwise`` is ``R``: a row-parallel bias is added once,
    after the reduction.
    """
    style = STYLE_ALIASES.get(style.strip().lower(), style.strip().lower())
    if style == "replicate":
        return [(p, c) for p, c in options if p == R]
    m = _SHARD_STYLE.match(style)
    if m:
        dim = int(m.group(1)) % max(ndim, 1)
        return [(p, c) for p, c in options if isinstance(p, Shard) and p.dim == dim]
    if ndim == 1 and style == "rowwise":
        return [(p, c) for p, c in options if p == R]
    return [(p, c) for p, c in options if style_of(p, consumer, ndim) == style]


def matching_overrides(names: tuple[str, ...], overrides: Mapping[str, str]) -> list[str]:
    """Override patterns that name a parameter: ``fnmatch`` on any of its names (tied parameters
    have several) or on its module's name (``lm_head`` names ``lm_head.weight`` and its bias, as
    in a transformers ``tp_plan``)."""
    targets = set(names) | {n.rpartition(".")[0] for n in names}
    return [pat for pat in overrides if any(fnmatch.fnmatchcase(t, pat) for t in targets)]


def check_override_styles(overrides: Mapping[str, str]) -> None:
    """Refuse a style no parameter could take, before anything is traced."""
    known = ("colwise", "rowwise", "vocab", "replicate", *STYLE_ALIASES)
    for pat, style in overrides.items():
        if not isinstance(style, str) or (style.strip().lower() not in known
                                          and not _SHARD_STYLE.match(style.strip().lower())):
            raise AutoTPError(f"override {pat!r}: unknown style {style!r}; use one of {list(known[:4])}, "
                              "'shard(d)', or a transformers spelling such as 'colwise_gather_output'")


def check_names(module: torch.nn.Module, patterns: Sequence[str] | Mapping[str, str], what: str) -> None:
    """Refuse, before anything is traced, patterns that name no parameter of ``module`` (fnmatch on
    parameter and module names, as overrides and ``explain_matching`` read them), with close names."""
    names = tuple(n for n, _ in module.named_parameters(remove_duplicate=False))
    unknown = [pat for pat in patterns if not matching_overrides(names, {pat: ""})]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=3)
        raise AutoTPError(
            f"{what} {unknown} match no parameter or module of {type(module).__name__} "
            "(patterns are fnmatch on names such as 'model.layers.*.mlp.down_proj' or 'lm_head')."
            f"{f' Close names: {close}.' if close else ''}"
        )


def check_overrides(module: torch.nn.Module, overrides: Mapping[str, str]) -> None:
    """Refuse overrides with an unknown style or naming nothing in ``module``, before tracing
    (the entry points that hold the module call this; ``backend="autotp"`` sees graphs only, and
    its trace lists the patterns no graph matched so far)."""
    check_override_styles(overrides)
    check_names(module, overrides, "override pattern(s)")


def _apply_overrides(free: dict[torch.fx.Node, ParamChoice], aten_params: dict[torch.fx.Node, tuple],
                     overrides: Mapping[str, str]) -> dict[str, list[str]]:
    """Narrow each free parameter's options to what the overrides allow (in place); returns
    pattern -> the parameters of this graph it names. An override that leaves a parameter no option
    raises :class:`AutoTPError`; one that names no parameter of this graph is not an error here
    (another graph of the model may hold it: see :func:`check_overrides`)."""
    check_override_styles(overrides)
    used: dict[str, list[str]] = {pat: [] for pat in overrides}
    for node, (names, consumer, shape) in aten_params.items():
        pats = matching_overrides(names, overrides)
        for pat in pats:
            used[pat].append(names[0])
        if not pats or node not in free:
            continue  # pinned parameters were placed (with the overrides) by an earlier graph
        options = free[node].options
        for pat in pats:
            allowed = override_placements(overrides[pat], options, consumer, len(shape))
            if not allowed:
                offered = ", ".join(f"{style_of(p, consumer, len(shape))} ({p})" for p, _ in free[node].options)
                raise AutoTPError(
                    f"override {pat!r}: {overrides[pat]!r} cannot be honoured for {names[0]} (shape "
                    f"{tuple(shape)}, consumed by {getattr(consumer, 'target', None)}): it may be {offered}, no other. "
                    "Use one of those, or drop the override and let the solver choose."
                )
            options = allowed
        free[node] = free[node].narrowed(options)
    return {pat: hits for pat, hits in used.items() if hits}


def _solve(gm: torch.fx.GraphModule, example_inputs: list[Any], param_inputs: dict[torch.fx.Node, torch.Tensor],
           user_inputs: list[tuple[torch.fx.Node, Any]], ctx: TPContext, runner: PassRunner,
           timings: dict[str, float], folder: Path | None) -> tuple:
    """decompose -> solve -> annotate, with parameters already placed by earlier graphs pinned and
    the user's overrides (``AutoTPConfig.overrides``) as constraints on the free ones.

    With overrides, the solve runs twice: constrained (the plan) and free (to report what the
    overrides cost, ``overrides_extra_cost`` in the trace summary). A constrained solve with no
    feasible plan raises :class:`AutoTPError` naming the overrides. The inputs and the solution are
    returned as a :class:`SolveRecord` with the annotation."""
    world = ctx.world_size
    t, c = time.perf_counter(), time.process_time()
    shadow = runner.run("decompose", decompose, gm, example_inputs)
    timings["decompose_s"], timings["decompose_cpu_s"] = time.perf_counter() - t, time.process_time() - c
    if folder:
        write_text(folder, "aten_graph.py", shadow.aten.code)
    aten_of = {dyn: aten for aten, dyn in shadow.placeholders}
    fused = fused_segmentations(shadow.aten.graph, world)
    backward = gradient_node(gm) is not None
    kv_heads = kv_projections(shadow.aten.graph, world)
    vocabularies = vocabulary_sizes(shadow.aten.graph, world)  # dims that may be split unevenly
    vocabulary = vocabulary_tables(shadow.aten.graph)  # token embeddings: split by rows only
    splits = head_splits(shadow.aten.graph, world)  # heads no tp divides
    fixed, free = {}, {}
    aten_params: dict[torch.fx.Node, tuple] = {}
    for ph, value in param_inputs.items():
        meta = meta_of(value)
        aten_params[aten_of[ph]] = ((meta.fqn, *[n for n in meta.tied if n != meta.fqn]), first_consumer(ph),
                                    tuple(value.shape))
        if meta.placement is not None:
            fixed[aten_of[ph]] = meta.placement
        else:
            nbytes = value.numel() * value.element_size()
            options = [(R, nbytes * (world - 1) / world)]
            # a dim of whole heads no tp divides is split in whole heads, not cut inside one (a beam of
            # 32 lost the head split among plain shards that gather q back before attention)
            # (likewise a fused q|k|v dim whose layout keeps heads whole: Phi-3's with kv heads per group)
            in_heads = head_candidates(tuple(value.shape), splits)
            # fused q|k|v; segments held whole on every rank cost their bytes beyond 1/N, as R does,
            # and are offered to inference graphs only: a training graph would also pay the whole
            # rows' gradient all-reduce (layers.WholeSegmentGradient), which the solver does not price
            # (nor the kv groups', layers.ChunkGroupGradient)
            strided = [s for s in strided_candidates(tuple(value.shape), fused) if not (backward and s.shared)]
            whole_heads = {h.dim for h in in_heads} | {s.dim for s in strided if not s.even}
            options += [(s, 0.0) for s in shard_candidates(tuple(value.shape), world, vocabularies)
                        if s.dim not in whole_heads]
            options += [(s, nbytes * s.whole_share(world)) for s in strided]
            options += [(s, 0.0) for s in in_heads]
            if aten_of[ph] in vocabulary:  # autotp/ops/embedding.py: which tables are split by columns
                options = rows_only(options)
            heads = kv_heads.get(aten_of[ph]) if not backward else None  # grouped shards: forward only
            if heads is not None:  # a k/v projection whose heads tp exceeds: kept whole, one head per rank
                options = options[:1] + [(g, nbytes * (1 / g.groups - 1 / world))
                                         for g in heads.placements(tuple(value.shape))]
            free[aten_of[ph]] = ParamChoice(options, tuple(value.shape), kv_heads=heads.count if heads else 0)
    for ph, value in user_inputs:  # inputs are replicated, except KV-cache entries a graph left sharded
        shard = shard_of(value)
        fixed[aten_of[ph]] = shard[1] if shard else R
    opts = SolverOptions(world_size=world, tokens=_tokens(user_inputs), memory_weight=ctx.config.memory_weight,
                         backward=backward, kv_groups=() if backward else tuple(sorted(
                             {h.count for h in kv_heads.values() if h.count >= 2})),
                         beam_width=ctx.config.beam_width, sharded_outputs=ctx.sharded_outputs)
    overrides = dict(ctx.config.overrides or {})
    unconstrained = dict(free)
    used = _apply_overrides(free, aten_params, overrides) if overrides else {}
    ctx.overrides_matched.update(used)
    param_nodes = {aten_of[p] for p in param_inputs}
    t, c = time.perf_counter(), time.process_time()
    try:
        # sequence parallelism re-solves with every parameter pinned where this solve stores it; with
        # none free (an earlier graph placed them) that is every parameter as it is: one solve does
        solution = runner.run("solve", solve, shadow, opts, fixed, free, param_nodes) \
            if free or not ctx.config.sequence_parallel else None
    except SolverError as e:
        if not used:
            raise
        raise AutoTPError(
            f"the overrides {', '.join(f'{p!r}: {overrides[p]!r}' for p in used)} leave no valid placement "
            f"plan: {str(e).splitlines()[0]} Drop or change those overrides."
        ) from e
    free_cost = None
    if used and any(free[n] is not unconstrained[n] for n in free):
        free_cost = solve(shadow, opts, fixed, unconstrained, param_nodes).cost
        timings["overrides_extra_cost"] = solution.cost - free_cost
    if ctx.config.sequence_parallel:
        solution, opts = runner.run("solve", _sequence_parallel, shadow, opts, fixed, solution, param_nodes)
    timings["solve_s"], timings["solve_cpu_s"] = time.perf_counter() - t, time.process_time() - c
    t = time.perf_counter()
    annotation = runner.run("annotate", annotate, shadow, solution)
    timings["annotate_s"] = time.perf_counter() - t
    record = SolveRecord(shadow, opts, fixed, free, param_nodes, solution,
                         {n: names[0] for n, (names, _, _) in aten_params.items()},
                         {n: consumer for n, (_, consumer, _) in aten_params.items()}, used, free_cost, timings)
    return record, annotation


def _sequence_parallel(shadow: Any, opts: SolverOptions, fixed: dict[torch.fx.Node, Placement],
                       solution: Solution | None, param_nodes: set[torch.fx.Node]) -> tuple[Solution, SolverOptions]:
    """Second solve for ``sequence_parallel``: every parameter pinned where the first (pure
    communication) solve stored it (``solution``; None where an earlier graph pinned them all and
    there was no first solve), activations re-placed with full-size activations priced
    (``SolverOptions.activation_weight``), and no latency per collective: the user asked to trade
    collectives for activation memory, and a reduce-scatter plus an all-gather move the bytes of
    the all-reduce they replace. Pinning keeps the Megatron weight layout and leaves the
    search only the activations' placements; where no activation can be sharded (a one-token
    decode step) the first plan's placements come back. Symbolic sizes (a dynamic-shape graph's
    sequence length) may be sharded here, as in Megatron: with sequence parallelism every
    sequence length must divide by the world size (a length that does not raises a
    ``ShardingError`` naming it), where the first solve's plan runs at any length."""
    sp_opts = dataclasses.replace(opts, activation_weight=SEQUENCE_PARALLEL_WEIGHT, latency_bytes=0.0,
                                  shard_symbolic_dims=True)
    params = solution.params if solution is not None else {}
    second = solve(shadow, sp_opts, {**fixed, **params}, {}, param_nodes)
    second.params = dict(params)
    return second, sp_opts


def _release_after_first_call(gm: torch.fx.GraphModule, param_inputs: dict[torch.fx.Node, torch.Tensor],
                              forward: Callable[..., Any]) -> Callable[..., Any]:
    """For in-memory models: once the graph has run, point each full parameter at a zero-memory
    stand-in so this rank keeps only its shard (Dynamo recompiles once on the new strides, and the
    recompiled graph finds every placement pinned); the original module then refuses an eager call
    (:func:`~autotp.released.refuse_eager_calls`)."""
    full = [v for v in param_inputs.values() if not _is_standin(v)
            and isinstance(meta_of(v).placement, (Shard, GroupedShard, HeadShard))]
    if not full:
        return forward
    state = {"released": False}

    def run(*args: Any) -> Any:
        out = forward(*args)
        if not state["released"]:
            state["released"] = True
            with torch.no_grad():
                for v in full:  # NaN-filled: a last guard for code reading a parameter outside a module call
                    v.data = standin(tuple(v.shape), v.dtype, v.device, False, fill=float("nan")).data
            refuse_eager_calls(full)  # calling the original module raises, saying what to call (autotp/released.py)
        return out

    return run


class ShardedOutput(NamedTuple):
    """A value the graph's result leaves sharded (a KV-cache entry, the logits): where it is in the
    result (index path), its placement, the output edge's leaf and sub, its dims whose size is
    symbolic in this graph (a cache's sequence length in a dynamic-shape graph), and the global
    size of the sharded dim when it is static (an uneven split needs it to trim the gather)."""

    path: tuple[int, ...]
    placement: Shard | GroupedShard | HeadShard
    leaf: int
    sub: int
    symbolic_dims: tuple[int, ...]
    size: int | None


class DynamicOutput(NamedTuple):
    """A tensor the graph's result leaves whole (replicated: one rank's KV cache, a kv head every
    rank keeps, the logits) with dims whose size is symbolic in this graph: where it is in the
    result (index path) and those dims."""

    path: tuple[int, ...]
    symbolic_dims: tuple[int, ...]


def _output_leaves(gm: torch.fx.GraphModule) -> Iterator[tuple[tuple[int, ...], int, int, Any]]:
    """Each value of the graph's result: its index path in the result, the output edge's leaf and
    sub (a node with several values is one leaf, its values subs) and its example value."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaf = iter(range(1 << 30))

    def walk(arg: Any, path: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], int, int, Any]]:
        if isinstance(arg, (tuple, list)):
            for i, a in enumerate(arg):
                yield from walk(a, (*path, i))
        elif isinstance(arg, torch.fx.Node):
            k = next(leaf)
            value = arg.meta.get("example_value")
            if isinstance(value, (tuple, list)):
                for sub, v in enumerate(value):
                    yield (*path, sub), k, sub, v
            else:
                yield path, k, 0, value

    yield from walk(output.args[0], ())


def _symbolic_dims(value: Any) -> tuple[int, ...]:
    return tuple(d for d, size in enumerate(getattr(value, "shape", ())) if not isinstance(size, int))


def _sharded_outputs(gm: torch.fx.GraphModule, annotation: Any) -> list[ShardedOutput]:
    """Where the graph's result leaves values sharded (see :class:`ShardedOutput`)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    edges = annotation.plans[output].edges if output in annotation.plans else {}
    found: list[ShardedOutput] = []
    for path, k, sub, value in _output_leaves(gm):
        e = edges.get((k, sub))
        if e is not None and isinstance(e.dst, (Shard, GroupedShard, HeadShard)):
            shape = getattr(value, "shape", ())
            size = shape[e.dst.dim] if len(shape) > e.dst.dim else None
            found.append(ShardedOutput(path, e.dst, k, sub, _symbolic_dims(value),
                                       size if isinstance(size, int) else None))
    return found


def _dynamic_outputs(gm: torch.fx.GraphModule) -> list[DynamicOutput]:
    """The tensors of the result whose dims are symbolic (see :class:`DynamicOutput`; read before
    the rewrite replaces the nodes, whose example values it reads)."""
    return [DynamicOutput(path, dims) for path, _, _, value in _output_leaves(gm)
            if isinstance(value, torch.Tensor) and (dims := _symbolic_dims(value))]


def _bind_sharded_values(run: Callable[..., Any], wraps: list[ShardedOutput], example_inputs: list[Any],
                         comm: Comm, gathered: frozenset[int], dynamic: list[DynamicOutput]) -> Callable[..., Any]:
    """Values that cross graphs sharded (KV-cache entries, see ``TPContext.sharded_outputs``):
    a sharded input arrives as a :func:`~autotp.context.sharded_standin` and the graph gets its
    local shard; a sharded output leaves as a new stand-in around the local result, or, where its
    leaf is in ``gathered`` (``TPContext.gather_outputs``: the torch.compile entry's logits and every
    other output that is not a KV-cache entry), gathered whole here, one all-gather when the call returns.

    A dim that is symbolic in this graph stays dynamic in the next graph that reads the stand-in
    (``torch._dynamo.maybe_mark_dynamic``): the first decode step after a dynamic-shape prefill
    then compiles the graph every later step reuses, instead of a graph for the prompt's cache
    length and, one step later, the dynamic one (a greedy ``generate`` compiles one decode graph).
    The same holds for what leaves whole (``dynamic``, less the sharded ones: one rank's KV cache, a
    cache every rank keeps whole): its symbolic dims are marked on the returned tensor itself."""
    inputs = [i for i, x in enumerate(example_inputs) if shard_of(x) is not None]
    sharded = {w.path for w in wraps}
    dynamic = [d for d in dynamic if d.path not in sharded]  # the stand-ins carry their own marks
    if not inputs and not wraps and not dynamic:
        return run

    def call(*args: Any) -> Any:
        args = list(args)
        for i in inputs:
            shard = shard_of(args[i])
            if shard is None:
                raise AutoTPError(
                    f"graph input {i} was a sharded KV-cache entry when this graph was compiled but is a "
                    "plain tensor now: the cache was changed outside the model (e.g. reordered or "
                    "cropped eagerly). Keep the cache returned by the parallelized model, or pass "
                    "use_cache=False")
            args[i] = shard[0]
        out = run(*args)
        for w in wraps:
            out = _replace_at(out, w.path, lambda local, w=w: redistribute(local, w.placement, R, comm, size=w.size)
                              if w.leaf in gathered else _growing_standin(local, w, comm.world_size))
        for d in dynamic:  # marked in place: the result is not rebuilt
            _mark_dynamic(_item_at(out, d.path), d.symbolic_dims)
        return out

    return call


def _mark_dynamic(value: Any, dims: tuple[int, ...]) -> None:
    """Mark ``dims`` of ``value`` (a tensor) dynamic for the next graph that reads it."""
    if isinstance(value, torch.Tensor):
        for dim in dims:
            maybe_mark_dynamic(value, dim)


def _item_at(obj: Any, path: tuple[int, ...]) -> Any:
    """The item at ``path`` (indices into nested tuples/lists) of ``obj``."""
    for i in path:
        obj = obj[i]
    return obj


def _growing_standin(local: torch.Tensor, output: ShardedOutput, world: int) -> torch.Tensor:
    """The stand-in of one sharded output, its symbolic dims marked dynamic for the next graph."""
    out = sharded_standin(local, output.placement, world, output.path, output.size)
    _mark_dynamic(out, output.symbolic_dims)
    return out


def _replace_at(obj: Any, path: tuple[int, ...], fn: Callable[[Any], Any]) -> Any:
    """``obj`` with the item at ``path`` (indices into nested tuples/lists) replaced by ``fn(item)``."""
    if not path:
        return fn(obj)
    items = list(obj)
    items[path[0]] = _replace_at(items[path[0]], path[1:], fn)
    return type(obj)(items)
