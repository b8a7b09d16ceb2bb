"""The Dynamo backend ``autotp``: one call per graph Dynamo captures.

``torch.compile(model, backend="autotp")`` reaches :func:`autotp_backend` through the
``torch_dynamo_backends`` entry point; ``parallelize_model`` passes its own :class:`TPContext`.
Per graph: decompose -> solve -> annotate -> materialize -> rewrite (see ``autotp/passes``), with
a trace folder per graph when a trace dir is configured. The callable returned is the rewritten
graph; it ignores the global-shaped parameter values Dynamo passes and reads the local shards.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from autotp.collectives import Comm
from autotp.config import AutoTPConfig
from autotp.context import TPContext, attach_meta, meta_of, standin
from autotp.passes.annotate import annotate, replicated_annotation
from autotp.passes.decompose import decompose
from autotp.passes.materialize import materialize
from autotp.passes.pipeline import PassRunner
from autotp.passes.rewrite import rewrite
from autotp.passes.solve import ParamChoice, SolverOptions, solve
from autotp.placement import R, Shard, shard_candidates
from autotp.plan import build_plan, first_consumer, parameter_entry
from autotp.trace import graph_folder, write_json, write_solver_trace, write_text
from autotp.weights import ParameterMeta

_SOURCE_TOKEN = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]|\['([^']+)'\]")


def fqn_of(source_name: str) -> str:
    """``L['self']._modules['model']._parameters['weight']`` -> ``model.weight``."""
    root = re.match(r"^[A-Z]\['[^']*'\]", source_name)
    rest = source_name[root.end():] if root else source_name
    parts = [next(g for g in m.groups() if g is not None) for m in _SOURCE_TOKEN.finditer(rest)]
    return ".".join(parts)


def autotp_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """Entry point for ``torch.compile(model, backend="autotp")``: uses the default process group
    (or runs single-process) and ``AUTOTP_TRACE_DIR`` for traces."""
    comm = Comm.from_default_group() if dist.is_available() and dist.is_initialized() else Comm.single()
    trace_dir = os.environ.get("AUTOTP_TRACE_DIR")
    ctx = TPContext(comm=comm, config=AutoTPConfig(trace_dir=Path(trace_dir) if trace_dir else None))
    return compile_graph(gm, example_inputs, ctx)


def make_backend(ctx: TPContext) -> Callable[..., Any]:
    """A backend bound to ``ctx`` (what ``parallelize_model`` compiles with)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return compile_graph(gm, example_inputs, ctx)

    return backend


def _is_standin(t: torch.Tensor) -> bool:
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def _tokens(inputs: list[tuple[torch.fx.Node, Any]]) -> int:
    for _, x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and not x.dtype.is_floating_point:
            return max(int(x.numel()), 1)
    for _, x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return max(int(x.numel() // x.shape[-1]), 1)
    return 1


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], ctx: TPContext) -> Callable[..., Any]:
    graph_id = ctx.graphs_compiled
    ctx.graphs_compiled += 1
    world = ctx.world_size
    folder = graph_folder(ctx.config.trace_dir, ctx.rank, graph_id) if ctx.config.trace_dir else None
    runner = PassRunner(folder)
    timings: dict[str, float] = {}
    if folder:
        write_text(folder, "dynamo_graph.py", gm.code)

    # classify placeholders: parameters (free or pinned) vs. replicated inputs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_inputs: dict[torch.fx.Node, torch.Tensor] = {}
    user_inputs: list[tuple[torch.fx.Node, Any]] = []
    for ph, value in zip(placeholders, example_inputs, strict=True):
        grapharg = ph.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None and hasattr(grapharg, "source") else ph.name
        if isinstance(value, torch.Tensor) and (isinstance(value, torch.nn.Parameter) or meta_of(value)):
            if meta_of(value) is None:
                attach_meta(value, ParameterMeta(
                    fqn=fqn_of(source), global_shape=tuple(value.shape), dtype=value.dtype,
                    checkpoint_key=None, checkpoint=None, placement=None, tied=(fqn_of(source),)))
            param_inputs[ph] = value
        else:
            user_inputs.append((ph, value))

    if world == 1:
        # one rank: every placement is R; only bind parameters to their (full) local tensors
        annotation, solution, shadow, opts = replicated_annotation(gm), None, None, None
    else:
        annotation, solution, shadow, opts = _solve(gm, example_inputs, param_inputs, user_inputs, ctx,
                                                    runner, timings, folder)
    consumers = {ph: first_consumer(ph) for ph in param_inputs}
    locals_ = runner.run("materialize", materialize, annotation, param_inputs, ctx)
    report = runner.run("rewrite", rewrite, gm, annotation, locals_, ctx.comm, lint=gm)
    plan = build_plan(world, {
        meta_of(v).fqn: parameter_entry(meta_of(v).placement, consumers[ph], tuple(v.shape), world)
        for ph, v in param_inputs.items()
    }, report.collectives)
    gm.autotp_plan = plan
    if folder:
        modules = "".join(f"# {name}: {mod.extra_repr()}\n" for name, mod in gm.named_children())
        write_text(folder, "rewritten_graph.py", modules + gm.code)
        write_json(folder, "plan.json", plan)
    if folder and solution is not None:
        write_solver_trace(folder, solution.trace, {
            "cost": solution.cost, "comm_cost": solution.comm_cost, "memory_cost": solution.memory_cost,
            "tokens": opts.tokens, "aten_nodes": len(shadow.aten.graph.nodes),
            "dynamo_nodes": len(shadow.dynamo_nodes), **timings,
            "local_rewrites": dict(report.local_rewrites),
        })
    if ctx.on_plan is not None:
        ctx.on_plan(plan)
    return _release_after_first_call(gm, param_inputs)


