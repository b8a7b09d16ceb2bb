"""Plan a model without weights or ranks: the library behind ``autotp plan``.

:func:`plan_model` builds the architecture from its config on the **meta** device (no weight is
read; a folder holding only ``config.json`` is enough), gives every parameter a zero-memory
global-shaped stand-in carrying its :class:`~autotp.weights.ParameterMeta` (as
``parallelize_model`` does), and compiles ``forward`` with the real autotp backend over
:meth:`Comm.simulated_group(tp) <autotp.collectives.Comm.simulated_group>`: the same decompose ->
solve -> annotate -> materialize -> rewrite as on ``tp`` ranks, in one process. The rewritten graph
runs on meta tensors; its collectives are counted exactly (count and payload bytes per rank) and
return shape-correct stand-ins.

Two calls, as in generation (three when ``(B, S)`` is not the warm-up shape; one more for an
encoder-decoder's first decode step):

0. **warm-up** (only when ``(B, S)`` differs from ``(1, 2N+1)``): ``parallelize_model``'s warm-up
   shape. Its free solve fixes every parameter's placement (the plan), as the warm-up does on
   the ranks. The report keeps it (``PlanReport.warmup``): it is the prefill a plan at the
   default shape reports, so one plan at ``(B, S)`` answers for both shapes.
1. **prefill**: ``input_ids`` of shape ``(B, S)`` (into an empty KV cache when a decode step
   follows). At the default shape ``(1, 2N+1)`` this graph is the warm-up and fixes the plan;
   otherwise it is solved with the parameters pinned, as a long prefill is on the ranks, so the
   collectives it reports are the ones they issue.
2. **first decode step** (an encoder-decoder with ``decode=True``; traced before the decode step,
   as ``generate`` runs them): ``generate``'s first decoder call, another graph than the later steps'.
   One start token per sequence, the encoder's output, and a fresh, empty ``EncoderDecoderCache``:
   each decoder block projects the cross-attention's keys and values from the encoder's output and
   stores them (sharded, as the later steps read them), so this graph runs the cross-attention's
   key and value matmuls the later steps skip. ``PlanReport.first_decode``; None for a decoder-only
   model, whose first decode step is its prefill (the forward). Solved with every parameter pinned.
3. **decode** (``decode=True``): one new token per sequence with a KV cache of ``S`` positions,
   solved with every parameter pinned, as a real decode step is: the collectives per generated
   token and the KV-cache bytes each rank holds. An encoder-decoder's prefill runs both stacks
   (``decoder_input_ids`` of shape ``(B, S)`` too) into an empty ``EncoderDecoderCache``; its step
   is ``generate``'s after the first token: the decoder alone, reading the encoder's output and
   the cache's self-attention and cross-attention keys and values (:func:`_decode_inputs`). If it
   cannot be compiled, the report says why and has forward numbers only.

What the report holds beyond the plan: per-graph timings (Dynamo trace, decompose, solve, the
rest), where each collective sits (the module whose output it redistributes, read off the
solution's edges), the solver record of the graph that fixed the plan (:class:`autotp.backend.SolveRecord`),
which :func:`explain` uses to say why a parameter got its placement by re-solving with that
parameter pinned to each alternative, and :func:`to_tp_plan` for transformers' ``tp_plan``.

Depth: a deep model is traced as a shortened stand-in whose report is expanded to every layer
(``autotp/depth.py`` says why that is the full-depth report and when it is not done). The report
itself is plain data (``autotp/plan_report.py``); ``autotp plan`` keeps whole reports
(``autotp/report_cache.py``) and serves them without importing this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from autotp.api import TOKEN_INPUTS, gather_user_values
from autotp.backend import (
    SolveRecord,
    check_names,
    check_overrides,
    compile_graph,
    grapharg_source,
)
from autotp.collectives import Comm, kind_of
from autotp.compat import BackendCompilerFailed, encoder_outputs, fake_tensor_tls, trace_settings
from autotp.config import AutoTPConfig, parse_dtype
from autotp.context import CompiledGraph, TPContext, attach_meta, meta_of, output_path_of, standin
from autotp.errors import AutoTPError, SolverError
from autotp.hf_config import read_config
from autotp.kv_cache import cache_keyword, cache_layers, returned_cache
from autotp.passes.decompose import EDGE, MARK
from autotp.passes.solve import solve
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Placement,
    R,
    Shard,
    StridedShard,
    local_shape,
    parse,
    uneven_note,
    uneven_rows,
)
from autotp.plan import style_of
from autotp.plan_report import FIRST_DECODE, GraphReport, PlanReport, block_in

__all__ = ["GraphReport", "PlanReport", "check_names", "explain", "explain_matching", "load_config", "plan_model",
           "to_tp_plan"]


# ---------------------------------------------------------------------------------------------
# Config and model
# ---------------------------------------------------------------------------------------------


def load_config(model: Any, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                local_files_only: bool = False, token: str | bool | None = None) -> Any:
    """A transformers config from a config object, a folder (``config.json`` alone is enough) or a
    Hub id (only ``config.json`` is fetched; weights never are)."""
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    from autotp.weights import _hub_error, _looks_like_path, resolve_checkpoint

    text = os.fspath(model)
    if Path(text).expanduser().is_dir() or isinstance(model, os.PathLike) or _looks_like_path(text):
        folder = resolve_checkpoint(text, require_weights=False)
        return read_config(folder)
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(text, "config.json", revision=revision, cache_dir=cache_dir, token=token,
                               local_files_only=local_files_only)
    except Exception as e:  # every Hub failure becomes one actionable error
        raise _hub_error(text, revision, cache_dir, e) from e
    return read_config(Path(path).parent)


def _check_local_weights(model: Any, module: torch.nn.Module) -> None:
    """When ``model`` is a folder that holds weights, check them against the model the config
    builds (present, shape, dtype; headers only) before anything is traced: a plan for a checkpoint
    that cannot load would be a plan for the wrong model. A config-only folder, a config object or
    a Hub id (only config.json is fetched) has no weights to check."""
    from autotp.checkpoint_match import check_checkpoint
    from autotp.weights import _bin_files, _safetensors_files

    if not isinstance(model, str | os.PathLike):
        return
    folder = Path(os.fspath(model)).expanduser()
    if folder.is_dir() and (_safetensors_files(folder) or _bin_files(folder)):
        check_checkpoint(folder, module)


def _build(config: Any, dtype: torch.dtype | None) -> torch.nn.Module:
    """The architecture on meta (buffers too: rotary tables are computed on meta, their values are
    never needed), each parameter replaced by the stand-in ``parallelize_model`` traces (stride 0,
    ``context.standin``, here on meta) carrying its ParameterMeta, so the planner traces what the
    ranks trace (ops that check weight strides, such as bf16 ``torch._grouped_mm``, accept it:
    ``autotp/compat.py``)."""
    from autotp.weights import ParameterMeta, build_meta_model, tied_groups

    module = build_meta_model(config, dtype=dtype).to("meta")
    groups = {fqn: tuple(g) for g in tied_groups(module) for fqn in g}
    seen: dict[int, torch.nn.Parameter] = {}
    for fqn, param in list(module.named_parameters(remove_duplicate=False)):
        owner_name, _, name = fqn.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if id(param) not in seen:
            stand = standin(tuple(param.shape), param.dtype, "meta", requires_grad=False)
            attach_meta(stand, ParameterMeta(fqn=fqn, global_shape=tuple(param.shape), dtype=param.dtype,
                                             tied=groups.get(fqn, (fqn,))))
            seen[id(param)] = stand
        owner._parameters[name] = seen[id(param)]
    return module.eval()


def _empty_cache(config: Any, dtype: torch.dtype) -> Any:
    """An empty KV cache for the prefill, as ``generate`` makes it: a DynamicCache for the decoder's
    layers (``get_text_config(decoder=True)``), and for an encoder-decoder an ``EncoderDecoderCache``
    of two (self-attention, and cross-attention over the encoder's positions). Each layer is
    initialized here: transformers creates a layer's empty tensors lazily inside ``forward``, which
    Dynamo cannot do on the meta device."""
    from transformers import DynamicCache, EncoderDecoderCache

    decoder = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    empty = torch.empty(0, dtype=dtype, device="meta")

    def dynamic() -> Any:
        cache = DynamicCache(config=decoder)
        for layer in getattr(cache, "layers", []):
            if hasattr(layer, "lazy_initialization") and not getattr(layer, "is_initialized", True):
                layer.lazy_initialization(empty, empty)
        return cache

    if getattr(config, "is_encoder_decoder", False):
        return EncoderDecoderCache(dynamic(), dynamic())
    return dynamic()


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


@dataclass
class _Compiled:
    """What the recording backend saw of one graph."""

    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    backend_s: float
    backend_cpu_s: float
    #: the session's record of the graph (plan, sharded outputs, the solver's record)
    graph: CompiledGraph
    #: the graph as Dynamo traced it, before the backend rewrote it: name, op, target, module of
    #: each node (``autotp/depth.py`` reads the layers off it)
    traced: list[tuple[str, str, str, str]]


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return node.name
    path = list(stack.values())[-1][0]
    if not isinstance(path, str):
        return node.name
    # L['self'].model.layers.0.mlp -> model.layers.0.mlp; a forward behind a decorator
    # (transformers' deprecate_kwarg) sees its module as L['args'][0]
    path = re.sub(r"^[A-Z]\['[^']*'\](?:\[0\])?\.?", "", path)
    return re.sub(r"\._(?:modules|parameters)\['([^']+)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)


def _origin(node: torch.fx.Node, placement: Any, placements: dict) -> torch.fx.Node:
    """Walk back from ``node`` through values that already had ``placement`` to the op that
    created it (a partial sum is born in a matmul, and may pass through copies and casts before
    the solver reduces it)."""
    seen = {node}
    while True:
        prev = next((a for a in node.all_input_nodes if placements.get(a) == placement and a not in seen), None)
        if prev is None:
            return node
        seen.add(prev)
        node = prev


def _sites(record: SolveRecord) -> list[dict[str, Any]]:
    """The collectives of a solution: each edge whose placement differs from its producer's by a
    collective, shared redistributions once (the rewrite shares them). ``after`` is the module
    whose output the collective moves (where it sits); ``origin`` the module whose op created the
    moved placement (``layer`` is read off it: a partial sum born in block 3 belongs to block 3
    even when the solver reduces it inside block 4's norm)."""
    shadow, placements = record.shadow, record.solution.placements
    dyn = shadow.dynamo_nodes
    seen: set[tuple[torch.fx.Node, str]] = set()
    out: list[dict[str, Any]] = []

    def module_of(n: torch.fx.Node) -> str:
        return _module_path(dyn[shadow.owner[n]]) if n in shadow.owner else n.name

    for n in shadow.aten.graph.nodes:
        if n.target is not EDGE or not isinstance(n.args[0], torch.fx.Node):
            continue
        src_node = n.args[0]
        src, dst = placements.get(src_node), placements.get(n)
        if src is None or dst is None or src == dst or not isinstance(src, Placement):
            continue
        kind = kind_of(src, dst)
        if kind is None or (src_node, str(dst)) in seen:
            continue
        seen.add((src_node, str(dst)))
        consumer = dyn[shadow.owner[n]] if n in shadow.owner else None
        origin = module_of(_origin(src_node, src, placements))
        block = block_in(origin)
        val = n.meta.get("val")
        out.append({
            "kind": kind, "src": str(src), "dst": str(dst), "after": module_of(src_node), "origin": origin,
            "into": consumer.name if consumer is not None else "?",
            "layer": block[1] if block else None,
            "global_shape": list(val.shape) if isinstance(val, torch.Tensor) else None,
            "bytes_per_rank": _payload(val, src, record.opts.world_size),
        })
    return out


def _payload(val: Any, src: Any, tp: int) -> int | None:
    """Bytes one rank sends into a collective that moves ``val`` from ``src``: its local shard of
    the value (what the communicator counts)."""
    if not isinstance(val, torch.Tensor):
        return None
    return _numel(local_shape(tuple(val.shape), src, tp)) * val.element_size()


def plan_model(model: Any, tp: int, *, dtype: str | torch.dtype | None = None, batch: int = 1,
               seq_len: int | None = None, decode: bool = True, overrides: Mapping[str, str] | None = None,
               memory_weight: float = 1.0, beam_width: int = 32, revision: str | None = None,
               cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
               sequence_parallel: bool = False, explain_names: Sequence[str] = (),
               full_depth: bool = False) -> PlanReport:
    """Plan ``model`` (a Hub id, a folder, or a transformers config) for ``tp`` ranks, in this
    process, on the meta device (see the module docstring). ``seq_len`` defaults to ``2*tp+1``.
    ``overrides`` and ``sequence_parallel`` are ``parallelize_model``'s. ``explain_names`` (for
    :func:`explain_matching` afterwards) are checked, like override patterns, before tracing.

    A deep model is traced and solved as a shortened stand-in whose report is expanded to every
    layer (``autotp/depth.py``: why that is the full-depth report, what is checked, when it plans at
    full depth instead); ``full_depth=True`` always traces every layer, and so do ``explain_names``
    (an explanation re-solves the full graph). ``PlanReport.depth`` says which was done.

    Resets Dynamo's caches first (``torch._dynamo.reset()``): every plan compiles the same
    ``forward`` code object, and planning several models in one process would otherwise run into
    Dynamo's recompile limit. Refuses (``AutoTPError``) a ``tp`` that does not divide the config,
    and overrides that name nothing or use an unknown style, before tracing anything."""
    from autotp.api import check_divisible

    if not isinstance(tp, int) or tp < 1:
        raise AutoTPError(f"tp must be a positive integer, got {tp!r}")
    if batch < 1 or (seq_len is not None and seq_len < 1):
        raise AutoTPError(f"batch and seq_len must be positive, got batch={batch}, seq_len={seq_len}")
    seq_len = seq_len or _warmup_shape(tp)[1]
    t_start, cpu_start = time.perf_counter(), time.process_time()
    config = load_config(model, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
    check_divisible(config, tp)
    torch_dtype = parse_dtype(dtype)
    overrides = dict(overrides or {})
    options = AutoTPConfig(tp_size=tp, dtype=torch_dtype, overrides=overrides, memory_weight=memory_weight,
                           beam_width=beam_width, sequence_parallel=sequence_parallel)
    shape = (batch, seq_len)
    name = os.fspath(model) if isinstance(model, (str, os.PathLike)) \
        else (getattr(config, "name_or_path", "") or f"{type(config).__name__}()")
    module = _build(config, torch_dtype)
    _check_local_weights(model, module)
    check_overrides(module, overrides)
    check_names(module, list(explain_names), "explain name(s)")  # refused before the (long) plan
    return _plan(config, module, name, options, shape, decode, explain_names, full_depth, t_start, cpu_start)


def _plan(config: Any, module: torch.nn.Module, name: str, options: AutoTPConfig, shape: tuple[int, int],
          decode: bool, explain_names: Sequence[str], full_depth: bool, t_start: float, cpu_start: float
          ) -> PlanReport:
    """Trace and solve: a stand-in for the repeated layers where ``autotp/depth.py`` allows it,
    else every layer."""
    from autotp import depth

    tp, (batch, seq_len), overrides = options.tp_size, shape, dict(options.overrides)
    why = ("full_depth=True" if full_depth else "explain names re-solve the full graph" if explain_names
           else "tp=1 solves nothing" if tp == 1 else None)
    if why is None:
        try:
            short = depth.shorten(config, module, overrides)
            try:
                stand_in = _build(short.config, options.dtype)
            except Exception as e:  # a config that refuses the cut lists: trace every layer instead
                raise depth.CannotShorten(f"the stand-in did not build ({type(e).__name__}: {e})") from e
            depth.check_stand_in(short, module, stand_in)
            build_s = time.perf_counter() - t_start
            run = _trace(short.config, stand_in, options, shape, decode)
            return _expanded(name, config, module, stand_in, short, run, options, shape,
                             build_s, t_start, cpu_start)
        except depth.CannotShorten as e:
            why = str(e)
    build_s = time.perf_counter() - t_start
    run = _trace(config, module, options, shape, decode)
    params, bytes_rank, bytes_total = _parameter_table(module, tp, run.styles)
    kv_rank, kv_total = _kv_totals(run.kv_by_layer)
    try:
        tp_plan, refusal = to_tp_plan(params, module, run.record), None
    except AutoTPError as e:  # a layout transformers cannot spell: the plan itself stands
        tp_plan, refusal = None, str(e)
    return PlanReport(
        model=name, architecture=type(module).__name__, tp=tp, dtype=_dtype_name(module), batch=batch,
        seq_len=seq_len, num_layers=_num_layers(config), parameters=params, param_bytes_per_rank=bytes_rank,
        param_bytes_total=bytes_total, forward=run.forward, decode=run.decode, decode_note=run.decode_note,
        kv_cache_bytes_per_rank=kv_rank, kv_cache_bytes_total=kv_total,
        timings=_timings(run, build_s, t_start, cpu_start), tp_plan=tp_plan, tp_plan_refusal=refusal,
        overrides=overrides, record=run.record, depth=f"planned at full depth: {why}", warmup=run.warmup,
        first_decode=run.first_decode,
    )


@dataclass
class _Run:
    """What tracing one model through the backend gave: the graphs' reports and what the report
    is computed from."""

    warmup: GraphReport | None
    forward: GraphReport
    decode: GraphReport | None
    decode_note: str | None
    #: an encoder-decoder's first decode step (empty cache, cross-attention keys and values computed)
    first_decode: GraphReport | None
    #: the solve that fixed the plan (the first graph's)
    record: SolveRecord | None
    #: cache layer -> KV-cache bytes (per rank, global) of the decode graph; None without one
    kv_by_layer: dict[int | None, tuple[int, int]] | None
    #: parameter name -> style, as the compiled plans report it
    styles: dict[str, str]
    #: graph name ("warm-up", "forward", "first-decode", "decode") -> the Dynamo graphs its call compiled
    compiled: dict[str, list[_Compiled]]


def _trace(config: Any, module: torch.nn.Module, options: AutoTPConfig, shape: tuple[int, int], decode: bool
           ) -> _Run:
    """Compile ``module``'s forward with the autotp backend over a simulated group: the warm-up
    (when ``shape`` is not its shape), the prefill, an encoder-decoder's first decode step and the
    decode step (module docstring)."""
    tp = options.tp_size
    comm = Comm.simulated_group(tp)
    ctx = TPContext(comm=comm, config=options,
                    sharded_outputs=True,  # as parallelize_model: KV cache sharded, logits gathered on return
                    keep_solve_records=True)  # explain / alternatives re-solve from the record
    seen: list[_Compiled] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        traced = [(n.name, n.op, str(n.target), _module_path(n)) for n in gm.graph.nodes]
        t, c = time.perf_counter(), time.process_time()
        fn = compile_graph(gm, example_inputs, ctx)
        seen.append(_Compiled(gm, list(example_inputs), time.perf_counter() - t, time.process_time() - c,
                              ctx.graphs[-1], traced))
        return fn

    torch.compiler.reset()
    # static shapes: the decode call would otherwise recompile the prefill's code object with
    # Dynamo's automatic dynamic shapes (symbolic sequence lengths), which costs a quarter of the
    # whole plan and changes no collective: the plan is for the given B and S
    forward = torch.compile(type(module).forward.__get__(module), backend=backend, dynamic=False)
    ids = torch.zeros(shape, dtype=torch.long, device="meta")  # (B, S)
    # an encoder-decoder's forward runs both stacks on one call, the decoder reading its own ids
    # (as parallelize_model's warm-up passes them, ``api.TOKEN_INPUTS``): S decoder tokens too
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    keyword = cache_keyword(type(module).forward) if decode else None
    dtype = next(module.parameters()).dtype
    # the forward is the prefill when a decode step follows: it leaves the (sharded) KV cache
    kwargs = {"input_ids": ids, keyword: _empty_cache(config, dtype), "use_cache": True} if keyword \
        else {"input_ids": ids, "use_cache": False}
    if seq2seq:
        kwargs["decoder_input_ids"] = ids  # (B, S): as many decoder tokens as encoder tokens
    warmup = None
    if shape != _warmup_shape(tp):
        # parallelize_model fixes every parameter's placement in its warm-up call and solves later
        # graphs (a long prefill) with them pinned; plan the same way, so the report is what the
        # ranks issue. (A free solve at the requested shape is a larger search whose beam can end
        # in a costlier plan: 3 all-gathers + 3 all-reduces + 2 reduce-scatters for a 16-token
        # prefill of a 2-layer Llama, where the pinned solve finds Megatron's 5 + 1.)
        warm = torch.zeros(_warmup_shape(tp), dtype=torch.long, device="meta")  # (1, 2*tp+1)
        warm_kwargs = {**kwargs, "input_ids": warm} | ({"decoder_input_ids": warm} if seq2seq else {})
        if keyword:  # a fresh cache: the prefill fills the one it gets
            warm_kwargs[keyword] = _empty_cache(config, dtype)
        warmup, _ = _run_graph("warm-up", forward, warm_kwargs, comm, seen)
    first = len(seen)
    fwd, prefill = _run_graph("forward", forward, kwargs, comm, seen)
    compiled = {"forward": seen[first:], **({"warm-up": seen[:first]} if warmup is not None else {})}
    record = seen[0].graph.solve if seen else None  # the free solve

    dec, first_dec, note, kv = None, None, None, None
    if decode:
        try:
            cache = returned_cache(prefill)
            if cache is None or keyword is None:
                raise AutoTPError(f"{type(module).__name__}'s forward returned no KV cache")
            new = torch.zeros((shape[0], 1), dtype=torch.long, device="meta")  # (B, 1)
            if seq2seq:  # generate's first decoder call: a fresh cache, which it fills with cross k/v
                first = len(seen)
                inputs = _decode_inputs(new, keyword, _empty_cache(config, dtype), prefill, seq2seq)
                first_dec, _ = _run_graph(FIRST_DECODE, forward, inputs, comm, seen)
                compiled[FIRST_DECODE] = seen[first:]
            first = len(seen)
            dec, _ = _run_graph("decode", forward, _decode_inputs(new, keyword, cache, prefill, seq2seq), comm, seen)
            compiled["decode"] = seen[first:]
            kv = _kv_bytes(seen[first:], tp, keyword)
        except SolverError:
            raise
        except Exception as e:  # a model whose decode step does not trace on meta: say so, don't guess
            note = f"decode step not planned ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
            dec = first_dec = None
    else:
        note = "decode step not planned (decode=False)"

    styles: dict[str, str] = {}
    for c in seen:
        for fqn, e in c.graph.plan.get("parameters", {}).items():
            styles.setdefault(fqn, e["style"])
    return _Run(warmup=warmup, forward=fwd, decode=dec, decode_note=note, first_decode=first_dec, record=record,
                kv_by_layer=kv, styles=styles, compiled=compiled)


def _decode_inputs(new: torch.Tensor, keyword: str, cache: Any, prefill: Any, seq2seq: bool) -> dict[str, Any]:
    """The keywords of one decode step as ``generate`` passes them: ``new`` token ids (B, 1) and a
    KV ``cache``. An encoder-decoder's step runs its decoder alone: ``generate`` ran the encoder
    once (under ``parallelize_model`` through ``get_encoder()``, its output gathered at that call's
    boundary, so the step reads it replicated) and passes its output as ``encoder_outputs``. After
    the first token the cache (the one the prefill filled) holds the self-attention's S positions
    and the cross-attention's keys and values of the S encoder positions, which the step reads
    instead of projecting the encoder's output again; the first step gets a fresh, empty cache and
    projects and stores them."""
    if not seq2seq:
        return {"input_ids": new, keyword: cache, "use_cache": True}
    encoded = prefill.encoder_last_hidden_state  # (B, S, hidden), as the encoder returned it
    return {"decoder_input_ids": new, "encoder_outputs": encoder_outputs(encoded), keyword: cache,
            "use_cache": True}


def _expanded(name: str, config: Any, module: torch.nn.Module, stand_in: torch.nn.Module, short: Any,
              run: _Run, options: AutoTPConfig, shape: tuple[int, int], build_s: float, t_start: float,
              cpu_start: float) -> PlanReport:
    """The full model's report from its stand-in's (``autotp/depth.py``, step 4); raises
    ``CannotShorten`` where the stand-in's plan does not show the steady state."""
    from autotp import depth

    tp = options.tp_size
    graphs = {}
    for key, g in (("warm-up", run.warmup), ("forward", run.forward), (FIRST_DECODE, run.first_decode),
                   ("decode", run.decode)):
        if g is None:
            continue
        compiled = run.compiled[key]
        if len(compiled) != 1:
            raise depth.CannotShorten(f"the stand-in's {key} call compiled {len(compiled)} graphs (graph breaks)")
        layout = depth.graph_layout(short, compiled[0].traced)
        depth.check_sites_add_up(g.sites, g.collectives, g.collective_bytes)
        sites, period = depth.expand_sites(short, g.sites, layout)
        graphs[key] = dataclasses.replace(
            g, sites=sites, collectives=depth.grown(g.collectives, period, None, short.copies),
            collective_bytes=depth.grown(g.collective_bytes, period, "bytes_per_rank", short.copies))
    kv_rank, kv_total = depth.expand_kv(short, run.kv_by_layer) if run.kv_by_layer is not None else (None, None)
    depth.transfer_placements(short, module, stand_in, meta_of)
    full_names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    styles = {n: run.styles[short.short_name(n)] for n in full_names if short.short_name(n) in run.styles}
    params, bytes_rank, bytes_total = _parameter_table(module, tp, styles)
    try:
        gathered, split = _module_context(run.record) if run.record is not None else (set(), set())
        context = (depth.expand_names(short, [n for n, _ in module.named_modules()], gathered),
                   depth.expand_names(short, full_names, split))
        tp_plan, refusal = to_tp_plan(params, module, context=context), None
    except AutoTPError as e:  # a layout transformers cannot spell: the plan itself stands
        tp_plan, refusal = None, str(e)
    return PlanReport(
        model=name, architecture=type(module).__name__, tp=tp, dtype=_dtype_name(module), batch=shape[0],
        seq_len=shape[1], num_layers=_num_layers(config), parameters=params, param_bytes_per_rank=bytes_rank,
        param_bytes_total=bytes_total, forward=graphs["forward"], decode=graphs.get("decode"),
        decode_note=run.decode_note, kv_cache_bytes_per_rank=kv_rank, kv_cache_bytes_total=kv_total,
        timings=_timings(run, build_s, t_start, cpu_start), tp_plan=tp_plan, tp_plan_refusal=refusal,
        overrides=dict(options.overrides), record=None, depth=short.describe(), warmup=graphs.get("warm-up"),
        first_decode=graphs.get(FIRST_DECODE),
    )


def _kv_totals(by_layer: Mapping[int | None, tuple[int, int]] | None) -> tuple[int | None, int | None]:
    if by_layer is None:
        return None, None
    return sum(r for r, _ in by_layer.values()), sum(t for _, t in by_layer.values())


def _num_layers(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "num_hidden_layers", None)


def _dtype_name(module: torch.nn.Module) -> str:
    return str(next(module.parameters()).dtype).replace("torch.", "")


def _timings(run: _Run, build_s: float, t_start: float, cpu_start: float) -> dict[str, float]:
    """Wall seconds per phase summed over the graphs (and CPU seconds of trace, decompose, solve)."""
    timings = {"build_s": build_s}
    graphs = [g for g in (run.warmup, run.forward, run.first_decode, run.decode) if g is not None]
    for key in ("trace_s", "decompose_s", "solve_s", "annotate_s", "rewrite_s"):
        timings[key] = sum(g.timings.get(key, 0.0) for g in graphs)
    if run.warmup is not None:
        timings["warmup_s"] = run.warmup.timings["total_s"]
    timings["forward_s"] = run.forward.timings["total_s"]
    if run.first_decode is not None:
        timings["first_decode_s"] = run.first_decode.timings["total_s"]
    if run.decode is not None:
        timings["decode_s"] = run.decode.timings["total_s"]
    timings["total_s"] = time.perf_counter() - t_start
    for key in ("trace_cpu_s", "decompose_cpu_s", "solve_cpu_s"):
        timings[key] = sum(g.timings.get(key, 0.0) for g in graphs)
    timings["total_cpu_s"] = time.process_time() - cpu_start
    return timings


def _warmup_shape(tp: int) -> tuple[int, int]:
    """``(B, S)`` of ``parallelize_model``'s warm-up call (``api._warmup_inputs``), whose solve
    fixes every parameter's placement."""
    return 1, 2 * tp + 1


@contextlib.contextmanager
def _meta_constants_allowed() -> Iterator[None]:
    """Let fake-tensor tracing take a real tensor constant, for the planner's calls only. On the
    meta device a list index (Falcon's ``fused_qkv[..., [-2], :]``) becomes a real *meta* tensor
    constant, which Dynamo's and decompose's fake modes otherwise refuse; a meta tensor holds no
    data, so nothing real enters the trace. ``parallelize_model`` (real tensors) never needs this."""
    tls = fake_tensor_tls
    before = tls.allow_non_fake_inputs_override
    tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        tls.allow_non_fake_inputs_override = before


def _run_graph(name: str, forward: Any, kwargs: dict[str, Any], comm: Comm, seen: list[_Compiled]
               ) -> tuple[GraphReport, Any]:
    """One compiled call; the graphs it compiled (normally one) make up its report."""
    comm.reset_counts()
    first = len(seen)
    received = _cache_entries(*kwargs.values())  # held while the call may replace them
    t, cpu = time.perf_counter(), time.process_time()
    try:
        with torch.no_grad(), _meta_constants_allowed(), trace_settings():
            out = forward(**kwargs)
            out = gather_user_values(out, comm)  # what parallelize_model does on return (logits)
    except BackendCompilerFailed as e:  # Dynamo wraps what the backend raised
        inner = e.inner_exception
        if isinstance(inner, AutoTPError):  # keep its own cause (a PassError names the failing pass)
            raise inner from inner.__cause__
        raise
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    new = seen[first:]
    if not new:
        raise AutoTPError(f"the {name} call compiled no graph (was it already compiled for this shape?)")
    backend_s = sum(c.backend_s for c in new)
    timings = {"trace_s": wall - backend_s, "total_s": wall,
               "trace_cpu_s": cpu - sum(c.backend_cpu_s for c in new), "total_cpu_s": cpu}
    sites: list[dict[str, Any]] = []
    cost, bound, extra = 0.0, 0.0, None
    for c in new:
        rec: SolveRecord | None = c.graph.solve
        if rec is None:  # tp == 1: nothing solved
            continue
        for key in ("decompose_s", "solve_s", "annotate_s", "decompose_cpu_s", "solve_cpu_s"):
            timings[key] = timings.get(key, 0.0) + rec.timings.get(key, 0.0)
        sites += _sites(rec) + _boundary_sites(c.graph, rec, out, received)
        cost += rec.solution.cost
        bound += rec.solution.lower_bound
        if rec.free_cost is not None:
            extra = (extra or 0.0) + rec.solution.cost - rec.free_cost
    timings["rewrite_s"] = backend_s - sum(timings.get(k, 0.0) for k in ("decompose_s", "solve_s", "annotate_s"))
    shape = tuple(next(kwargs[key] for key in TOKEN_INPUTS if key in kwargs).shape)  # encoder's, else decoder's
    solved = any(c.graph.solve is not None for c in new)
    return GraphReport(name=name, input_shape=shape, collectives=dict(sorted(comm.counts.items())),
                       collective_bytes=dict(sorted(comm.bytes.items())), sites=sites, timings=timings,
                       cost=cost if solved else None, extra_cost_of_overrides=extra,
                       lower_bound=bound if solved else None), out


def _cache_entries(*values: Any) -> list[torch.Tensor]:
    """The keys and values of every KV cache among ``values``."""
    return [t for v in values for layer in cache_layers(v)
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]


def _boundary_sites(graph: CompiledGraph, record: SolveRecord, result: Any, received: Sequence[torch.Tensor]
                    ) -> list[dict[str, Any]]:
    """The all-gathers ``parallelize_model`` issues when the call returns: one per sharded graph
    output the user reads (the logits), none for the KV-cache entries this graph returned, kept
    sharded (found by the output path their stand-ins carry). An entry the call ``received`` and
    left in place (an encoder-decoder's cross-attention keys and values during decoding) carries
    the path of the graph that made it, which may name another output of this graph: not one of
    its entries."""
    kept = {output_path_of(t) for t in _cache_entries(returned_cache(result))
            if not any(t is r for r in received)}
    shadow, placements = record.shadow, record.solution.placements
    output_index = len(shadow.dynamo_nodes) - 1
    out = []
    for sharded in graph.sharded_outputs:
        path, placement, leaf, sub = sharded.path, sharded.placement, sharded.leaf, sharded.sub
        if path in kept:
            continue
        edge = shadow.edges.get((output_index, leaf, sub))
        if edge is None:
            continue
        producer = edge.args[0]
        origin = _module_path(shadow.dynamo_nodes[shadow.owner[producer]]) if producer in shadow.owner \
            else producer.name
        block = block_in(origin)
        val = edge.meta.get("val")
        src = placements.get(producer, placement)
        out.append({"kind": "all_gather", "src": str(src), "dst": "R",
                    "after": origin, "origin": origin, "into": "return (gathered by parallelize_model)",
                    "layer": block[1] if block else None,
                    "global_shape": list(val.shape) if isinstance(val, torch.Tensor) else None,
                    "bytes_per_rank": _payload(val, src, record.opts.world_size)})
    return out


def _kv_bytes(compiled: list[_Compiled], tp: int, keyword: str) -> dict[int | None, tuple[int, int]] | None:
    """KV-cache bytes (per rank and global) the decode graph reads, by cache layer (None: an entry
    whose layer the source does not say): the inputs Dynamo found under the cache ``keyword``
    (source ``L['kwargs']['cache'].layers[0].keys`` or placeholder ``l_kwargs_cache_layers_0_keys``),
    with the placement the solver held them at. None when the graph reads no cache."""
    from_cache = re.compile(rf"\['{keyword}'\]|^l_(?:kwargs_)?{keyword}_")
    cache_layer = re.compile(r"layers(?:\[|_)(\d+)")
    by_layer: dict[int | None, tuple[int, int]] = {}
    found = False
    for c in compiled:
        rec: SolveRecord | None = c.graph.solve
        aten_of = {dyn: aten for aten, dyn in rec.shadow.placeholders} if rec else {}
        phs = [n for n in c.gm.graph.nodes if n.op == "placeholder"]
        for ph, value in zip(phs, c.example_inputs, strict=True):
            source = grapharg_source(ph)
            if not from_cache.search(source) or not isinstance(value, torch.Tensor):
                continue
            found = True
            placement = rec.fixed.get(aten_of.get(ph), R) if rec else R
            shape = tuple(value.shape)
            m = cache_layer.search(source)
            layer = int(m.group(1)) if m else None
            per_rank, total = by_layer.get(layer, (0, 0))
            by_layer[layer] = (per_rank + _numel(local_shape(shape, placement, tp)) * value.element_size(),
                               total + value.numel() * value.element_size())
    return by_layer if found else None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _parameter_table(module: torch.nn.Module, tp: int, styles: Mapping[str, str]
                     ) -> tuple[dict[str, dict[str, Any]], int, int]:
    """Every named parameter (tied names point at one tensor, counted once) with its placement;
    ``styles`` are the compiled plans' (a style is read off the consumer op)."""
    rows: dict[str, dict[str, Any]] = {}
    per_rank = total = 0
    counted: set[int] = set()
    for fqn, p in module.named_parameters(remove_duplicate=False):
        meta = meta_of(p)
        placement = meta.placement if meta.placement is not None else R  # untouched: loaded replicated
        shape = tuple(meta.global_shape)
        local = local_shape(shape, placement, tp)
        nbytes = _numel(local) * p.element_size()
        rows[fqn] = {
            "style": styles.get(meta.fqn, "replicate"),
            "placement": str(placement),
            "shard_dim": placement.dim if isinstance(placement, (Shard, GroupedShard, HeadShard)) else None,
            "global_shape": list(shape),
            "global_numel": _numel(shape),
            "local_shape": list(local),  # rank 0's: the largest chunk where the split is uneven
            "bytes_per_rank": nbytes,
            "tied_to": meta.fqn if meta.fqn != fqn else None,
            "used": meta.placement is not None,
        }
        uneven = uneven_rows(shape, placement, tp)
        if uneven is not None:  # ranks carry unequal work (a vocabulary no tp divides)
            rows[fqn].update(rows_per_rank=uneven, uneven=uneven_note(shape, placement, tp))
        if id(meta) not in counted:
            counted.add(id(meta))
            per_rank += nbytes
            total += _numel(shape) * p.element_size()
    return rows, per_rank, total


# ---------------------------------------------------------------------------------------------
# transformers tp_plan
# ---------------------------------------------------------------------------------------------

#: autotp style -> transformers' name (``transformers.distributed.tensor_parallel``)
_HF_STYLE = {"colwise": "colwise", "rowwise": "rowwise", "vocab": "embedding_rowwise"}
#: the one strided layout transformers spells: DTensor's ``_StridedShard(split_factor=2)``
_PACKED_SEGMENTS = 2
_WILDCARD = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _wildcard(name: str) -> str:
    return _WILDCARD.sub("*", name)


def to_tp_plan(parameters: Mapping[str, Mapping[str, Any]], module: torch.nn.Module | None = None,
               record: SolveRecord | None = None, *, context: tuple[set[str], set[str]] | None = None
               ) -> dict[str, str]:
    """The plan as a transformers ``tp_plan`` for ``DistributedConfig(tp_plan=...)``: module (or
    parameter) name -> style, layer indices as ``*`` where every layer agrees.

    Keys: a ``weight``/``bias`` is keyed by its module (a module's style is its weight's; biases
    follow their weight); any other parameter (stacked experts' ``gate_up_proj``) by its own name,
    as transformers' MoE plans are. Styles, read off the placement, the consumer's style and, with
    ``record`` (the solve that fixed the plan), what happens around the module (or ``context``,
    what :func:`_module_context` reads off it: the modules whose output is all-gathered, the
    parameters whose consumer slices a replicated input):

    * column-parallel: ``colwise``, or ``colwise_gather_output`` when autotp all-gathers the
      module's output (the output embedding always: autotp gathers the logits at the model
      boundary); ``embedding_colwise`` for an embedding split on its features;
    * row-parallel: ``rowwise``, or ``rowwise_split_input`` when the input the module reads is
      replicated (each rank slices it locally); vocab-parallel embeddings ``embedding_rowwise``;
    * fused weights stored strided (``StridedShard``: rank r holds chunk r of each segment):
      ``packed_colwise`` / ``packed_rowwise`` when the layout is transformers' packed one, exactly
      two equal segments (DTensor's ``_StridedShard(split_factor=2)``: gate | up) on the output dim
      (``ndim - 2``) or the last dim. Any other strided layout (q | k | v: three segments, of
      unequal sizes under GQA) has no transformers spelling, and plain ``colwise`` would split the
      fused dim contiguously, giving rank 0 all of q and rank 1 k and v: the export refuses
      (:class:`AutoTPError` naming the parameter and its segments);
    * a stacked parameter split on its output or input dim: ``colwise`` / ``rowwise`` (transformers'
      param styles shard dim ``ndim - 2`` / ``-1``); its module's reduction is the model's own
      plan's entry (``moe_tp_experts``), which must exist.

    ``DistributedConfig(tp_plan=...)`` overrides the model's own plan rule by rule and keeps the
    rules it does not name, so with ``module`` every own-plan rule whose parameters autotp keeps
    whole is exported as ``replicate``; other replicated modules are left out. Raises
    :class:`AutoTPError` for a layout transformers cannot express."""
    out_emb = None
    embeddings: set[str] = set()
    own_plan: dict[str, str] = {}
    if module is not None:
        emb = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        out_emb = next((n for n, m in module.named_modules() if m is emb), None) if emb is not None else None
        embeddings = {n for n, m in module.named_modules() if isinstance(m, torch.nn.Embedding)}
        own_plan = dict(getattr(module, "tp_plan", None) or {})
    if context is None:
        context = _module_context(record) if record is not None else (set(), set())
    gathered, split_inputs = context
    by_key: dict[str, str] = {}
    for fqn, e in parameters.items():
        if e.get("tied_to"):
            continue
        mod, _, leaf = fqn.rpartition(".")
        key = mod if leaf in ("weight", "bias") else fqn
        ndim = len(e["global_shape"])
        if key in by_key and ndim < 2:
            continue  # the weight decides
        hf = _hf_style(fqn, e, key, out_emb=out_emb, embeddings=embeddings, gathered=key in gathered,
                       split_input=fqn in split_inputs, own_plan=own_plan)
        if ndim < 2 and key != fqn and hf is not None and isinstance(parse(e["placement"]), StridedShard):
            raise AutoTPError(f"{fqn} is stored {e['placement']}: transformers' packed styles split a bias "
                              "contiguously, so no tp_plan spelling keeps this fused bias's layout")
        if hf is not None and (ndim >= 2 or key not in by_key):
            by_key[key] = hf
        elif ndim >= 2:
            by_key.pop(key, None)
    groups: dict[str, dict[str, str]] = {}
    for key, hf in by_key.items():
        groups.setdefault(_wildcard(key), {})[key] = hf
    plan: dict[str, str] = {}
    for key, members in groups.items():
        if len(set(members.values())) == 1:
            plan[key] = next(iter(members.values()))
        else:
            plan.update(members)
    for rule in own_plan.keys() - plan.keys():
        under = [e for fqn, e in parameters.items() if not e.get("tied_to") and _under(_wildcard(fqn), rule)]
        if under and all(e["placement"] == "R" for e in under):
            plan[rule] = "replicate"
    return dict(sorted(plan.items()))


def _under(param: str, rule: str) -> bool:
    """A parameter name (layers as ``*``) is the rule's parameter or one of its module's."""
    return param == rule or param.rpartition(".")[0] == rule


def _hf_style(fqn: str, e: Mapping[str, Any], key: str, *, out_emb: str | None, embeddings: set[str],
              gathered: bool, split_input: bool, own_plan: Mapping[str, str]) -> str | None:
    """One parameter's transformers style (None: replicated); see :func:`to_tp_plan`."""
    placement, ndim, style = parse(e["placement"]), len(e["global_shape"]), e["style"]
    if not isinstance(placement, Shard):
        return None
    bare = key == fqn
    if isinstance(placement, StridedShard) and ndim >= 2:
        segments = placement.segments
        packed = len(segments) == _PACKED_SEGMENTS and len(set(segments)) == 1 and placement.even
        if packed and placement.dim in (ndim - 2, ndim - 1):
            return "packed_colwise" if placement.dim == ndim - 2 else "packed_rowwise"
        held = "each of its" if not placement.whole else (
            f"{' | '.join(str(s) for i, s in enumerate(segments) if i not in placement.whole)} and all of "
            f"{' | '.join(str(segments[i]) for i in placement.whole)} (held whole by every rank) of its")
        raise AutoTPError(
            f"{fqn} is a fused weight stored {placement}: rank r holds chunk r of {held} "
            f"{len(segments)} segments ({' | '.join(map(str, segments))}) along dim {placement.dim}. transformers' "
            "packed styles ('packed_colwise', 'packed_rowwise') express only two equal segments on the "
            "output or last dim, and 'colwise' would split the fused dim contiguously, so no tp_plan "
            f"spelling keeps this layout. Plan with the override {_wildcard(key)!r}: 'replicate' (autotp plan "
            "--override) to export one.")
    if bare and ndim >= 3 and style not in _HF_STYLE:
        if placement.dim not in (ndim - 2, ndim - 1):
            raise AutoTPError(f"{fqn} is stored {placement}: transformers shards a stacked parameter only on "
                              f"dim {ndim - 2} (colwise) or {ndim - 1} (rowwise)")
        owner = _wildcard(key.rpartition(".")[0])
        if placement.dim == ndim - 1 and owner not in own_plan:
            raise AutoTPError(f"{fqn} is row-parallel, so its module's output is a partial sum, and the "
                              f"model's own tp_plan has no rule for {owner!r} that reduces it")
        return "colwise" if placement.dim == ndim - 2 else "rowwise"
    if style == "colwise":
        if key == out_emb or gathered:
            return "colwise_gather_output"
        return "embedding_colwise" if key in embeddings else "colwise"
    if style == "rowwise":
        return "rowwise_split_input" if split_input else "rowwise"
    if style in _HF_STYLE:
        return _HF_STYLE[style]
    raise AutoTPError(f"{fqn} is stored {placement}, read by an op autotp does not name a style for "
                      f"({style!r}: not a linear, matmul or embedding), so its transformers style is unknown")


def _module_context(record: SolveRecord) -> tuple[set[str], set[str]]:
    """From the solve that fixed the plan: the modules whose output autotp all-gathers, and the
    parameters whose consumer reads a replicated input (the first tensor it reads: a linear's
    ``x``) that it slices locally."""
    gathered = {s["origin"] for s in _sites(record) if s["kind"] == "all_gather"}
    shadow, placements = record.shadow, record.solution.placements
    index = {n: i for i, n in enumerate(shadow.dynamo_nodes)}
    split: set[str] = set()
    for node, fqn in record.fqn_of_aten.items():
        consumer = record.consumers.get(node)
        edge = shadow.edges.get((index.get(consumer), 0, 0)) if consumer is not None else None
        if edge is None or edge.args[0] is node:
            continue
        if placements.get(edge.args[0]) == R and isinstance(placements.get(edge), Shard):
            split.add(fqn)
    return gathered, split


# ---------------------------------------------------------------------------------------------
# Explanations
# ---------------------------------------------------------------------------------------------


@dataclass
class Explanation:
    """Why one parameter got its placement."""

    fqn: str
    placement: str
    style: str
    chain: list[str]
    alternatives: list[dict[str, Any]]

    def text(self) -> str:
        lines = [f"{self.fqn}: {self.style} ({self.placement})", "  chain of rule decisions:"]
        lines += [f"    {c}" for c in self.chain]
        lines.append("  alternatives (the whole graph re-solved with this parameter pinned; cost = "
                     "communicated bytes per token + memory weight x replicated bytes per rank):")
        for a in self.alternatives:
            if a.get("infeasible"):
                lines.append(f"    {a['style']:<10} {a['placement']:<5} infeasible: {a['infeasible']}")
            else:
                tag = "chosen" if a["chosen"] else f"rejected, +{a['extra_cost']:.1f}"
                lines.append(f"    {a['style']:<10} {a['placement']:<5} cost {a['cost']:.1f} "
                             f"(comm {a['comm_cost']:.1f}, memory {a['memory_cost']:.1f}) {tag}")
        return "\n".join(lines)


def explain_matching(report: PlanReport, pattern: str) -> list[Explanation]:
    """:func:`explain` for every parameter ``pattern`` names, read as an override pattern is
    (fnmatch on the parameter's or its module's name: ``lm_head`` explains ``lm_head.weight``);
    tied names are explained once."""
    names = [n for n in report.parameters
             if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n.rpartition(".")[0], pattern)]
    if not names:
        return [explain(report, pattern)]  # raises, with close matches
    out, seen = [], set()
    for name in names:
        target = report.parameters[name].get("tied_to") or name
        if target not in seen:
            seen.add(target)
            out.append(explain(report, name))
    return out


def explain(report: PlanReport, fqn: str) -> Explanation:
    """Why ``fqn`` got its placement: the decisions of the rules on the path from the parameter to
    its consumers' outputs (from the solver trace of the prefill graph, ``SolveTrace.decisions``;
    the decode graph only sees it pinned), and every alternative storage placement, costed by
    re-solving the whole graph with the parameter pinned to it."""
    entry = report.parameters.get(fqn)
    if entry is None:
        close = [n for n in report.parameters if fnmatch.fnmatchcase(n, f"*{fqn}*")][:5]
        raise AutoTPError(f"no parameter {fqn!r} in {report.architecture}."
                          f"{f' Did you mean one of {close}?' if close else ''}")
    fqn = entry.get("tied_to") or fqn
    rec = report.record
    if rec is None and report.tp > 1:
        raise AutoTPError(f"this plan has no solver record to explain {fqn} from ({report.depth}); plan with "
                          "explain_names (autotp plan --explain) or full_depth=True")
    if rec is None:
        return Explanation(fqn, entry["placement"], entry["style"],
                           ["tp=1: nothing is solved, every placement is R"], [])
    node = next((n for n, name in rec.fqn_of_aten.items() if name == fqn), None)
    if node is None or node not in rec.free:
        return Explanation(fqn, entry["placement"], entry["style"],
                           ["the forward graph does not use this parameter: it is loaded replicated"], [])
    return Explanation(fqn, entry["placement"], entry["style"], _chain(rec, node),
                       _alternatives(rec, node, entry))


def _chain(rec: SolveRecord, param: torch.fx.Node) -> list[str]:
    shadow, sol = rec.shadow, rec.solution
    dyn = shadow.dynamo_nodes
    decisions = {d.node: d for d in sol.trace.decisions}
    chosen = sol.placements.get(param)
    options = ", ".join(f"{p}" + (f" (memory cost {m:.0f})" if m else "") for p, m in rec.free[param].options)
    lines = [f"storage: {chosen}, chosen among {options}"
             + (f"; narrowed by overrides {[p for p, hits in rec.overrides.items() if rec.fqn_of_aten[param] in hits]}"
                if rec.overrides else "")]
    edges = [u for u in param.users if u.target is EDGE]
    for e in edges:
        owner = shadow.owner.get(e)
        if owner is None:
            continue
        consumer = dyn[owner]
        lines.append(f"consumer {consumer.name} ({consumer.target if not callable(consumer.target) else getattr(consumer.target, '__name__', consumer.target)}"
                     f", in {_module_path(consumer)}):")
        frontier, seen = list(e.users), set()
        marks = []
        while frontier:
            n = frontier.pop(0)
            if n in seen or shadow.owner.get(n) != owner and n.target is not MARK:
                continue
            seen.add(n)
            if n.target is MARK:
                marks.append(n)
                continue
            d = decisions.get(n.name)
            if d is not None:
                lines.append(f"  {d.target}: inputs ({', '.join(d.inputs)}) -> candidates "
                             f"[{', '.join(d.candidates)}] -> {d.chosen}" + (f" [{d.local}]" if d.local else "")
                             + (f" ({d.note})" if d.note else ""))
            frontier.extend(n.users)
        for m in marks:
            out = sol.placements.get(m)
            moves = []
            for u in m.users:
                if u.target is EDGE and u in sol.placements and sol.placements[u] != out:
                    kind = kind_of(out, sol.placements[u]) if isinstance(out, Placement) else None
                    into = dyn[shadow.owner[u]].name if u in shadow.owner else "?"
                    moves.append(f"{kind or 'local'} {out} -> {sol.placements[u]} into {into}")
            lines.append(f"  output {out}" + (f"; then {'; '.join(sorted(set(moves)))}" if moves
                                               else "; consumed as is (no collective)"))
    return lines


def _alternatives(rec: SolveRecord, param: torch.fx.Node, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    dyn_consumer = rec.consumers.get(param)
    chosen = rec.solution.placements.get(param)
    ndim = len(entry["global_shape"])
    out = []
    for p, mem in rec.free[param].options:
        style = style_of(p, dyn_consumer, ndim)
        if p == chosen:
            sol = rec.solution
        else:
            free = dict(rec.free)
            free[param] = rec.free[param].narrowed([(p, mem)])
            try:
                sol = solve(rec.shadow, rec.opts, rec.fixed, free, rec.param_nodes)
            except SolverError as e:
                out.append({"placement": str(p), "style": style, "infeasible": str(e).splitlines()[0]})
                continue
        out.append({"placement": str(p), "style": style, "cost": sol.cost, "comm_cost": sol.comm_cost,
                    "memory_cost": sol.memory_cost, "extra_cost": sol.cost - rec.solution.cost,
                    "chosen": p == chosen})
    return out
