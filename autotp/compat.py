"""The private torch and transformers internals autotp relies on, in one place (one section each).

Each name here says which internal it reaches and why no public API does the job; when torch or
transformers changes one of them, this module is the one to fix. Every internal is reached through
a feature probe (:func:`require`): a missing module or attribute raises an
:class:`~autotp.errors.AutoTPError` naming it and the installed torch and transformers versions,
and pointing at the versions autotp supports, instead of an ``ImportError`` or
``AttributeError`` deep inside a compile. The torch names below are probed when this module is
imported (autotp cannot trace without them); the transformers ones when first used (only some
checkpoints need them).

**Dynamo and ATen internals.** ``BackendCompilerFailed`` / ``TorchDynamoException`` (what Dynamo
wraps a backend's error in: autotp unwraps its own ``AutoTPError``), ``maybe_mark_dynamic`` (a
dynamic-size hint without a recompile), ``OpOverload`` / ``OpOverloadPacket`` (the type of an ATen
op in a graph), ``FakeTensor`` / ``FakeTensorMode`` / ``fake_tensor_tls`` (tracing with no data),
``core_aten_decompositions`` (the decomposition table to core ATen), ``LazyGraphModule`` (a
GraphModule whose code is generated on first use: the shadow graph is analysed, not run) and
:func:`lazy_traced_graphs` (``make_fx`` returning one: a node trace is read, not run), ``linear_builtin``
(``torch._C._nn.linear``, what Dynamo records for ``F.linear``), ``legacy_get_string``, ``pytree``,
:func:`functional_collectives` and :func:`no_guard_latency_profile` (Dynamo's guard-latency
profiler, see ``autotp/memory.py``).

**transformers' loading internals.** :func:`weight_conversions` (the per-model weight transforms,
``transformers.conversion_mapping`` and ``core_model_loading``), :func:`causal_lm_class_name`
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) and :func:`rope_init_functions`
(``modeling_rope_utils.ROPE_INIT_FUNCTIONS``).

**Grouped matmuls over stand-ins.** ``parallelize_model`` traces a model whose parameters are
stand-ins: one element expanded to the global shape, stride 0 (``context.standin``), so tracing
costs no memory. ``torch._grouped_mm``'s meta kernel (what Dynamo's fake-tensor propagation and
``make_fx`` run) checks its operands' strides as the CUDA/CPU kernels need them: the last two dims
must be a row- or column-major matrix with 16-byte aligned leading stride. A stride-0 stand-in is
neither, so tracing failed for every model whose experts reach ``_grouped_mm`` — transformers
chooses it under ``torch.compile`` for bf16 weights (``integrations/moe.py: _can_use_grouped_mm``;
fp32 goes through its ``grouped_mm_fallback`` custom op, whose fake kernel checks no strides).

No tensor on a real device can carry a valid matrix layout without holding the matrix, so the
stand-ins cannot change; the check must. :func:`grouped_mm_accepts_standins` replaces the meta
kernel of ``aten::_grouped_mm`` by one that gives an *expanded* operand (a zero stride on a dim of
size > 1) the contiguous layout before running torch's own meta kernel, which then checks shapes,
dtypes, offsets and every other operand's strides as before and builds the output (whose layout
never depended on the input strides). Only meta/fake tensors are affected: the real kernels run on
the local shards the compiled graphs bind (contiguous tensors or views of them) and keep their own
checks. The registration is process-wide (``torch.library`` has no scope), made once, by the first
stand-in (``context.standin`` calls it); a user's own stride-0 operand then fails in the real kernel
at run time instead of at trace time.

**Dynamo's precompile package (stored graphs).** :class:`DynamoPackage` wraps
``torch._dynamo.package.CompilePackage`` (a compiled function's bytecode, guards and graph names,
saved by one process and installed by another) and closes three gaps of torch 2.13's package (see
its docstring); :func:`pickle_graph` / :func:`unpickle_graph` use ``torch.fx._graph_pickler`` (its
``GraphPickler``, with a cheap form of its own for plain fake tensors, rebuilt over a storage of the
traced size by ``torch.Tensor._make_wrapper_subclass(storage_size=)``; its unpickle state's fake mode;
its graph and node records, whose classes are swapped for :class:`_GraphRecord` / :class:`_NodeRecord`,
which read them back faster and keep the graph's used names, and a graph's ``_Namespace`` fields);
the guard filter reads ``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES``; the
uninstaller calls ``torch._C._dynamo.eval_frame._reset_precompile_entries``; a recording package's
``add_inlined_source`` gets an ``add_code`` that builds ``package.InlinedSource`` records from code
objects (:func:`_inlined_source`, with ``package._hash_source`` and ``_get_module_content``, and
``SourceInfo.add_code`` where it cannot); for frames shared within a launch
(``autotp/shared_frames.py``) :func:`_optimize` wraps Dynamo's frame callback
(``OptimizeContext.callback``, skipping what ``trace_rules.check`` skips) and a follower installs
one frame as ``CompilePackage.install`` does (``load_guards_state``, ``load_guard_manager``,
``SerializedCode``), records its code as Dynamo does (``utils.orig_code_map``,
``convert_frame.output_codes``) and returns it as ``types.wrap_guarded_code(GuardedCode(...))``; while autotp's compiled forward runs,
``guards.make_guard_filter_entry`` makes entries (a ``torch._dynamo.types.GuardFilterEntry``
subclass) whose values are read when asked (:func:`_guard_values_read_lazily`); while Dynamo
compiles one of its frames (:class:`_CompileSettings`) ``config.side_effect_replay_policy`` is
``"silent"`` where no log or structured trace reads Dynamo's side-effect report
(:func:`_side_effects_unreported`), ``CheckFunctionManager.build_guards``'s first call (the build
only the guard filter's entries read) returns nothing and the one real build is checked against
the filter (:func:`_guards_built_once`), and ``config.fail_on_recompile_limit_hit`` is on (see
:func:`_no_uncompiled_runs_past_the_recompile_limit`: past the limit Dynamo would run the forward
uncompiled on the shards), and ``UserDefinedObjectVariable.var_getattr`` reads a transformers
config's attributes as ``PretrainedConfig.__getattribute__`` would, without inlining it
(:func:`config_reads_uninlined`; with the function names, :func:`trace_settings`, the planner's
compiles too); a loading guard state's
tensors are rebuilt in one fake mode (``GuardsStatePickler._unpickle_tensor``, see
:func:`_guard_tensors_in_one_fake_mode`), and :func:`_optimize` swaps ``eval_frame.get_compiler_fn``
while ``torch._dynamo.optimize`` runs (its minifier wrapper's imports, see :class:`_DirectCompiler`).
Probed when first used (``autotp/stored_graphs.py``).

**Data-parallel composition (2-D mesh).** DDP's graph splitting and FSDP2's parameter objects,
which the 2-D mesh reaches into (``tests/distributed/test_mesh.py`` notices a change).

**Dynamo's subgraph reuse.** :func:`stamped_regions_keep_bound_sizes` wraps
``torch._dynamo.variables.invoke_subgraph.build_subgraph_input_mapping`` (the record of what a traced
``nested_compile_region`` call passed, which later calls of the region are stamped out from): a size
specialized by a guard after the region bound it is recorded by its own symbol, not by the constant
that the shape environment's replacement gives, so a recompile that specializes a size a layer
region read no longer fails (``autotp/regions.py``).

**Process groups' timeouts.** :func:`group_timeout` reads the collective timeout a process group
was made with (``ProcessGroup._get_backend(device).options._timeout``): torch sets it but offers no
getter. Not probed: where it is missing or changed it returns None, and the caller assumes the
least patient group (``backend="autotp"`` then lets every rank plan on its own).

**scipy's HiGHS bindings.** :func:`highs_lp` solves the certificate's linear program
(``autotp/passes/ilp.py``) through ``scipy.optimize._highspy._core`` (the HiGHS that scipy bundles,
as ``linprog`` calls it) instead of ``linprog``, whose wrapper walks the basis column by column in
Python: half the certificate's time on the smallest graphs. Not probed: where the bindings are
missing or changed it returns None and the caller takes ``linprog``.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import dataclasses
import datetime
import functools
import importlib
import inspect
import itertools
import logging
import os
import pickle
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from autotp.errors import AutoTPError
from autotp.memory import collecting_new_objects_only, full_collections_deferred

__all__ = [
    "DIM_MARKINGS",
    "BackendCompilerFailed",
    "DynamoCompiled",
    "DynamoPackage",
    "FakeTensor",
    "FakeTensorMode",
    "LazyGraphModule",
    "OpOverload",
    "OpOverloadPacket",
    "PICKLE_REFUSALS",
    "PackageError",
    "TorchDynamoException",
    "causal_lm_class_name",
    "dim_markings",
    "core_aten_decompositions",
    "fake_tensor_tls",
    "fsdp_params",
    "functional_collectives",
    "group_timeout",
    "grouped_mm_accepts_standins",
    "highs_lp",
    "legacy_get_string",
    "linear_builtin",
    "maybe_mark_dynamic",
    "no_ddp_graph_split",
    "pytree",
    "no_guard_latency_profile",
    "recompile_limit",
    "pickle_graph",
    "require",
    "require_module",
    "rope_init_functions",
    "source_of",
    "stamped_regions_keep_bound_sizes",
    "thread_state",
    "traced_node_count",
    "unpickle_graph",
    "use_as_unsharded_param",
    "warm_source_names",
    "warm_weight_conversions",
    "weight_conversions",
]

#: what autotp supports (pyproject.toml's ranges), named in every failed probe
SUPPORTED = "torch 2.13.x and transformers 5.24.x"


def installed_versions() -> str:
    """``torch 2.13.0, transformers 5.24.0``: the versions a failed probe names."""
    out = []
    for name in ("torch", "transformers"):
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def require(module: str, name: str) -> Any:
    """``module.name`` (a private internal), or an :class:`AutoTPError` naming it and the installed
    versions when this install does not have it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise AutoTPError(
            f"autotp needs {module}.{name}, which this install does not have ({installed_versions()}; "
            f"{type(e).__name__}: {e}). autotp supports {SUPPORTED}: install those "
            "(pip install 'torch==2.13.*' 'transformers==5.24.*'), or see what a newer release changed "
            "with scripts/check-latest."
        ) from e


def require_module(module: str) -> Any:
    """The private module ``module``, or an :class:`AutoTPError` as :func:`require` raises."""
    parent, _, name = module.rpartition(".")
    importlib.import_module(parent)
    try:
        return importlib.import_module(module)
    except ImportError:
        return require(parent, name)  # raises the probe's error (or finds a non-module attribute)


# -- Dynamo and ATen internals (probed at import) ------------------------------------------
BackendCompilerFailed: type[Exception] = require("torch._dynamo.exc", "BackendCompilerFailed")
TorchDynamoException: type[Exception] = require("torch._dynamo.exc", "TorchDynamoException")
maybe_mark_dynamic: Callable[..., None] = require("torch._dynamo", "maybe_mark_dynamic")
OpOverload: type = require("torch._ops", "OpOverload")
OpOverloadPacket: type = require("torch._ops", "OpOverloadPacket")
FakeTensor: type = require("torch._subclasses.fake_tensor", "FakeTensor")
FakeTensorMode: type = require("torch._subclasses.fake_tensor", "FakeTensorMode")
fake_tensor_tls: Any = require("torch._subclasses.fake_tensor", "fake_tensor_tls")
#: a GraphModule that writes its Python code only when it is first read or called; the shadow
#: graph is analysed, never run, so the code (about a quarter of a decomposition) is usually never written
LazyGraphModule: type = require("torch.fx._lazy_graph_module", "_LazyGraphModule")
_use_lazy_graph_module: Callable[[bool], Any] = require("torch.fx._lazy_graph_module", "_use_lazy_graph_module")
core_aten_decompositions: Callable[[], dict[Any, Callable[..., Any]]] = require(
    "torch._decomp", "core_aten_decompositions"
)
#: the builtin ``F.linear`` calls, which Dynamo records in graphs in its place
linear_builtin: Callable[..., torch.Tensor] = require("torch._C._nn", "linear")
#: ``reduction=`` from the legacy ``size_average`` / ``reduce`` arguments of torch's losses
legacy_get_string: Callable[..., str] = require("torch.nn._reduction", "legacy_get_string")
#: torch's pytree utilities (flatten / unflatten of nested containers of tensors)
pytree: Any = require_module("torch.utils._pytree")
#: the list and dict types FX keeps node arguments in
immutable_list: type = require("torch.fx.immutable_collections", "immutable_list")
immutable_dict: type = require("torch.fx.immutable_collections", "immutable_dict")


def functional_collectives() -> Any:
    """``torch.distributed._functional_collectives``: collectives as traceable, out-of-place ops
    (what inductor-compiled inner graphs call); imported when first used."""
    return require_module("torch.distributed._functional_collectives")


def _no_latency(*_args: Any) -> float:
    """Stands in for Dynamo's guard-latency profiler: no cache eviction, latency 0."""
    return 0.0