def _solve(gm: torch.fx.GraphModule, example_inputs: list[Any], param_inputs: dict[torch.fx.Node, torch.Tensor],
           user_inputs: list[tuple[torch.fx.Node, Any]], ctx: TPContext, runner: PassRunner,
           timings: dict[str, float], folder: Path | None) -> tuple:
    """decompose -> solve -> annotate, with parameters already placed by earlier graphs pinned."""
    world = ctx.world_size
    t = time.perf_counter()
    shadow = runner.run("decompose", decompose, gm, example_inputs)
    timings["decompose_s"] = time.perf_counter() - t
    if folder:
        write_text(folder, "aten_graph.py", shadow.aten.code)
    aten_of = {dyn: aten for aten, dyn in shadow.placeholders}
    fixed, free = {}, {}
    for ph, value in param_inputs.items():
        meta = meta_of(value)
        if meta.placement is not None:
            fixed[aten_of[ph]] = meta.placement
        else:
            nbytes = value.numel() * value.element_size()
            options = [(R, ctx.config.memory_weight * nbytes * (world - 1) / world)]
            options += [(s, 0.0) for s in shard_candidates(tuple(value.shape), world)]
            free[aten_of[ph]] = ParamChoice(options)
    for ph, _ in user_inputs:
        fixed[aten_of[ph]] = R
    opts = SolverOptions(world_size=world, tokens=_tokens(user_inputs), memory_weight=ctx.config.memory_weight,
                         beam_width=ctx.config.beam_width)
    t = time.perf_counter()
    solution = runner.run("solve", solve, shadow, opts, fixed, free, {aten_of[p] for p in param_inputs})
    timings["solve_s"] = time.perf_counter() - t
    annotation = runner.run("annotate", annotate, shadow, solution)
    return annotation, solution, shadow, opts


def _release_after_first_call(gm: torch.fx.GraphModule, param_inputs: dict[torch.fx.Node, torch.Tensor]
                              ) -> Callable[..., Any]:
    """For in-memory models: once the graph has run, point each full parameter at a zero-memory
    stand-in so this rank keeps only its shard (Dynamo recompiles once on the new strides, and the
    recompiled graph finds every placement pinned)."""
    full = [v for v in param_inputs.values() if not _is_standin(v)
            and isinstance(meta_of(v).placement, Shard)]
    if not full:
        return gm.forward
    state = {"released": False}

    def run(*args: Any) -> Any:
        out = gm.forward(*args)
        if not state["released"]:
            state["released"] = True
            with torch.no_grad():
                for v in full:  # NaN-filled, so an eager use of the released module is loudly wrong
                    v.data = standin(tuple(v.shape), v.dtype, v.device, False, fill=float("nan")).data
        return out

    return run