@contextlib.contextmanager
def no_guard_latency_profile() -> Iterator[None]:
    """Within the block, Dynamo compiles without profiling guard latency (why:
    ``autotp/memory.py``'s docstring). Only the name Dynamo's guard module calls
    (``torch._dynamo.guards.profile_guard_manager``) is swapped, and restored on exit; on a torch
    without it the block changes nothing (the profiling costs memory, not correctness). Nested
    blocks restore what they found."""
    guards = sys.modules.get("torch._dynamo.guards")
    original = getattr(guards, "profile_guard_manager", None)
    if original is None:
        yield
        return
    with _swapped(guards, "profile_guard_manager", _no_latency):
        yield


def warm_source_names(files: Iterable[str]) -> None:
    """Fill Dynamo's per-process table of which function each source line belongs to
    (``torch._dynamo.funcname_cache``) for ``files``, as its first trace through them would.

    Why: Dynamo names the function of every FX node it creates (for a trace log, also when that log
    is off), and the first lookup in a file tokenizes the whole file: a rank's first compile of a
    tiny Llama tokenized 8 files, ~0.5 CPU-s, most of it ``transformers/modeling_utils.py`` (loaded
    machine). A process that forks ranks (``autotp/_rank_server.py``) does it once for all of them.
    Safe: the table is a pure cache of the files' text; a file that cannot be read is recorded as
    Dynamo records it (no names). On a torch without the module nothing is done."""
    try:
        funcname_cache = importlib.import_module("torch._dynamo.funcname_cache")
    except ImportError:
        return
    if not hasattr(funcname_cache, "get_funcname"):
        return
    for file in files:
        funcname_cache.get_funcname(file, 0)


def lazy_traced_graphs() -> contextlib.AbstractContextManager[None]:
    """Within the block, ``make_fx`` returns a :data:`LazyGraphModule`, whose Python code is written
    only when first read or called (``torch.fx._lazy_graph_module._use_lazy_graph_module``, the
    flag inductor sets for the same reason; torch restores the previous value on exit).

    Why: ``decompose`` traces each distinct Dynamo node alone and only reads the traced graph's
    nodes (and copies them into the shadow graph), never runs it, yet each trace wrote its code:
    about 30% of a node trace (profiled; the benchmark model's warm-up graph makes 106 traces over
    its two decompositions, whose CPU went ~0.75 -> ~0.62 s with this, loaded machine). Safe: the graph, its nodes and attributes
    are the same; only the code generation is deferred, and any reader of ``.code`` still gets it."""
    return _use_lazy_graph_module(True)


#: device types whose autocast state :func:`thread_state` carries
_AUTOCAST_DEVICES = ("cpu", "cuda")


def thread_state() -> Callable[[], contextlib.AbstractContextManager[None]] | None:
    """The calling thread's torch state that tracing reads, as a context manager factory another
    thread enters to trace as this one would (``memory.on_a_fresh_stack``); None where it cannot be
    carried (a Python dispatch or function mode, or a functorch transform, is active: their stacks
    are the thread's own).

    Carried: grad mode, inference mode, autocast (per device type: on, dtype; and its cache),
    Dynamo's tracing and compile contexts (``torch._guards.TracingContext`` / ``CompileContext``,
    thread-local: under a backend, ``make_fx`` and fake tensors consult the tracing context's
    fake mode, ``torch._guards.detect_fake_mode``), and fake tensors' thread-local switches
    (``fake_tensor_tls.allow_non_fake_inputs_override``, which the planner sets to let a meta
    constant into a trace; ``meta_utils.tls.disable_inference_mode``, which Dynamo sets).
    A default device (``torch.set_default_device``) is a function mode: not carried, the call stays."""
    from torch._guards import CompileContext, TracingContext, compile_context, tracing
    from torch._subclasses import meta_utils

    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack() \
            or torch._C._are_functorch_transforms_active():
        return None
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = [(d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    autocast_cache = torch.is_autocast_cache_enabled()
    traced, compiled = TracingContext.try_get(), CompileContext.try_get()
    non_fake = fake_tensor_tls.allow_non_fake_inputs_override
    no_inference = getattr(meta_utils.tls, "disable_inference_mode", False)

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        cache = torch.is_autocast_cache_enabled()
        fake_tensor_tls.allow_non_fake_inputs_override = non_fake  # a new thread's own (this one's) state
        meta_utils.tls.disable_inference_mode = no_inference
        with contextlib.ExitStack() as stack:
            if compiled is not None:
                stack.enter_context(compile_context(compiled))
            if traced is not None:
                stack.enter_context(tracing(traced))
            if inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(grad))
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            torch.set_autocast_cache_enabled(autocast_cache)
            try:
                yield
            finally:
                torch.set_autocast_cache_enabled(cache)

    return entered


def traced_node_count() -> int:
    """How many nodes the graph that ``make_fx`` is recording holds now (0 outside a trace): the
    boundaries of a batched trace (``decompose``'s :func:`_trace_batch` records it before and
    after each Dynamo node's call, and splits the joint graph there). Reads
    ``proxy_tensor.get_proxy_mode()``'s tracer graph."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return 0 if mode is None else len(mode.tracer.graph.nodes)


# -- transformers' loading internals (probed when first used) ------------------------------
def warm_weight_conversions() -> None:
    """Build transformers' table of checkpoint conversions by model type, which it builds on the
    first lookup in a process and keeps (``conversion_mapping.get_checkpoint_conversion_mapping``;
    ~0.3 CPU-s of every rank's load, profiled on a tiny Llama). Nothing where the name is gone."""
    try:
        lookup = require("transformers.conversion_mapping", "get_checkpoint_conversion_mapping")
    except AutoTPError:
        return
    lookup("llama")


def weight_conversions() -> SimpleNamespace:
    """transformers' weight-conversion machinery (``autotp/checkpoint_keys.py`` reads checkpoints
    through it): ``get_model_conversion_mapping`` and, from ``core_model_loading``,
    ``WeightConverter``, ``WeightRenaming``, ``Concatenate``, ``MergeModulelist``,
    ``dot_natural_key`` and ``rename_source_key``. Public API: none (transformers applies it inside
    ``from_pretrained``)."""
    loading = "transformers.core_model_loading"
    return SimpleNamespace(
        get_model_conversion_mapping=require(
            "transformers.conversion_mapping", "get_model_conversion_mapping"
        ),
        **{
            name: require(loading, name)
            for name in (
                "WeightConverter",
                "WeightRenaming",
                "Concatenate",
                "MergeModulelist",
                "dot_natural_key",
                "rename_source_key",
            )
        },
    )


def causal_lm_class_name(model_type: str) -> str | None:
    """The causal-LM class transformers maps ``model_type`` to (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``;
    ``AutoModelForCausalLM`` exposes no name lookup without building the class), or None."""
    names = require("transformers.models.auto.modeling_auto", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return names.get(model_type)


def encoder_outputs(last_hidden_state: torch.Tensor) -> Any:
    """An encoder's result as ``generate`` hands it to an encoder-decoder's forward
    (``encoder_outputs=``): transformers' ``BaseModelOutput``, which the top-level package does
    not export."""
    return require("transformers.modeling_outputs", "BaseModelOutput")(last_hidden_state=last_hidden_state)


def rope_init_functions() -> dict[str, Callable[..., Any]]:
    """transformers' rotary-embedding initialisers by ``rope_type`` (``ROPE_INIT_FUNCTIONS``), used
    to compute ``inv_freq`` buffers of a model built on the meta device."""
    return require("transformers.modeling_rope_utils", "ROPE_INIT_FUNCTIONS")


class _GroupedMmMeta:
    """Owns the replacement: the C++ dispatcher's Meta kernel (a ``torch.library`` registration,
    which lives as long as this object) and the Python dispatcher's (``OpOverload.py_kernels``,
    which Dynamo's fake-tensor propagation and ``make_fx`` consult first)."""

    def __init__(self) -> None:
        from torch._C import DispatchKey
        from torch._meta_registrations import meta_grouped_mm

        op = torch.ops.aten._grouped_mm.default
        self.original = op.py_kernels.pop(DispatchKey.Meta, meta_grouped_mm)
        op.py_impl(DispatchKey.Meta)(self.meta)
        self.library = torch.library.Library("aten", "IMPL")
        # torch's own Meta kernel is a Python registration too: torch 2.13 overrides it by default,
        # torch 2.11 (the CUDA image the GPU tests ran on) refuses unless asked (allow_override)
        allow = {"allow_override": True} if "allow_override" in inspect.signature(self.library.impl).parameters else {}
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
            warnings.simplefilter("ignore", UserWarning)
            self.library.impl("_grouped_mm", self.meta, "Meta", **allow)

    def meta(
        self,
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> Any:
        return self.original(
            _unexpanded(mat_a), _unexpanded(mat_b), offs=offs, bias=bias, out_dtype=out_dtype
        )


def _unexpanded(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous meta tensor of its shape and dtype where ``t`` is expanded."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True)):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t


_REGISTRATION: list[_GroupedMmMeta] = []


def grouped_mm_accepts_standins() -> None:
    """Install the meta kernel described in the module docstring (idempotent)."""
    if not _REGISTRATION:
        _REGISTRATION.append(_GroupedMmMeta())


# -- data-parallel composition ------------------------------------------------------------
@contextlib.contextmanager
def no_ddp_graph_split() -> Iterator[None]:
    """Inside ``DistributedDataParallel.forward`` Dynamo's default ``optimize_ddp`` mode
    (``"ddp_optimizer"``) splits every graph it compiles at gradient-bucket boundaries and hands
    the backend one piece at a time. autotp plans a whole graph at once (a ``Partial`` value may
    not cross a piece), so for its calls the split is off: DDP then runs as it does around any
    eager module (its reducer's hooks fire on the local shards' gradients). Public API: none; the
    switch is ``torch._dynamo.config.optimize_ddp``."""
    with torch._dynamo.config.patch(optimize_ddp=False):
        yield


def fsdp_params(module: torch.nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects of a module that ``fully_shard`` was applied to (this module's
    own parameter group; ``FSDPModule`` exposes no list of them)."""
    state = module._get_fsdp_state()  # FSDPModule's accessor of its state
    return [p for group in state._fsdp_param_groups for p in group.fsdp_params]


def param_location(fsdp_param: Any) -> tuple[torch.nn.Module, str]:
    """The module and attribute name FSDP2 registers ``fsdp_param``'s tensors under."""
    info = fsdp_param._module_info
    return info.module, info.param_name


def sharded_param(fsdp_param: Any) -> torch.nn.Parameter:
    """The ``DTensor`` parameter FSDP2 registers outside forward (what optimizers hold)."""
    return fsdp_param.sharded_param


def use_as_unsharded_param(fsdp_param: Any, local: torch.nn.Parameter) -> None:
    """Make ``local`` the parameter FSDP2 all-gathers into and registers during forward and backward.

    Must run after the first all-gather (``FSDPModule.unshard()``), which creates the unsharded
    parameter as a view of the all-gather output. ``local`` then views the same storage (FSDP2
    frees and re-allocates that storage in place, so ``local`` follows it), and becomes
    ``_unsharded_param``: FSDP2 registers it on the module before forward and reduce-scatters
    its ``.grad`` after backward. Why: autotp's compiled graphs bind the local shard objects
    themselves (``get_attr``), so the tensor FSDP2 gathers into must be that very object; FSDP2
    has no public way to supply it."""
    unsharded = fsdp_param._unsharded_param
    if tuple(unsharded.shape) != tuple(local.shape) or unsharded.dtype != local.dtype:
        raise RuntimeError(
            f"FSDP2's unsharded parameter {tuple(unsharded.shape)} {unsharded.dtype} does not "
            f"match the local shard {tuple(local.shape)} {local.dtype}"
        )
    with torch.no_grad():
        local.data = unsharded.data
    local.requires_grad_(unsharded.requires_grad)
    fsdp_param._unsharded_param = local


# -- Dynamo's precompile package (stored graphs, autotp/stored_graphs.py) --------------------
#: the dim markings ``maybe_mark_dynamic`` and friends leave on a tensor, which Dynamo's marking
#: guard compares (``guards.py``, "Dimension Marking Guards") and its stored guard state loses
DIM_MARKINGS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
                "_dynamo_strict_unbacked_indices", "_dynamo_static_indices", "_has_dynamo_dim_marking")
#: node metadata a stored graph keeps: what the plan cache keys on and the passes read
_GRAPH_META = ("example_value", "val", "tensor_dict", "autotp_checkpoint")


class _Source:
    """The part of Dynamo's ``Source`` a stored graph keeps: its name."""

    def __init__(self, name: str) -> None:
        self.name = name


class _GraphArg:
    """The part of Dynamo's ``GraphArg`` a stored graph keeps (``node.meta["grapharg"].source.name``,
    what the plan cache and ``backend.grapharg_source`` read)."""

    def __init__(self, name: str) -> None:
        self.source = _Source(name)


def _plain_fake(value: Any) -> Any:
    """``value`` with each fake view replaced by a plain fake tensor of the same sizes, strides,
    dtype, device and ``requires_grad`` (``GraphPickler`` cannot pickle a fake view's base)."""

    def plain(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t._base is None:
            return t
        with t.fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device,
                                       requires_grad=t.requires_grad)

    return pytree.tree_map(plain, value)


def _fake_from_layout(shape: tuple[Any, ...], stride: tuple[Any, ...], dtype: torch.dtype, device: torch.device,
                      requires_grad: bool, nbytes: Any, state: Any) -> torch.Tensor:
    """A fake tensor of this layout in the unpickling graph's fake mode (``state``: GraphPickler's
    unpickle state), built as ``GraphPickler``'s own path builds one (a meta tensor wrapped as a
    ``FakeTensor``, outside the mode's dispatch) without its general describe-and-rebuild machinery.
    ``nbytes`` is the traced tensor's storage size (a SymInt where its sizes are symbolic): the meta
    tensor is made with that storage (:func:`_meta_of_layout`), not by ``torch.empty_strided``, whose
    storage size on symbolic sizes is sympy arithmetic per tensor (~150 us each: most of the
    unpickling of a graph with a dynamic sequence length)."""
    with _no_dispatch():
        t = FakeTensor(state.fake_mode, _meta_of_layout(shape, stride, dtype, nbytes), device)
    if requires_grad:
        t.requires_grad_(True)
    return t


class _MetaLayout(torch.Tensor):
    """The type ``torch.Tensor._make_wrapper_subclass`` needs to make a meta tensor of a given
    layout and storage size; :func:`_fake_from_layout` wraps it as a ``FakeTensor`` at once, under
    ``no_dispatch``, so nothing dispatches to it."""

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"autotp: {func} on a layout-only meta tensor")


def _meta_of_layout(shape: tuple[Any, ...], stride: tuple[Any, ...], dtype: torch.dtype, nbytes: Any) -> torch.Tensor:
    """A meta tensor of this layout (offset 0) over a storage of ``nbytes``: the sizes, strides,
    storage size, dtype and dispatch keys ``torch.empty_strided`` would give it (a ``FakeTensor``
    made over it has the same keys: it adds the Python ones either way), without recomputing the
    storage size. A torch whose ``_make_wrapper_subclass`` takes no ``storage_size`` gets
    ``torch.empty_strided``."""
    if _wrapper_takes_storage_size():
        return torch.Tensor._make_wrapper_subclass(_MetaLayout, shape, stride, 0, dtype=dtype, device="meta",
                                                   storage_size=nbytes)
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


@functools.cache
def _wrapper_takes_storage_size() -> bool:
    """Whether this torch's ``_make_wrapper_subclass`` takes ``storage_size`` (torch >= 2.1)."""
    try:
        with _no_dispatch():
            torch.Tensor._make_wrapper_subclass(_MetaLayout, (1,), (1,), 0, dtype=torch.float32, device="meta",
                                                storage_size=4)
    except TypeError:
        return False
    return True


def _no_dispatch() -> Any:
    """``torch.utils._mode_utils.no_dispatch``: no ``__torch_dispatch__`` (modes, subclasses) runs."""
    from torch.utils._mode_utils import no_dispatch

    return no_dispatch()


def _plain_layout(t: Any) -> bool:
    """Whether ``t`` is a fake tensor :func:`_fake_from_layout` rebuilds exactly: a plain strided
    ``FakeTensor`` (no subclass such as a fake ``Parameter``, no view, offset 0, no conjugate or
    negative bit) that is a leaf or needs no gradient (a non-leaf keeps its autograd history)."""
    return (type(t) is FakeTensor and t._base is None and t.layout == torch.strided and t.storage_offset() == 0
            and not t.is_conj() and not t.is_neg() and (t.is_leaf or not t.requires_grad))


@functools.cache
def _graph_pickler() -> type:
    """``GraphPickler`` with a cheap form for the plain fake tensors of a graph's example values
    (nearly all of them): their sizes, strides (SymInts pickled by ``GraphPickler`` itself), dtype,
    device and ``requires_grad``, instead of its general ``MetaTensorDesc`` whose rebuild
    (``MetaConverter.meta_tensor``) was most of a stored graph's unpickling. Any other tensor
    takes ``GraphPickler``'s own path."""
    from torch.fx._graph_pickler import GraphPickler

    class LayoutPickler(GraphPickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            #: one SymInt per distinct symbolic storage size, so that each is pickled (and read back) once
            self.storage_sizes: dict[Any, Any] = {}

        def reducer_override(self, obj: object) -> Any:
            if _plain_layout(obj):
                nbytes = obj.untyped_storage().nbytes()
                if isinstance(nbytes, torch.SymInt):
                    nbytes = self.storage_sizes.setdefault(nbytes.node.expr, nbytes)
                return _fake_from_layout, (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device,
                                           obj.requires_grad, nbytes, self._unpickle_state)
            reduced = super().reducer_override(obj)
            if isinstance(obj, torch.fx.GraphModule):
                graph = reduced[1][0].graph  # GraphPickler's _GraphPickleData, its nodes' _NodePickleData
                graph.__class__ = _GraphRecord
                namespace = obj.graph._graph_namespace
                graph.names = (set(namespace._used_names), dict(namespace._base_count))
                for record in graph.nodes:
                    record.__class__ = _NodeRecord
            return reduced

    return LayoutPickler


class _GraphRecord:
    """``GraphPickler``'s record of a graph (its ``_GraphPickleData``: the same fields, the class
    swapped when pickled) plus the names its namespace had used (``names``), which GraphPickler
    does not keep: a node the passes add to the graph read back is named as in the traced graph
    (``linear_15``, not ``linear_13``: the trace had used and dropped names), so the lowered code is
    the traced graph's, name for name."""

    def unpickle(self, gm: torch.fx.GraphModule, unpickle_state: Any) -> torch.fx.Graph:
        graph = torch.fx.Graph(gm, self.tracer_cls, self.tracer_extras)
        nodes: dict[Any, torch.fx.Node] = {}
        for record in self.nodes:
            nodes[record] = record.unpickle(graph, nodes, unpickle_state)
        if hasattr(self, "_codegen"):
            graph._codegen = self._codegen
        graph._graph_namespace._used_names, graph._graph_namespace._base_count = self.names
        return graph


class _NodeRecord:
    """``GraphPickler``'s record of one node (its ``_NodePickleData``: the same fields, the class
    swapped when pickled) read back with a plain walk of the node's arguments
    (:func:`_nodes_of_records`) where GraphPickler walks them with pytree, which was ~60% of rebuilding
    a graph's nodes (profiled)."""

    def unpickle(self, graph: torch.fx.Graph, mapping: dict[Any, torch.fx.Node], unpickle_state: Any) -> torch.fx.Node:
        target = self.target.unpickle(unpickle_state)
        if not (callable(target) or isinstance(target, str)):
            raise TypeError(f"a stored graph's node {self.name} has the target {target!r}")
        node = graph.create_node(self.op, target, _nodes_of_records(self.args, mapping),
                                 _nodes_of_records(self.kwargs, mapping), self.name, self.type)
        node.meta = self.meta
        return node


#: argument values that hold no node record
_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format,
                    torch.SymInt, FakeTensor})


def _nodes_of_records(value: Any, mapping: dict[Any, torch.fx.Node]) -> Any:
    """``value`` (node arguments) with each :class:`_NodeRecord` replaced by its node: what
    ``pytree.tree_map_only(_NodeRecord, mapping.__getitem__, value)`` gives, walking the plain
    containers (tuple, list, dict, their immutable FX forms, slice) and atoms itself and handing
    anything else (a named tuple, ``torch.Size``, ...) to pytree."""
    kind = type(value)
    if kind is _NodeRecord:
        return mapping[value]
    if kind in _ATOMS:
        return value
    if kind is tuple or kind is list or kind is immutable_list:
        return kind(_nodes_of_records(v, mapping) for v in value)
    if kind is dict or kind is immutable_dict:
        return kind((k, _nodes_of_records(v, mapping)) for k, v in value.items())
    if kind is slice:
        return slice(*(_nodes_of_records(v, mapping) for v in (value.start, value.stop, value.step)))
    return pytree.tree_map_only(_NodeRecord, mapping.__getitem__, value)


#: what ``pickle.dumps`` raises for an object it cannot pickle (a module, a lambda, a class it cannot
#: find by name: ``PicklingError``, ``TypeError``, ``AttributeError``): the stored-graph entry and the
#: shared-frame message catch these alone and go on without storing or sharing; any other error is a bug
PICKLE_REFUSALS: tuple[type[Exception], ...] = (pickle.PicklingError, TypeError, AttributeError)


def pickle_graph(gm: torch.fx.GraphModule) -> bytes:
    """A Dynamo graph as bytes (``torch.fx._graph_pickler.GraphPickler``, fake example values and
    symbolic sizes included; plain fakes in a cheap form, :func:`_graph_pickler`), with only the node
    metadata the plan cache and the passes read; ``gm`` is left as it was."""
    from torch.fx._graph_pickler import Options

    saved = {}
    nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]  # sub-graphs too
    for n in nodes:
        saved[n] = n.meta
        meta = {k: _plain_fake(v) if k == "example_value" else v for k, v in n.meta.items() if k in _GRAPH_META}
        grapharg = n.meta.get("grapharg")
        if grapharg is not None and hasattr(grapharg, "source"):
            meta["grapharg"] = _GraphArg(grapharg.source.name)
        n.meta = meta
    try:
        return _graph_pickler().dumps(gm, Options(ops_filter=None, node_metadata_key_filter=None))
    finally:
        for n, meta in saved.items():
            n.meta = meta


def unpickle_graph(data: bytes) -> torch.fx.GraphModule:
    """:func:`pickle_graph`'s graph, its fake values in a fresh fake mode and shape environment.

    Its Python code (``.code``, as pickled) is compiled into ``forward`` when first called
    (:func:`_compile_on_first_call`), not here: lowering edits the graph and recompiles it before
    anything calls it, so compiling the unedited graph was wasted (~25 ms per graph of the 150m
    benchmark model)."""
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    cls = type(gm)
    if cls.__name__ == "GraphModuleImpl" and "forward" not in vars(cls) and "__call__" not in vars(cls):
        cls.forward = _compile_on_first_call  # GraphModule.__new__ made this class for this module alone
    else:
        gm.recompile()
    return gm


def _compile_on_first_call(self: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of an unpickled graph module until its first recompile: recompile (which
    replaces it, as on any ``GraphModule``), then run."""
    self.recompile()
    return self(*args, **kwargs)


def source_of(node: torch.fx.Node) -> str | None:
    """The name of the source Dynamo read a placeholder from (``L['kwargs']['input_ids']``)."""
    grapharg = node.meta.get("grapharg")
    return grapharg.source.name if grapharg is not None and hasattr(grapharg, "source") else None


def dim_markings(value: Any) -> dict[str, Any]:
    """The dim markings (:data:`DIM_MARKINGS`) ``value`` carries."""
    return {a: getattr(value, a) for a in DIM_MARKINGS if hasattr(value, a)}


def _serializable_guards(entries: Any) -> list[bool]:
    """Dynamo's guard filter for a package: drop the guards its guard state cannot store (globals,
    object identities: ``UNSUPPORTED_SERIALIZATION_GUARD_TYPES``, also where a guard derives one)
    and every guard below a dropped one (``L['func'].__name__`` below ``L['func']``'s identity:
    the stored state does not keep that value). What stays guards the model's class, its config
    constants and every input's type, size, stride and dtype."""
    unsupported = set(require("torch._dynamo.guards", "CheckFunctionManager").UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    keep = [not (g.is_global or g.guard_type in unsupported or unsupported & set(g.derived_guard_types or ()))
            for g in entries]
    dropped = tuple(n for g, k in zip(entries, keep, strict=True) for n in (g.name + ".", g.name + "[") if not k)
    return [k and not g.name.startswith(dropped) for g, k in zip(entries, keep, strict=True)]


class _Backend:
    """What ``CompilePackage.install`` expects of a stored backend (a ``BackendCacheArtifact``)."""

    def __init__(self, run: Callable[..., Any]) -> None:
        self.run = run

    def after_deserialization(self) -> Callable[..., Any]:
        return self.run


class PackageError(Exception):
    """A stored package that does not load into this process (its message says why)."""


#: a forward's code object -> the token of the :class:`DynamoPackage` created on it last. Two models
#: of one class share the code object, its precompiled entries and the global names their frames
#: read, so a package's uninstaller acts only while its package is still the last one: the first
#: model's close must not take away what the second installed (it did: ``NameError`` on a Dynamo
#: module alias in the second model's next call)
_LAST_PACKAGE_ON: dict[types.CodeType, object] = {}


class DynamoPackage:
    """A function compiled by Dynamo into a ``torch._dynamo.package.CompilePackage``: the package
    records each frame's transformed bytecode and guards and the name of each graph's compiled
    function, so that a later process can install them and run the function without tracing it.
    Three gaps of torch 2.13's package are closed here:

    * the package installs its globals (the compiled functions, module aliases) in
      ``sys.modules[fn.__module__]``, but a ``functools.wraps`` wrapper (transformers' forward
      decorators) has its wrapped function's ``__module__`` and its own globals: they are copied
      into the globals the code runs in;
    * Dynamo's generated code reads module aliases (``___module_collections_<id>``, made by
      ``codegen.create_load_python_module``) that the package does not record: :meth:`entry`
      returns them by module name, :meth:`__init__` installs them;
    * the stored guard state loses the inputs' dim markings, so a marked input failed the marking
      guard ("absent at compile time"): ``markings`` (source name -> attributes) are put back on
      the guard state's values while it loads. A union over graphs is sound: a marking only
      relaxes the marking guard, the sizes stay guarded.

    ``stored``: ``(entry, globals)`` as :meth:`entry` returned them in an earlier process, with
    ``graphs`` (compiled function name -> callable) and ``markings``; any failure to install
    raises :class:`PackageError` and leaves nothing installed."""

    def __init__(self, fn: Callable[..., Any], backend: Callable[..., Any], stored: tuple[Any, dict] | None = None,
                 graphs: dict[str, Callable[..., Any]] | None = None,
                 markings: dict[str, dict[str, Any]] | None = None, share: FrameShare | None = None) -> None:
        package_module = require_module("torch._dynamo.package")
        self.fn = fn
        self._globals = getattr(fn, "__func__", fn).__globals__
        self._copied: list[str] = []
        #: why this package's entry cannot be stored (a frame Dynamo cannot name), or None
        self.unstorable: str | None = None
        if stored is None:
            self.package = package_module.CompilePackage(fn)
        else:
            try:
                self.package = package_module.CompilePackage(fn, stored[0])
                with _guard_markings(package_module, markings or {}), _guard_tensors_in_one_fake_mode():
                    self.package.install({name: _Backend(run) for name, run in (graphs or {}).items()})
                for module, names in self.package._installed_globals.items():
                    for name in names:
                        self._install(name, module.__dict__[name])
                for name, (kind, value) in stored[1].items():
                    if name not in self._globals:
                        self._install(name, importlib.import_module(value) if kind == "module" else value)
                # the numbers the writing process gave the globals now in these modules (torch's install
                # puts a frame's builtins dict there unrecorded) kept from this process's own later
                # compiles, which would make them again (``AssertionError: Name '__builtins_dict___6'
                # already exists in scope``, seen in the test suite)
                for scope in (self._globals, *(m.__dict__ for m in self.package._installed_globals)):
                    for name in list(scope):
                        _reserve_unique_id(name)
            except Exception as e:  # noqa: BLE001 - any failure: the caller compiles as without a package
                self.uninstall()
                raise PackageError(f"{type(e).__name__}: {e}") from e
        self._note_unnamed_frames()
        self._record_sources_cheaply()
        self._token = object()
        _LAST_PACKAGE_ON[getattr(fn, "__func__", fn).__code__] = self._token
        wrap = None if share is None else \
            functools.partial(_publishing_callback, share=share, entry_of=self.frame_entry) if share.tracer else \
            functools.partial(_receiving_callback, share=share)
        self.compiled = _optimize(fn, backend, wrap, package=self.package)

    def _note_unnamed_frames(self) -> None:
        """A frame Dynamo compiles after a graph break is recorded by its qualified name, and torch
        2.13 fails the whole compile where it finds none (GPT-2's ``self.loss_function``, a property
        returning a function made at runtime: ``PackageError: Cannot resolve a fully qualified
        name``). Such a frame is recorded under no name instead and the package marked
        :attr:`unstorable`, so the model compiles and runs as without a package and :meth:`entry`
        refuses to store what a later process could not install."""
        package, add_user_function = self.package, self.package._add_user_function
        torch_package_error = require_module("torch._dynamo.exc").PackageError

        def add_or_note(code: types.CodeType) -> None:
            try:
                add_user_function(code)
            except torch_package_error as e:
                self.unstorable = str(e)
                module = inspect.getmodule(code)
                package._add_function(code, module.__name__ if module is not None else "<unknown>")

        package._add_user_function = add_or_note

    def _record_sources_cheaply(self) -> None:
        """Dynamo records, after each frame's guards, the source of every function it inlined
        (module, line range, SHA-256 of those lines: what a later install checks, refusing a package
        whose sources changed). torch 2.13 finds each function's module with ``inspect.getmodule``
        (a scan of ``sys.modules`` per function) and its lines with ``inspect.getsourcelines``
        (tokenizing the function's block): ~0.8 CPU s per graph of the benchmark model, ~820
        functions, on the recording rank after its backend returned, while the other ranks wait
        for it at the graph's first collective. :func:`_inlined_source` records the same fields from
        the code object's own line table, once per function per process; torch's control flow
        (the entry being recorded, resume functions skipped) and its ``add_code`` for any function
        the fast path cannot read stay as they are."""
        package = self.package
        add_inlined_source = package.add_inlined_source

        def add_code(code: types.CodeType) -> None:
            record = _inlined_source(code)
            if record is _NO_MODULE:
                return
            if record is None:  # torch's own path (and its errors)
                type(package._source_info).add_code(package._source_info, code)
            else:
                package._source_info.inlined_sources.add(record)

        def add_inlined_source_cheaply(sources: list[types.CodeType]) -> None:
            info = package._source_info
            info.add_code = add_code  # for this call only: the SourceInfo is pickled with the entry
            try:
                add_inlined_source(sources)
            finally:
                del info.add_code

        package.add_inlined_source = add_inlined_source_cheaply

    def _install(self, name: str, value: Any) -> None:
        if self._globals.get(name) is not value:
            self._globals[name] = value
            self._copied.append(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _storable_guards(), _guard_values_read_lazily():
            return self.compiled(*args, **kwargs)

    def graphs(self) -> dict[str, Any]:
        """Compiled function name -> what the backend returned, for the graphs this process compiled."""
        return dict(self.package.cached_backends)

    def entry(self) -> tuple[Any, dict[str, tuple[str, str]]]:
        """What a later process installs: the package's cache entry (picklable) and the module
        aliases Dynamo's code reads that the package does not record. Each alias is renamed in the
        stored code to one named after its module (``___autotp_module_collections``): Dynamo's
        own name carries the module's address and a compile id, which a later process's own
        compile may make again (it then refuses the name as already taken)."""
        if self.unstorable is not None:
            raise PackageError(self.unstorable)
        return self._entry_in_this_launch()

    def _entry_in_this_launch(self) -> tuple[Any, dict[str, tuple[str, str]]]:
        """:meth:`entry`, also where the package holds a frame recorded under no name
        (:attr:`unstorable`): another rank of this launch installs a frame on its own running frame
        (:func:`_install_frame`), never by the name a later process would resolve, so such a frame
        (GPT-2's ``loss_function``, the frame after a training forward's graph break) is shared
        though it cannot be stored. A guard state Dynamo could not pickle still raises."""
        package_module = require_module("torch._dynamo.package")
        entry = self.package.cache_entry()
        for code in entry.codes:
            for guarded in code.guarded_codes:
                if guarded.guards_state.startswith(_UNSTORABLE):
                    raise PackageError(guarded.guards_state[len(_UNSTORABLE):].decode(errors="replace"))
        renamed: dict[str, str] = {}
        aliases: dict[str, tuple[str, str]] = {}

        def rename(code: Any) -> Any:
            names = []
            for name in code.co_names:
                value = self._globals.get(name)
                if name.startswith("___module_") and isinstance(value, types.ModuleType):
                    stable = "___autotp_module_" + value.__name__.replace(".", "_dot_")
                    renamed[name], aliases[stable] = stable, ("module", value.__name__)
                names.append(renamed.get(name, name))
            consts = tuple(rename(c) if isinstance(c, package_module.SerializedCode) else c for c in code.co_consts)
            return dataclasses.replace(code, co_names=tuple(names), co_consts=consts)

        codes = [dataclasses.replace(code, guarded_codes=[
            dataclasses.replace(guarded, dynamo_code=rename(guarded.dynamo_code)) for guarded in code.guarded_codes])
            for code in entry.codes]
        return dataclasses.replace(entry, codes=codes), aliases

    def frame_entry(self, code: types.CodeType, scope: dict[str, Any]) -> FrameEntry:
        """What another process of this launch installs to run ``code``'s newest compiled version
        (:func:`_install_frame`): this package's :meth:`entry` and where the frame's code is in it;
        a :class:`PackageError` where the package holds no guarded code for it or cannot be stored.
        The module aliases :meth:`entry` did not rename (those of a frame whose globals are not the
        forward's, a resume function's in the model's module) are sent by the names the code reads,
        looked up in the frame's globals ``scope``."""
        package_module = require_module("torch._dynamo.package")
        # by value, as the package's own table: a resume function's code the frame runs may be an
        # equal copy of the one recorded (one the code installed from an entry made, see
        # _install_frame), which its compile recorded under the original
        codes = self.package._codes
        if code not in codes or not codes[code].guarded_codes:
            raise PackageError(f"the package holds no compiled code for {code.co_name}")
        index = list(codes).index(code)
        entry, aliases = self._entry_in_this_launch()

        def module_names(serialized: Any) -> Iterator[str]:
            yield from (n for n in serialized.co_names if n.startswith("___module_"))
            for c in serialized.co_consts:
                if isinstance(c, package_module.SerializedCode):
                    yield from module_names(c)

        for name in module_names(entry.codes[index].guarded_codes[-1].dynamo_code):
            value = scope.get(name)
            if name not in aliases and isinstance(value, types.ModuleType):
                aliases[name] = ("module", value.__name__)
        return FrameEntry(_code_name(code), entry, aliases, index)

    def uninstall(self) -> None:
        """Take the installed entries off the function's code and the copied globals out."""
        package = getattr(self, "package", None)
        if package is not None and package.is_initialized():
            package.uninstall()
        for name in self._copied:
            self._globals.pop(name, None)
        self._copied = []

    def uninstaller(self) -> Callable[[], None]:
        """:meth:`uninstall` as a function holding no reference to the compiled function (nor so to
        its module): what a session runs when it closes. The installed entries hold the graphs'
        lowered code and so the shards; Dynamo's guards do not let go of them, having no object
        identity to watch."""
        code = getattr(self.fn, "__func__", self.fn).__code__
        installed = [(module, list(names)) for module, names in self.package._installed_globals.items()]
        copied, globals_ = list(self._copied), self._globals
        reset = require("torch._C._dynamo.eval_frame", "_reset_precompile_entries")
        token = self._token

        def uninstall() -> None:
            if _LAST_PACKAGE_ON.get(code) is not token:  # a later model's package owns them now
                return
            del _LAST_PACKAGE_ON[code]
            for module, names in installed:
                for name in names:
                    module.__dict__.pop(name, None)
            for name in copied:
                globals_.pop(name, None)
            reset(code)

        return uninstall


#: :func:`_inlined_source`'s answer for a function of no module (torch records nothing for it)
_NO_MODULE = object()


#: file name -> the module ``inspect.getmodule`` found for its functions (None: no module)
_MODULE_OF_FILE: dict[str, Any] = {}


def _module_of_file(filename: str, code: types.CodeType) -> Any:
    """The module ``inspect.getmodule`` finds for the functions of ``filename`` (``code``: the first
    one asked about), once per file: torch asks once per inlined function, and each miss of
    inspect's own cache scans every loaded module (~15 ms, for each function of a file no module
    has: ``<frozen os>``, a dataclass's generated ``<string>`` methods, ~44 per graph of the
    benchmark model; torch records nothing for them)."""
    if filename not in _MODULE_OF_FILE:
        _MODULE_OF_FILE[filename] = inspect.getmodule(code)
    return _MODULE_OF_FILE[filename]


@functools.cache
def _module_lines(module: types.ModuleType) -> list[str]:
    """The module's source lines as a package install reads them (``inspect.getsourcelines``)."""
    return inspect.getsourcelines(module)[0]


def _last_line(code: types.CodeType) -> int:
    """The last source line any instruction of ``code`` or of a function defined in it spans."""
    positions = getattr(code, "co_positions", None)
    if positions is not None:
        last = max((end for _, end, _, _ in positions() if end is not None), default=code.co_firstlineno)
    else:  # Python 3.10: start lines only
        last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return max([last, *(_last_line(c) for c in code.co_consts if isinstance(c, types.CodeType))])


@functools.cache
def _inlined_source_of(filename: str, code: types.CodeType) -> Any:
    module = _module_of_file(filename, code)
    if module is None:
        return _NO_MODULE
    if getattr(module, "__file__", None) != filename:  # the module's file is not the function's
        return None
    try:
        lines = _module_lines(module)
    except (OSError, TypeError):
        return None
    first, last = code.co_firstlineno, _last_line(code)
    if not 1 <= first <= last <= len(lines):
        return None
    package_module = require_module("torch._dynamo.package")
    return package_module.InlinedSource(module=module.__name__, firstlineno=first, lastlineno=last + 1,
                                        checksum=package_module._hash_source("".join(lines[first - 1:last])),
                                        content=package_module._get_module_content(module))


def _inlined_source(code: types.CodeType) -> Any:
    """What ``torch._dynamo.package.SourceInfo.add_code`` records for an inlined function (an
    ``InlinedSource``: module name, line range, SHA-256 of those lines, the module's source), read
    from the code object: its first line and the last line any of its instructions (or of a
    function defined in it) spans, instead of the block ``inspect.getsourcelines`` tokenizes. The
    range covers every line of the function's code, which is what an install's check needs (it
    hashes the stored range of the module as it is then). Once per function and process (keyed
    with its file: equal code objects of two files are two functions). :data:`_NO_MODULE` for a
    function of no module (torch records nothing); None where the fast path does not apply (a
    file that is not its module's, no source), and the caller takes torch's own ``add_code``."""
    return _inlined_source_of(code.co_filename, code)


class DynamoCompiled:
    """``fn`` compiled by Dynamo with the guards a :class:`DynamoPackage` keeps
    (:func:`_serializable_guards`) but no package: what a rank that stores no entry runs. Recording
    a package pickles each frame's guard state (~0.15 CPU s per graph of the startup benchmark's
    150m model) and records the source of every function Dynamo inlines (~820 per graph), for an
    entry this rank never writes. The guards are the
    packaging rank's, so every rank of a group recompiles on the same calls. The same interface as
    :class:`DynamoPackage` where a rank reads it: no graphs to store, nothing to uninstall (the
    compiled frames stay on the code, as for any ``torch.compile``)."""

    def __init__(self, fn: Callable[..., Any], backend: Callable[..., Any], share: FrameShare | None = None) -> None:
        if share is not None and share.tracer:
            raise AutoTPError("a rank that traces for its group records a package (DynamoPackage)")
        wrap = None if share is None else functools.partial(_receiving_callback, share=share)
        self.compiled = _optimize(fn, backend, wrap)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _guard_values_read_lazily():
            return self.compiled(*args, **kwargs)

    def graphs(self) -> dict[str, Any]:
        return {}

    def uninstaller(self) -> Callable[[], None]:
        return lambda: None


class _DirectCompiler:
    """A backend as ``torch._dynamo.optimize`` calls it, without its minifier wrapper
    (``repro.after_dynamo.WrapBackendDebug``, whose import brings ``aot_autograd``, its partitioner
    and networkx: ~0.37 CPU s, on a warm launch that compiles nothing). Without a minifier setting
    that wrapper only calls the backend; the attribute Dynamo unwraps backends by is kept."""

    def __init__(self, backend: Callable[..., Any]) -> None:
        self._torchdynamo_orig_backend = backend
        self.__name__ = getattr(backend, "__name__", type(backend).__name__)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        return self._torchdynamo_orig_backend(gm, example_inputs, **kwargs)


def _optimize(fn: Callable[..., Any], backend: Callable[..., Any], wrap: Callable[..., Any] | None = None,
              **options: Any) -> Callable[..., Any]:
    """``fn`` under ``torch._dynamo.optimize`` with the package guard filter (and ``options``), the
    backend reached through :class:`_DirectCompiler` unless a minifier setting
    (``torch._dynamo.config.repro_after``) asks for torch's own wrapper. ``wrap``: called with
    Dynamo's frame callback (what the eval-frame hook calls on a cache miss, ``inner=``) and the
    hook's arguments, in its place (:func:`_publishing_callback`, :func:`_receiving_callback`)."""
    eval_frame = require_module("torch._dynamo.eval_frame")
    optimize = functools.partial(torch._dynamo.optimize, backend, dynamic=None, guard_filter_fn=_serializable_guards,
                                 **options)
    if torch._dynamo.config.repro_after is not None:
        context = optimize()
    else:
        original = eval_frame.get_compiler_fn
        eval_frame.get_compiler_fn = _DirectCompiler
        try:
            context = optimize()
        finally:
            eval_frame.get_compiler_fn = original
    if wrap is not None:
        context.callback = _WrappedCallback(context.callback, wrap)
    context.callback = _CompileSettings(context.callback)
    return context(fn)


class _CompileSettings:
    """Dynamo's frame callback (what the eval-frame hook calls on a cache miss: Dynamo's trace,
    the backend, the guards) run with the cyclic collector walking only the objects the compile
    makes (:func:`autotp.memory.collecting_new_objects_only`) and making no automatic full
    collection (:func:`autotp.memory.full_collections_deferred`; the young generations are
    collected as before), under :func:`trace_settings` (Dynamo's function names for its trace logs
    looked up only where those logs are on, a transformers config's attributes read without
    inlining its ``__getattribute__``), a region's source clones
    memoized (:func:`_source_clones_memoized`), side effects replayed without a report nobody reads
    (:func:`_side_effects_unreported`), a frame's guards built once, not twice, for the package
    filter (:func:`_guards_built_once`), and a compile past the recompile limit an error instead of
    an uncompiled run on the shards (:func:`_no_uncompiled_runs_past_the_recompile_limit`).

    Why: a full collection walks every live object, the loaded model, transformers and Dynamo's
    own state (~400,000 objects on the startup benchmark's 150m model): the automatic ones inside
    the warm-up's trace cost ~0.3 CPU s each, and the backend's deliberate one before the shard
    reads (``memory.release_free_memory``) ~0.4; frozen, that one frees the same garbage, the
    trace's and the planning's, walking only it (a young collection: inside the block nothing is
    promoted to the oldest generation, so the collector's count of long-lived objects stays the
    one the last full collection left, and the next full one comes when it would have). Nothing
    else changes: what is collected is the same, garbage older than the compile waits for the
    first full collection after it. Dynamo finds its backend through
    ``_torchdynamo_orig_backend`` as before."""

    def __init__(self, callback: Callable[..., Any]) -> None:
        self._torchdynamo_orig_backend = callback

    def __call__(self, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        with collecting_new_objects_only(), full_collections_deferred(), trace_settings(), \
                _source_clones_memoized(), _side_effects_unreported(), _guards_built_once(), \
                _no_uncompiled_runs_past_the_recompile_limit():
            return self._torchdynamo_orig_backend(frame, cache_entry, frame_state)


@contextlib.contextmanager
def _source_clones_memoized() -> Iterator[None]:
    """Within the block, a chained Dynamo source cloned through a transform
    (``torch._guards.ChainedSource.clone(transform_fn)``) is cloned once per source and transform,
    its bases included; the block's table is dropped at its end.

    Why: Dynamo's reuse check of a layer region (``invoke_subgraph.is_reusable``) maps every source
    the traced body read and every guard it needs from the first layer's sources to this call's
    (``layers[0]. ...`` -> ``layers[3]. ...``) by cloning each whole chain anew, one
    ``dataclasses.replace`` per link, though the chains share their bases: ~3,400 clones with
    ~65,000 links for the 150m benchmark model's two graphs, most of the reuse check's ~0.7 CPU s
    (loaded machine). Sound: sources are frozen dataclasses compared by value, and every transform
    Dynamo clones through (the reuse check's and the stamp-out's ``source_replacement.get``) is a
    pure function of the source, so a clone equals the one a fresh walk would make. A clone
    without a transform is Dynamo's own. On a torch without the method nothing is swapped."""
    guards = sys.modules.get("torch._guards")
    chained = getattr(guards, "ChainedSource", None)
    original = chained.__dict__.get("clone") if chained is not None else None
    if original is None:
        yield
        return
    memo: dict[tuple[Any, Any], Any] = {}

    def clone(self: Any, transform_fn: Callable[[Any], Any] | None = None) -> Any:
        if transform_fn is None:
            return original(self, transform_fn)
        key = (self, transform_fn)
        done = memo.get(key)
        if done is None:
            done = memo[key] = original(self, transform_fn)
        return done

    with _swapped(chained, "clone", clone):
        yield


@contextlib.contextmanager
def _source_names_only_when_logged() -> Iterator[None]:
    """Within the block, Dynamo's lookup of the function a source line belongs to
    (``torch._dynamo.symbolic_convert.get_funcname``, :func:`warm_source_names`) answers None
    unless one of the trace logs that print it (``trace_call``, ``trace_source``) is on.

    Why: Dynamo names the function of every FX node it creates for a ``trace_call`` debug line,
    formatting the header eagerly even when the log is off, and the first lookup in a file
    tokenizes the whole file: ~0.2-0.3 CPU s of a cold launch's first compile on the startup
    benchmark (10 files, ``transformers/modeling_utils.py`` the largest; loaded machine). The header
    is read by nothing but those logs (lazily), so with them off no output changes; with either
    on, the lookup is Dynamo's own. On a torch without the name nothing is swapped."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    lookup = getattr(convert, "get_funcname", None)
    loggers = [getattr(sys.modules.get(module), name, None) for module, name in (
        ("torch._dynamo.symbolic_convert", "trace_call_log"), ("torch._dynamo.symbolic_convert", "trace_source_log"),
        ("torch._dynamo.output_graph", "trace_call_log"))]
    if lookup is None or not all(isinstance(log, logging.Logger) for log in loggers):
        yield
        return

    def names_when_logged(filename: str, lineno: int) -> str | None:
        if any(log.isEnabledFor(logging.DEBUG) for log in loggers):
            return lookup(filename, lineno)
        return None

    with _swapped(convert, "get_funcname", names_when_logged):
        yield


@contextlib.contextmanager
def trace_settings() -> Iterator[None]:
    """What every Dynamo trace of autotp runs under, the parallelized forward's compiles
    (:class:`_CompileSettings`) and the planner's alike: Dynamo's function names for its trace logs
    looked up only where those logs are on (:func:`_source_names_only_when_logged`) and a
    transformers config's attributes read without inlining its ``__getattribute__``
    (:func:`config_reads_uninlined`). Neither changes a graph or a guard. The planner's first plan
    in a fresh process tokenizes each modeling file it traces for the names: Llama-3-8B's widths,
    median trace CPU of three alternating runs 1.28 -> 0.94 s."""
    with _source_names_only_when_logged(), config_reads_uninlined():
        yield


@contextlib.contextmanager
def config_reads_uninlined() -> Iterator[None]:
    """Within the block, Dynamo reads an attribute of a transformers config
    (``PretrainedConfig.__getattribute__``) as that method would, without inlining the method's
    frame: the name is looked up in the config's ``attribute_map`` (through Dynamo's own dict
    variable, so the trace guards on the table exactly as the inlined method's ``in`` and ``[]``
    do), and the attribute read as ``super().__getattribute__(name)``, which Dynamo traces as
    ``UserDefinedObjectVariable.generic_getattr``: the same variable, source and guards.

    Why: Dynamo inlines a ``__getattribute__`` its class overrides on every attribute read, and
    models read their config often in ``forward``: 174 reads in the two graphs (prefill, decode)
    of a plan of the suite's tiny 2-layer Llama, 258 in Gemma-2's. Measured with ``plan_model``
    at tp=2 in one process, six alternating plans each way, median CPU-s of Dynamo's trace: Llama
    1.58 -> 1.47, Gemma-2 1.99 -> 1.84. Part of :func:`trace_settings`. A config whose class
    overrides ``__getattribute__`` again, or whose ``attribute_map`` is not a plain dict, is left
    to Dynamo, and so is every other object; on a torch or transformers without the names nothing
    is swapped."""
    user_defined = sys.modules.get("torch._dynamo.variables.user_defined")
    variables = sys.modules.get("torch._dynamo.variables")
    configs = sys.modules.get("transformers.configuration_utils")
    cls = getattr(user_defined, "UserDefinedObjectVariable", None)
    constant = getattr(variables, "ConstantVariable", None)
    config_class = getattr(configs, "PretrainedConfig", None)
    getattribute = vars(config_class).get("__getattribute__") if config_class is not None else None
    original = getattr(cls, "var_getattr", None)
    if original is None or constant is None or getattribute is None or not hasattr(cls, "generic_getattr"):
        yield
        return

    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        if name == "attribute_map" or type(self.value).__getattribute__ is not getattribute \
                or not isinstance(inspect.getattr_static(self.value, "attribute_map", None), dict):
            return original(self, tx, name)
        # PretrainedConfig.__getattribute__: the attribute_map's name for ``name``, read generically
        table, key = self.generic_getattr(tx, "attribute_map"), constant.create(name)
        if table.call_method(tx, "__contains__", [key], {}).as_python_constant():
            name = table.call_method(tx, "__getitem__", [key], {}).as_python_constant()
        return self.generic_getattr(tx, name)

    with _swapped(cls, "var_getattr", var_getattr):
        yield


class _WrappedCallback:
    """Dynamo's frame callback with ``wrap`` in front: ``wrap(frame, cache_entry, frame_state,
    inner=callback)``; Dynamo finds its backend through ``_torchdynamo_orig_backend`` as before."""

    def __init__(self, callback: Callable[..., Any], wrap: Callable[..., Any]) -> None:
        self._torchdynamo_orig_backend = callback
        self.wrap = wrap

    def __call__(self, frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        if _skipped_by_dynamo(frame):  # no code compiled, decided alike on every rank: not shared
            return self._torchdynamo_orig_backend(frame, cache_entry, frame_state)
        return self.wrap(frame, cache_entry, frame_state, inner=self._torchdynamo_orig_backend)


def _skipped_by_dynamo(frame: Any) -> bool:
    """A frame Dynamo's callback skips by its trace rules (torch's and the standard library's
    code, ``trace_rules.check``: what the callback checks first). Its twin may not run on the
    other ranks: a finalizer (``torch.utils.weak``'s) runs where a rank's collector frees an
    object, and that differs per rank (rank 0 plans)."""
    return _trace_rules_check()(frame)


@functools.cache
def _trace_rules_check() -> Callable[[Any], bool]:
    """``trace_rules.check`` of a frame, looked up once: torch 2.13's takes the frame too, 2.11's
    (the lent GPU machines' image) reads the code alone."""
    check = require("torch._dynamo.trace_rules", "check")
    if "frame" in inspect.signature(check).parameters:
        return lambda frame: check(frame.f_code, frame=frame)
    return lambda frame: check(frame.f_code)


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Within the block ``owner.name`` is ``value``; what it was is put back after, also on an error."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


#: what :func:`_storable_guards` stores for a guard state Dynamo could not pickle
_UNSTORABLE = b"autotp: unstorable guards: "


@contextlib.contextmanager
def _storable_guards() -> Iterator[None]:
    """Within the block, a guard state Dynamo cannot pickle (a module attribute no pickle holds)
    is stored as a marker naming the error instead of failing the compile: torch 2.13 turns only an
    ``AttributeError`` into its package bypass, and that bypass then fails an assertion. The frame
    compiles and runs as without a package; :meth:`DynamoPackage.entry` refuses to store it, and
    an install of it fails (the marker is no pickle)."""
    guards = require_module("torch._dynamo.guards")
    original = guards.pickle_guards_state
    if getattr(original, "_autotp_storable", False):  # nested: already swapped
        yield
        return

    def pickle_or_mark(state: Any, builder: Any) -> bytes:
        try:
            return original(state, builder)
        except Exception as e:  # noqa: BLE001 - any pickling failure
            return _UNSTORABLE + f"{type(e).__name__}: {e}".encode()

    pickle_or_mark._autotp_storable = True  # type: ignore[attr-defined]
    with _swapped(guards, "pickle_guards_state", pickle_or_mark), _dicts_pickled_as_held(guards.GuardsStatePickler):
        yield


@contextlib.contextmanager
def _dicts_pickled_as_held(pickler: type) -> Iterator[None]:
    """Within the block, ``pickler`` (Dynamo's ``GuardsStatePickler``) pickles a dict subclass whose
    ``__setitem__`` is its own (:func:`_rekeying_dict`) with its keys as it holds them
    (:func:`_dict_as_held`). Pickle's default replays the items through ``__setitem__``, which such
    a class may re-key: transformers' ``_CanRecordRegistry`` (``utils/output_capturing.py``, read by
    the output-capturing wrapper's guards, which check its keys' order) keys an item by
    ``str(key.__class__)``, so unpickled, every key was ``"<class 'str'>"``; the loaded guard state
    then failed to build (``IndexError``), and so did every install of that frame's entry (shared
    frames, ``autotp/shared_frames.py``, and the stored graphs of a later launch). Held as pickled,
    the loaded state is the tracer's own, so its guards are the tracer's: they pass where the
    tracer's would. Through the pickler's ``dispatch_table`` (consulted after its
    ``reducer_override``, which returns ``NotImplemented`` for a plain dict subclass), which falls
    back to :mod:`copyreg`'s as the pickler's default does."""
    had = "dispatch_table" in pickler.__dict__
    original = pickler.__dict__.get("dispatch_table")
    pickler.dispatch_table = _HeldDictReducers()
    try:
        yield
    finally:
        if had:
            pickler.dispatch_table = original
        else:
            del pickler.dispatch_table


class _HeldDictReducers:
    """A pickler's ``dispatch_table``: :func:`_dict_as_held` for a re-keying dict subclass, else
    :data:`copyreg.dispatch_table`'s entry (``KeyError`` where it has none, as the table's protocol wants)."""

    def __getitem__(self, cls: type) -> Callable[[Any], Any]:
        if _rekeying_dict(cls):
            return _dict_as_held
        if _forwarding_object(cls):
            return _object_as_held
        return copyreg.dispatch_table[cls]


def _rekeying_dict(cls: type) -> bool:
    """A dict subclass with its own ``__setitem__`` and pickle's default reduction (which replays
    the items through it); an OrderedDict or defaultdict (their own ``__reduce__``) is not one."""
    return (isinstance(cls, type) and issubclass(cls, dict) and cls is not dict
            and cls.__setitem__ is not dict.__setitem__
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__)


def _dict_as_held(value: dict[Any, Any]) -> tuple[Any, ...]:
    """``value`` reduced to its class, its items as held and its attributes (:func:`_held_dict`)."""
    return _held_dict, (type(value), list(dict.items(value)), getattr(value, "__dict__", None) or None)


def _held_dict(cls: type, items: list[tuple[Any, Any]], attributes: dict[str, Any] | None) -> dict[Any, Any]:
    """A ``cls`` holding ``items`` as given (``dict.update``, not ``cls.__setitem__``) and ``attributes``."""
    value = cls.__new__(cls)
    dict.update(value, items)
    if attributes:
        value.__dict__.update(attributes)
    return value


def _forwarding_object(cls: type) -> bool:
    """A class with its own ``__getattr__`` and pickle's default reduction and state: unpickled, its
    instance is asked for ``__setstate__`` before its attributes are back, and a ``__getattr__`` that
    forwards to one of them (``api._EncoderEntry``'s ``getattr(self._module, name)``: an
    encoder-decoder's ``get_encoder()``, in the guard state of T5's first frame) asks itself again,
    until ``RecursionError``: T5's frames were not shared, nor stored. A module (its own
    ``__setstate__``) or a class with its own reduction is not one."""
    return (isinstance(cls, type) and any("__getattr__" in vars(k) for k in cls.__mro__)
            and not issubclass(cls, (type, dict))
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None)
            and not hasattr(cls, "__setstate__") and not hasattr(cls, "__slots__"))


def _object_as_held(value: Any) -> tuple[Any, ...]:
    """``value`` reduced as pickle's default does (``copyreg.__newobj__`` and its ``__dict__``), its
    attributes put back by :func:`_held_attributes` instead of a ``__setstate__`` looked up on it
    (:func:`_forwarding_object`)."""
    return copyreg.__newobj__, (type(value),), dict(vars(value)), None, None, _held_attributes


def _held_attributes(value: Any, attributes: dict[str, Any]) -> None:
    """``attributes`` set on ``value`` in its ``__dict__``, reading nothing of it first."""
    value.__dict__.update(attributes)


#: the fields of ``torch._dynamo.types.GuardFilterEntry`` :func:`_guard_values_read_lazily` knows
_FILTER_ENTRY_FIELDS = ("name", "has_value", "value", "guard_type", "derived_guard_types", "is_global", "orig_guard")


@functools.cache
def _lazy_filter_entry() -> type | None:
    """A ``GuardFilterEntry`` whose ``value`` / ``has_value`` are read from the guard builder when
    first asked for (as ``make_guard_filter_entry`` reads them: ``builder.get(guard)``, a guard that
    cannot be evaluated has no value); None on a torch whose entry has other fields."""
    entry_type = require("torch._dynamo.types", "GuardFilterEntry")
    if tuple(f.name for f in dataclasses.fields(entry_type)) != _FILTER_ENTRY_FIELDS:
        return None
    missing = object()

    class LazyGuardFilterEntry(entry_type):  # type: ignore[misc, valid-type]
        def __init__(self, builder: Any, **fields: Any) -> None:
            for name, value in fields.items():
                object.__setattr__(self, name, value)  # the entry is frozen
            object.__setattr__(self, "_builder", builder)

        def _read(self) -> tuple[bool, Any]:
            read = self.__dict__.get("_read_value")
            if read is None:
                try:
                    read = (True, self._builder.get(self.orig_guard))
                except Exception:  # noqa: BLE001 - as torch: a guard like ``not hasattr(x, "a")``
                    read = (False, missing)
                object.__setattr__(self, "_read_value", read)
            return read

        @property
        def has_value(self) -> bool:  # type: ignore[override]
            return self._read()[0]

        @property
        def value(self) -> Any:  # type: ignore[override]
            return self._read()[1]

    return LazyGuardFilterEntry


@contextlib.contextmanager
def _guard_values_read_lazily() -> Iterator[None]:
    """Within the block, the entries Dynamo hands a guard filter read each guard's value only when
    the filter asks for it. ``make_guard_filter_entry`` evaluates every guard's source (~2,700
    guards per frame of the benchmark model) though neither the package filter
    (:func:`_serializable_guards`: names, types, globals) nor the guard-state pickling's portability
    check reads a value; a filter that does gets the same value (the builder is alive while
    filters run). Entries made twice per compiled frame on every rank (the filter) and once more on
    the recording one (the pickling). A torch whose entry has other fields keeps its own."""
    guards = require_module("torch._dynamo.guards")
    lazy = _lazy_filter_entry_maker()
    if lazy is None or guards.make_guard_filter_entry is lazy:  # other fields, or nested
        yield
        return
    with _swapped(guards, "make_guard_filter_entry", lazy):
        yield


def recompile_limit() -> int | None:
    """Dynamo's ``config.recompile_limit`` now: how many compiled versions of a frame it keeps
    before running the frame's own code (None on a torch without the setting)."""
    return getattr(require_module("torch._dynamo.config"), "recompile_limit", None)


@contextlib.contextmanager
def _no_uncompiled_runs_past_the_recompile_limit() -> Iterator[None]:
    """Within the block (a compile, :class:`_CompileSettings`), a compile of the forward past Dynamo's recompile limit raises
    an :class:`AutoTPError` instead of running the forward uncompiled.

    Why: past ``torch._dynamo.config.recompile_limit`` (8 by default) compiled versions of a frame,
    Dynamo runs the frame's own Python code (``FrameAction.RUN_ONLY``). autotp's modules hold this
    rank's shards, and only the compiled graphs add the collectives, so that code computes on the
    shards without them: a tiny Llama at tp=2 with the limit at 1 gave logits of the right shape, off
    by up to 0.46, on every call after the first (``tests/distributed/test_recompile_limit.py``).
    ``config.fail_on_recompile_limit_hit`` makes Dynamo raise ``FailOnRecompileLimitHit`` there;
    this turns it into an error naming the cause and the fix. On a torch without the option nothing
    changes."""
    config = require_module("torch._dynamo.config")
    failure = getattr(require_module("torch._dynamo.exc"), "FailOnRecompileLimitHit", None)
    if failure is None or not hasattr(config, "fail_on_recompile_limit_hit"):
        yield
        return
    try:
        with config.patch(fail_on_recompile_limit_hit=True):
            yield
    except failure as error:
        raise AutoTPError(
            f"the model's forward needs more compiled versions than torch._dynamo.config.recompile_limit "
            f"({recompile_limit()}) allows: each call whose arguments Dynamo's guards cannot share "
            f"with an earlier call's (other keyword arguments, dtypes, a specialized size) compiles one, "
            f"and past the limit Dynamo would run the forward uncompiled, on this rank's shards without "
            f"the collectives, which gives wrong results. Raise torch._dynamo.config.recompile_limit "
            f"(TORCH_LOGS=recompiles lists why each version was compiled) or call the model with fewer "
            f"kinds of arguments."
        ) from error


@contextlib.contextmanager
def _side_effects_unreported() -> Iterator[None]:
    """Within the block (a compile, :class:`_CompileSettings`), Dynamo replays a traced frame's side effects without building the report of
    them that nobody reads. With ``torch._dynamo.config.side_effect_replay_policy`` at its default
    ``"info"`` Dynamo captures the user stack of every mutation it records and, when it emits the
    replay code, formats a message per mutated object with the whole stack above Dynamo (each frame's
    ``co_positions``: ~6 ms a message on this machine, 51 messages in a 14-layer Llama's three
    graphs), for the ``side_effects`` log and a ``TORCH_TRACE`` structured trace. Where neither is on,
    the policy is ``"silent"`` for the block: the same replay, no report. A policy the user set, the
    ``side_effects`` log or ``TORCH_TRACE`` keeps Dynamo's behaviour."""
    config = require_module("torch._dynamo.config")
    side_effects = require_module("torch._dynamo.side_effects")
    if (getattr(config, "side_effect_replay_policy", None) != "info" or os.environ.get("TORCH_TRACE")
            or side_effects.side_effects_log.isEnabledFor(logging.DEBUG)):
        yield
        return
    with config.patch(side_effect_replay_policy="silent"):
        yield


@contextlib.contextmanager
def _guards_built_once() -> Iterator[None]:
    """Within the block (a compile, :class:`_CompileSettings`), Dynamo builds a frame's guards once
    where it built them twice, for the package guard filter (:func:`_serializable_guards`).

    Why: with a guard filter, ``CheckFunctionManager.__init__`` builds every guard (the C++ guard
    tree, each source evaluated) only so that the filter's entries carry each guard's derived types
    (the guard functions one guard ran: a ``CONSTANT_MATCH`` on a code object runs ``ID_MATCH``),
    then builds the kept ones again: ~2,700 guards a frame on the benchmark model, the first build
    ~40% of the guards' time. Here that first build returns nothing; the filter sees entries
    without derived types (its values are read lazily, :func:`_guard_values_read_lazily`, and
    never asked for), so it keeps a superset of what it would keep (it drops a guard for its own
    type, for a derived one, or below a dropped one: fewer derived types, fewer drops). The one real
    build then builds that superset, which gives those guards their derived types, and the filter
    runs again over every guard with them: where it drops more (a derived type), the kept list is
    narrowed in place (``__init__`` checks and stores that list) and built again, as torch would.
    The kept guards are torch's: a guard outside the superset was dropped without derived types and
    would be with them; one inside it gets its own derived types, and every guard below a dropped
    one is below one the superset dropped already (a filter that kept more on the second look would
    get torch's two builds). Only where the entries are the lazy ones; elsewhere, or on a torch
    whose calls differ, torch's two builds stand."""
    guards = require_module("torch._dynamo.guards")
    manager = getattr(guards, "CheckFunctionManager", None)
    original = manager.__dict__.get("build_guards") if manager is not None else None
    if original is None or getattr(original, "_autotp_once", False):  # other torch, or nested
        yield
        return

    def build_guards(self: Any, sorted_guards: list[Any], *args: Any, **kwargs: Any) -> Any:
        lazy = _lazy_filter_entry_maker()
        if lazy is None or guards.make_guard_filter_entry is not lazy or len(args) != 4:
            return original(self, sorted_guards, *args, **kwargs)
        if "guard_filter_fn" not in kwargs:  # the build for the filter's entries only
            self._autotp_all_guards = list(sorted_guards)
            return None, None
        every = self.__dict__.pop("_autotp_all_guards", None)
        built = original(self, sorted_guards, *args, **kwargs)
        keep_filter = kwargs["guard_filter_fn"]
        if every is None or keep_filter is None:
            return built
        keep = keep_filter([lazy(guard, built[0]) for guard in every])
        kept = [guard for guard, k in zip(every, keep, strict=True) if k]
        if len(kept) == len(sorted_guards) and all(a is b for a, b in zip(kept, sorted_guards, strict=True)):
            return built
        if not {id(g) for g in kept} <= {id(g) for g in sorted_guards}:  # a filter that is not monotone: torch's way
            first = original(self, every, *args[:3], False)
            keep = keep_filter([lazy(guard, first[0]) for guard in every])
            kept = [guard for guard, k in zip(every, keep, strict=True) if k]
        sorted_guards[:] = kept
        return original(self, sorted_guards, *args, **kwargs)

    build_guards._autotp_once = True  # type: ignore[attr-defined]
    with _swapped(manager, "build_guards", build_guards):
        yield


@functools.cache
def _lazy_filter_entry_maker() -> Callable[[Any, Any], Any] | None:
    """The ``make_guard_filter_entry`` :func:`_guard_values_read_lazily` swaps in, made once per
    process (the block wraps every call of a compiled forward); None where the entry has other fields."""
    guards = require_module("torch._dynamo.guards")
    entry_type = _lazy_filter_entry()
    if entry_type is None:
        return None

    def make_guard_filter_entry(guard: Any, builder: Any) -> Any:
        return entry_type(builder, name=guards.strip_local_scope(guard.name), guard_type=guard.create_fn_name(),
                          derived_guard_types=tuple(guard.guard_types) if guard.guard_types else (),
                          is_global=guards.get_global_source_name(guard.originating_source) is not None,
                          orig_guard=guard)

    return make_guard_filter_entry


@contextlib.contextmanager
def _guard_markings(package_module: Any, markings: dict[str, dict[str, Any]]) -> Iterator[None]:
    """While the block runs, each guard state the package loads gets ``markings`` back on the
    tensors its sources name (see :class:`DynamoPackage`)."""
    original = package_module.load_guards_state

    def load(data: bytes) -> Any:
        # unpickling some sources installs a guard into the current trace (``ImportSource``, e.g.
        # ``torch.utils._pytree.SUPPORTED_NODES`` that a layer region's input flattening guards):
        # a throwaway tracing context takes it; the loaded state carries its guards already
        with torch._guards.tracing(torch._guards.TracingContext(None)):
            state = original(data)
        scope = {"L": state.output_graph.local_scope}
        for source, marks in markings.items():
            try:
                value = eval(source, {"__builtins__": {}}, scope)  # noqa: S307 - a Dynamo source name
            except Exception:  # noqa: BLE001, S112 - a source this state lacks: its guard compares as stored
                continue
            if isinstance(value, torch.Tensor):
                for attr, v in marks.items():
                    setattr(value, attr, v)
        return state

    package_module.load_guards_state = load
    try:
        yield
    finally:
        package_module.load_guards_state = original


@contextlib.contextmanager
def _guard_tensors_in_one_fake_mode() -> Iterator[None]:
    """While the block runs, the tensors of the guard states a package loads are rebuilt in one
    fake mode: torch 2.13's ``GuardsStatePickler._unpickle_tensor`` makes a ``FakeTensorMode`` per
    tensor (~1 ms each, ~145 guarded tensors per frame of a Llama-family model: parameters and
    inputs). The guards read only each tensor's own sizes, strides, dtype, device and dispatch keys,
    which the rebuild (torch's own converter, as the original) keeps; Dynamo's trace has all its
    guarded tensors in one mode too. A torch whose unpickler takes other arguments keeps its own."""
    pickler = require("torch._dynamo.guards", "GuardsStatePickler")
    original = pickler.__dict__.get("_unpickle_tensor")
    expected = ["cls", "meta_tensor", "device", "pytype", "dispatch_keys_raw", "grad"]
    if not isinstance(original, classmethod) or list(inspect.signature(original.__func__).parameters) != expected:
        yield
        return
    fake_mode, converter = FakeTensorMode(), require("torch._subclasses.fake_tensor", "FakeTensorConverter")()

    def unpickle_tensor(cls: type, meta_tensor: torch.Tensor, device: torch.device, pytype: type,
                        dispatch_keys_raw: int, grad: torch.Tensor | None) -> torch.Tensor:
        out = converter.from_meta_and_device(fake_mode, meta_tensor, device, pytype,
                                             torch._C.DispatchKeySet.from_raw_repr(dispatch_keys_raw))
        out.grad = grad
        return out

    pickler._unpickle_tensor = classmethod(unpickle_tensor)
    try:
        yield
    finally:
        pickler._unpickle_tensor = original


# -- Dynamo's subgraph reuse (layer regions, ``autotp/regions.py``) -------------------------
_REGION_SIZES_KEPT = False


def stamped_regions_keep_bound_sizes() -> None:
    """Make Dynamo's stamped-out region calls pass a size the first call bound by the proxy that
    call passed, also after the size was specialized (process-wide, once; see the module docstring).

    torch 2.13's ``invoke_subgraph`` records, for each size a traced region reads from outside, the
    size's sympy expression (``LiftedBoundSymbol(example.node.expr)``), and a later call of the
    region looks that expression up among the graph's bound symbols to find the proxy to pass.
    ``SymNode.expr`` applies the shape environment's replacements: once a guard specialized the
    size (``s52`` -> ``2``: a recompile at batch 2 where transformers compares the batch), the
    recorded expression is the constant ``2``, which is bound to nothing, and every stamp-out fails
    with ``InternalTorchDynamoError: KeyError: 2`` (measured: forwards at batch 1, then a generate at
    batch 2). Where the recorded expression is not bound but the size's own symbol
    (``SymNode._expr``, before replacements) is, the record names that symbol instead: the stamped
    call then passes the same proxy the first call passed, whose value the guard fixed. Records that
    are bound already are left as they are, so no call Dynamo could stamp out before changes.

    And a body whose first trace captured a value Dynamo cannot map to a later call's (its record
    raises ``AssertionError: Freevar has no source``: Falcon's linear layers read
    ``self.weight.T``, which Dynamo lifts as a value computed outside the body) is not kept for
    reuse, instead of failing the compile: each later call traces its body anew, as for a body
    Dynamo does not reuse (one with side effects, or outputs other than tensors). On a torch
    without these names nothing is changed (regions then fail as before: a compile error, never a
    wrong result)."""
    global _REGION_SIZES_KEPT
    if _REGION_SIZES_KEPT:
        return
    _REGION_SIZES_KEPT = True
    try:
        reuse = importlib.import_module("torch._dynamo.variables.invoke_subgraph")
    except ImportError:
        return
    original = getattr(reuse, "build_subgraph_input_mapping", None)
    bound_symbol = getattr(reuse, "LiftedBoundSymbol", None)
    if original is None or bound_symbol is None:
        return

    @functools.wraps(original)
    def build_subgraph_input_mapping(tx: Any, p_args: tuple[Any, ...], flat_vts: list[Any]) -> list[Any]:
        mapping = original(tx, p_args, flat_vts)
        bound = tx.output.current_tracer.bound_symbols
        for i, (record, outer) in enumerate(zip(mapping, p_args[2:], strict=True)):
            if not isinstance(record, bound_symbol) or record.expr in bound:
                continue
            grapharg = outer.node.meta.get("grapharg")
            example = grapharg.example if grapharg is not None else outer.node.meta.get("example_value")
            symbol = getattr(getattr(example, "node", None), "_expr", None)
            if symbol is not None and symbol in bound:
                mapping[i] = bound_symbol(symbol)
        return mapping

    reuse.build_subgraph_input_mapping = build_subgraph_input_mapping

    save = getattr(reuse, "save_reuse_entry", None)
    if save is not None:
        @functools.wraps(save)
        def save_reuse_entry(*args: Any, **kwargs: Any) -> Any:
            try:
                return save(*args, **kwargs)
            except AssertionError as e:  # a body whose captured values Dynamo cannot map: not reused
                if "Freevar has no source" not in str(e):
                    raise
                return None

        reuse.save_reuse_entry = save_reuse_entry


# -- process groups' timeouts (read when present, see the module docstring) ----------------
def group_timeout(group: Any, device_type: str) -> datetime.timedelta | None:
    """How long a collective of ``group`` on ``device_type`` tensors waits before it fails (the
    ``timeout=`` it was made with, or torch's default for its backend); None where this torch
    does not say."""
    try:
        timeout = group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError, TypeError, ValueError):  # no such backend, or a changed API
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


# -- scipy's HiGHS bindings (used when present, see the module docstring) -------------------
def highs_lp(cost: Any, matrix: Any, lower: Any, upper: Any) -> tuple[float | None, str] | None:
    """``min cost @ x`` over ``lower <= matrix @ x <= upper``, ``0 <= x <= 1`` (``matrix`` a scipy
    CSR array without duplicate entries, the rest float arrays) by HiGHS's dual simplex without presolve (on the certificate's
    programs presolve costs more than it saves): the optimum (None where HiGHS proves none) and
    HiGHS's status; None where this scipy lacks the bindings."""
    import numpy as np

    try:
        core = importlib.import_module("scipy.optimize._highspy._core")
        n, m = matrix.shape[1], matrix.shape[0]
        lp = core.HighsLp()
        lp.num_col_, lp.num_row_ = n, m
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, m
        lp.a_matrix_.format_ = core.MatrixFormat.kRowwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = matrix.indptr, matrix.indices, matrix.data
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(n), np.ones(n)
        lp.row_lower_, lp.row_upper_ = lower, upper
        highs = core._Highs()
        options = core.HighsOptions()
        options.output_flag, options.presolve = False, "off"
        highs.passOptions(options)
        highs.passModel(lp)
        highs.run()
        status = highs.getModelStatus()
        optimal = status == core.HighsModelStatus.kOptimal
        return (highs.getInfo().objective_function_value if optimal else None), highs.modelStatusToString(status)
    except (ImportError, AttributeError, TypeError):  # no such bindings, or changed ones
        return None


# -- one rank traces, the others install its frames (``autotp/shared_frames.py``) -----------------


class FrameShare(Protocol):
    """How a compiled forward's frames travel within a launch (``autotp/shared_frames.py``):
    the tracing rank publishes one message per call of Dynamo's frame callback, naming the frame
    (:func:`_code_name`) and carrying a :class:`FrameEntry` (the others install it), a
    :class:`FrameSkip` (Dynamo compiled no code: the others do what it said) or None (the frame
    is not shared: from here on every rank traces its own). While :attr:`active`, the others
    receive it in the same call of theirs; after a None, or a follower's failed install, nothing
    is exchanged any more."""

    tracer: bool
    #: frames are still exchanged (False for good once one was not shared)
    active: bool

    def begin(self, name: tuple[str, str, int]) -> None:
        """Tracer: a frame callback for the frame ``name`` starts; one publication is owed."""

    def prepare(self, entry: FrameEntry) -> tuple[FrameEntry, dict[str, Callable[..., Any]],
                                                  dict[str, dict[str, Any]]]:
        """Tracer: what :meth:`receive` will give the followers for ``entry`` (its graphs, the
        markings), for the tracer to install it too; a :class:`PackageError` where the entry
        cannot be sent."""

    def not_shared(self, why: str) -> None:
        """Tracer: why the frame of this callback is not shared (it publishes None)."""

    def publish(self, item: FrameEntry | FrameSkip | None) -> None:
        """Tracer: publish what is owed (a :class:`FrameEntry` that was prepared); a no-op where
        this callback already published. After a :class:`FrameEntry`, waits for the others to say
        whether it installed."""

    def receive(self, name: tuple[str, str, int]) -> tuple[FrameEntry, dict[str, Callable[..., Any]],
                                                           dict[str, dict[str, Any]]] | FrameSkip | None:
        """Follower, in the frame callback for ``name``: the tracer's frame with the callables its
        graph names call and the inputs' dim markings, its :class:`FrameSkip`, or None (compile the
        frame here); raises an AutoTPError where the tracer published another frame."""

    def installed(self, error: Exception | None) -> None:
        """Follower: whether the received :class:`FrameEntry` installed (``error`` None) or not; the
        group agrees, and where one rank's did not, sharing stops on every rank."""


@dataclasses.dataclass
class FrameEntry:
    """One compiled frame as another process of the launch installs it: the tracing rank's whole
    package :meth:`DynamoPackage.entry` (its module aliases renamed, ``aliases``) and which of its
    codes the frame runs (``index``; its newest guarded code is the frame's). ``name``: the code's
    name, file and first line."""

    name: tuple[str, str, int]
    entry: Any
    aliases: dict[str, tuple[str, str]]
    index: int

    def backend_ids(self) -> list[str]:
        """The compiled-function names the frame's code calls."""
        return list(self.entry.codes[self.index].backend_ids)


@dataclasses.dataclass(frozen=True)
class FrameSkip:
    """What Dynamo's frame callback returned for a frame it compiled no code for (a frame of no
    tensor work, one it gave up on, the recompile limit reached): how the eval-frame hook runs this
    frame and, with ``apply_to_code``, later ones of its code (``FrameExecStrategy``'s two actions,
    by value). A follower returns the same, without tracing the frame to find out."""

    cur_action: int
    recursive_action: int
    apply_to_code: bool
    skip_reason: str | None

    @classmethod
    def of(cls, result: Any) -> FrameSkip:
        strategy = result.frame_exec_strategy
        return cls(int(strategy.cur_action.value), int(strategy.recursive_action.value),
                   bool(result.apply_to_code), result.skip_reason)

    def result(self) -> Any:
        """The ``ConvertFrameReturn`` the tracer's callback returned."""
        dynamo_types = require_module("torch._dynamo.types")
        action = dynamo_types.FrameAction
        strategy = dynamo_types.FrameExecStrategy(action(self.cur_action), action(self.recursive_action))
        return dynamo_types.ConvertFrameReturn(frame_exec_strategy=strategy, apply_to_code=self.apply_to_code,
                                               skip_reason=self.skip_reason)


def code_state_changes(sent: dict[Any, Any]) -> dict[Any, Any]:
    """The entries of this process's Dynamo code state (``torch._dynamo.pgo``: per code, the input
    sizes seen, from which a recompile marks dims dynamic) that differ from ``sent``, which is
    updated with copies of them. Shipped with each shared frame: a follower that installs frames
    updates no code state of its own, so a frame it later compiles itself would be traced static
    where the tracer's recompile went dynamic (another graph, another plan)."""
    state = require("torch._dynamo.pgo", "get_code_state")()
    changed = {key: value for key, value in state.items() if sent.get(key) != value}
    sent.update(copy.deepcopy(changed))
    return changed


def apply_code_state(changes: dict[Any, Any]) -> None:
    """Make this process's Dynamo code state hold the tracer's ``changes`` (:func:`code_state_changes`)."""
    if changes:
        require("torch._dynamo.pgo", "get_code_state")().update(changes)


def _code_name(code: types.CodeType) -> tuple[str, str, int]:
    return code.co_name, code.co_filename, code.co_firstlineno


def _publishing_callback(frame: Any, cache_entry: Any, frame_state: Any, *, inner: Callable[..., Any],
                         share: FrameShare, entry_of: Callable[..., FrameEntry | None]) -> Any:
    """The tracing rank's frame callback: Dynamo's (``inner``), then what it made of the frame
    published: its entry, a :class:`FrameSkip` where it compiled no code, None where Dynamo raised
    or the entry cannot be shared (``share.not_shared`` says why). The backend must not run a
    collective before this publication (the others wait in it): it lowers on the graph's first
    call, or publishes None first (``FrameShare.publish``)."""
    if not share.active:
        return inner(frame, cache_entry, frame_state)
    share.begin(_code_name(frame.f_code))
    item: FrameEntry | FrameSkip | None = None
    try:
        try:
            result = inner(frame, cache_entry, frame_state)
        except BaseException as e:
            share.not_shared(f"Dynamo raised {type(e).__name__}: {e}")
            raise
        if getattr(result, "guarded_code", None) is not None:
            try:  # run the frame as the followers will: its guards loaded from the same state
                item = entry_of(frame.f_code, frame.f_globals)
                if item is None:
                    raise PackageError("no entry for it")
                installed = _install_frame(frame, *share.prepare(item))
                _move_cleanup(result.guarded_code.code, installed.guarded_code.code)
                result = installed
            except Exception as e:  # noqa: BLE001 - any failure: no rank installs it
                share.not_shared(f"{type(e).__name__}: {e}")
                item = None
        elif result is not None:
            item = FrameSkip.of(result)
        return result
    finally:
        share.publish(item)


def _move_cleanup(compiled: types.CodeType, installed: types.CodeType) -> None:
    """Dynamo takes the globals a compile installed (compiled functions, resume functions) out of
    the module when the code it made is collected (``utils.CleanupManager``); the tracer runs the
    installed ``installed`` instead of ``compiled``, so the globals go with ``installed``."""
    manager = require("torch._dynamo.utils", "CleanupManager").instance
    hooks = manager.get(compiled)
    if hooks is not None:
        manager[compiled] = []
        manager[installed] = hooks


def _receiving_callback(frame: Any, cache_entry: Any, frame_state: Any, *, inner: Callable[..., Any],
                        share: FrameShare) -> Any:
    """A following rank's frame callback: the tracer's entry for this frame installed as the
    frame's compiled code (:func:`_install_frame`), or its :class:`FrameSkip` returned; where it
    published none, or the entry does not install, Dynamo's own (``inner``) compiles the frame
    here (and every rank traces its own from then on)."""
    if not share.active:
        return inner(frame, cache_entry, frame_state)
    received = share.receive(_code_name(frame.f_code))
    if isinstance(received, FrameSkip):
        return received.result()
    if received is not None:
        try:
            result = _install_frame(frame, *received)
        except Exception as e:  # noqa: BLE001 - any failure: this rank compiles the frame itself
            share.installed(e)
        else:
            share.installed(None)
            return result
    return inner(frame, cache_entry, frame_state)


def _install_frame(frame: Any, entry: FrameEntry, backends: dict[str, Callable[..., Any]],
                   markings: dict[str, dict[str, Any]]) -> Any:
    """What Dynamo's callback returns for ``frame`` (a ``ConvertFrameReturn`` with its guarded
    code): the globals the tracer's code reads (module aliases, resume functions, the compiled
    functions: ``backends``) put in the frame's globals and its module's (as
    ``CompilePackage.install``, and as :class:`DynamoPackage` copies them for a wrapper), its guard
    state loaded with ``markings`` into a guard manager on this frame's code (the caller checked
    that ``entry`` is for it)."""
    package_module = require_module("torch._dynamo.package")
    dynamo_types = require_module("torch._dynamo.types")
    code_entry = entry.entry.codes[entry.index]
    if code_entry.bypassed or not code_entry.guarded_codes:
        raise PackageError(f"the tracing rank's package holds no code for {entry.name}")
    guarded = code_entry.guarded_codes[-1]
    scopes = [frame.f_globals]
    module = sys.modules.get(code_entry.python_module)
    if module is not None and module.__dict__ is not frame.f_globals:
        scopes.append(module.__dict__)

    def put(name: str, value: Any) -> None:
        for scope in scopes:
            scope[name] = value
        _reserve_unique_id(name)

    for name, (kind, value) in entry.aliases.items():
        put(name, importlib.import_module(value) if kind == "module" else value)
    for alias, module_name in code_entry.import_sources.items():
        put(alias, importlib.import_module(module_name))
    for code in entry.entry.codes:
        if not code.install_to_global:
            continue
        home = sys.modules[code.python_module].__dict__
        for function_name in code.function_names:
            if function_name not in frame.f_globals:
                put(function_name, _resume_function(package_module, code, home, function_name))
            elif _function_code(frame.f_globals[function_name]) not in (
                    None, package_module.SerializedCode.to_code_object(code.python_code)):
                # a resume function this rank compiled itself (in an earlier model) has the name
                raise PackageError(f"{function_name} is another function here")
    for backend_id in code_entry.backend_ids:
        if backend_id not in frame.f_globals:
            put(backend_id, torch._dynamo.disable(backends[backend_id]))
    with _guard_markings(package_module, markings), _guard_tensors_in_one_fake_mode():
        state = package_module.load_guards_state(guarded.guards_state)
    builtins_name = state.output_graph.name_of_builtins_dict_key_in_fglobals
    if builtins_name and builtins_name not in frame.f_globals:
        put(builtins_name, require("torch._dynamo.output_graph", "get_builtins_dict")(frame.f_globals))
    manager = package_module.load_guard_manager(state, frame.f_code, frame.f_globals)
    code = package_module.SerializedCode.to_code_object(guarded.dynamo_code)
    # printed where a later compile of the frame explains its recompile (both ids must be set): the
    # tracer's ids are not sent, so every installed frame reads as the tracer's frame 0
    compile_id = torch._guards.CompileId(frame_id=0, frame_compile_id=0)
    # what Dynamo records of a code it made, read when a later compile of the frame explains it
    require("torch._dynamo.utils", "orig_code_map")[code] = frame.f_code
    require("torch._dynamo.convert_frame", "output_codes").add(code)
    return dynamo_types.wrap_guarded_code(dynamo_types.GuardedCode(code, manager, compile_id))


def _reserve_unique_id(name: str) -> None:
    """Keep this process's Dynamo from making ``name`` again: the builtins dict and resume functions
    it installs as globals are numbered by one process-wide counter
    (``bytecode_transformation._unique_id_counter``), and a frame this rank compiles itself after
    installing the tracer's would make the tracer's names again (``AssertionError: Name
    '__builtins_dict___0' already exists in scope``, or a resume function replaced)."""
    match = re.fullmatch(r"__builtins_dict___(\d+)|__resume_at_\d+_(\d+)", name)
    if match is None:
        return
    transformation = require_module("torch._dynamo.bytecode_transformation")
    taken = int(match.group(1) or match.group(2))
    following = next(transformation._unique_id_counter)
    transformation._unique_id_counter = itertools.count(max(following, taken + 1))


def _function_code(value: Any) -> types.CodeType | None:
    """The code of a resume function as :func:`_resume_function` or Dynamo installs it: a function,
    or for one with free variables a factory of it: :func:`_resume_function`'s
    ``functools.partial`` of ``types.FunctionType``, or Dynamo's closure
    (``OutputGraph.install_resume_function_global``'s ``_make_fn``, whose cell ``code`` holds the
    resume function's code: read as the factory's own code, the tracer's resume function was
    "another function" than its own entry's, and sharing stopped at the first resume function with
    free variables); None for anything else."""
    if isinstance(value, functools.partial) and value.func is types.FunctionType:
        return value.args[0]
    code = getattr(value, "__code__", None)
    closure = getattr(value, "__closure__", None)
    if isinstance(code, types.CodeType) and code.co_name == "_make_fn" and closure is not None \
            and "code" in code.co_freevars:
        made = closure[code.co_freevars.index("code")].cell_contents
        if isinstance(made, types.CodeType):
            return made
    return code


def _resume_function(package_module: Any, code: Any, home: dict[str, Any], name: str) -> Any:
    """A resume function as ``CompilePackage.install`` makes it: the function, or for one with
    free variables the factory Dynamo's code calls with its closure. The factory runs no Python
    frame of its own: the eval-frame hook would call the frame callback on it (autotp's code is no
    code Dynamo skips) on the rank that installed it only, whose next frame would then take the
    tracer's next publication as its own and wait in a broadcast the tracer never sends (the hang
    of a gradient-checkpointed Llama, whose resume functions after the checkpointing warning's
    graph break have free variables)."""
    python_code = package_module.SerializedCode.to_code_object(code.python_code)
    if python_code.co_freevars:  # a partial, not a Python function: see the docstring
        return functools.partial(types.FunctionType, python_code, home, name, None)
    return types.FunctionType(python_code, home, name)
