"""``parallelize_model``: a Hub id or a folder in, a tensor-parallel transformers model out.

Steps: join (or start) the process group -> resolve the files (config, safetensors, index) ->
check the config divides by ``tp_size`` (before any weight is read) -> build the architecture on
the meta device -> give every parameter a ``ParameterMeta`` and a zero-memory global-shaped
stand-in -> compile ``forward`` with the autotp backend -> one warm-up call solves the plan and
loads only this rank's slices.

Sharded parameters across graphs: outside ``forward`` the module holds this rank's local shards
(so ``model.parameters()``, optimizers and ``state_dict`` see real local tensors); for the duration
of a call the stand-ins are swapped in, so Dynamo always traces and guards the logical,
global-shaped model, and every compiled graph binds the same local shard objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotp.backend import check_override_styles, check_overrides, make_backend, plan_options
from autotp.checkpoint_match import match_parameters
from autotp.collectives import Comm, attach_health, ensure_process_group, peer_failures, redistribute
from autotp.compat import BackendCompilerFailed, DynamoCompiled, maybe_mark_dynamic, no_guard_latency_profile
from autotp.config import AutoTPConfig, parse_dtype, switch
from autotp.context import TPContext, attach_meta, meta_of, shard_of, standin
from autotp.errors import AutoTPError
from autotp.hf_config import read_config
from autotp.host import local_ranks, usable_cores
from autotp.inputs import InputGuard, TokenIdCheck
from autotp.memory import release_free_memory
from autotp.mesh import MeshLayout, check_data_parallel, check_layout, check_tp_size
from autotp.placement import R, head_split
from autotp.prefill_call import PrefillCall
from autotp.progress import load_progress
from autotp.regions import MIN_LAYERS as REGION_MIN_LAYERS
from autotp.regions import install_layer_regions
from autotp.shared_frames import FrameChannel, trace_once_agreed, trace_once_default
from autotp.stored_graphs import GraphStore, StoredForward, StoredGraph, graph_key, storing_backend
from autotp.teardown import freeze_at_exit
from autotp.weights import (
    Checkpoint,
    ParameterMeta,
    build_meta_model,
    resolve_checkpoint,
)

HEADS_FIELD = "num_attention_heads"
DIVISIBLE_FIELDS = (
    ("hidden_size", "the hidden dimension of row-parallel weights is split across ranks"),
    ("intermediate_size", "the MLP's intermediate dimension is split across ranks"),
)
#: key/value heads: split across ranks when tp divides them, else each rank holds the one its query
#: heads use (``GroupedShard``, autotp/ops/kv_heads.py), which needs their count to divide tp
KV_HEADS_FIELD = "num_key_value_heads"


@dataclass
class AutoTPHandle:
    """What ``parallelize_model`` attaches to the model as ``model.autotp``."""

    context: TPContext
    folder: Path | None
    #: the device mesh (dims "dp", "tp") and data-parallel engine, when ``mesh=`` was given
    layout: MeshLayout | None = None
    #: the data-parallel side (:class:`autotp.data_parallel.DataParallel`), with ``data_parallel=``
    data_parallel: Any = None
    #: the compiled ``forward`` entry, which owns the model boundary (what is gathered on return)
    entry: _SwappingForward | None = None

    @property
    def logits_with_loss(self) -> bool:
        """Whether a call that returns a loss also gathers and returns the full logits (settable,
        e.g. for an evaluation step; see :func:`gather_user_values`)."""
        return self.entry is not None and self.entry.logits_with_loss

    @logits_with_loss.setter
    def logits_with_loss(self, value: bool) -> None:
        if self.entry is None:
            raise AutoTPError("this model has no compiled forward entry whose logits could be gathered")
        self.entry.logits_with_loss = bool(value)

    @property
    def plans(self) -> list[dict]:
        """The per-parameter plan of every graph compiled for the model (the session's)."""
        return self.context.plans

    @property
    def plan(self) -> dict | None:
        """The plan of the first compiled graph (parameters are pinned by it)."""
        return self.plans[0] if self.plans else None

    @property
    def rank(self) -> int:
        return self.context.rank

    def close(self) -> None:
        """Release what this model's session installed in the process (``TPContext.close``)."""
        self.context.close()

    @property
    def world_size(self) -> int:
        return self.context.world_size


#: the inner compiler ``parallelize_model`` uses when none is given, by device type: the faster
#: one measured with ``benchmarks/generation.py`` (see docs/architecture.md, "Inner compiler")
DEFAULT_COMPILE_INNER = {"cpu": "eager", "cuda": "eager"}


def default_compile_inner(device: torch.device) -> str:
    """The default inner compiler for ``device`` (:data:`DEFAULT_COMPILE_INNER`)."""
    return DEFAULT_COMPILE_INNER.get(device.type, "eager")


def threads_per_rank(device: torch.device, environ: Mapping[str, str], world_size: int, cores: int) -> int | None:
    """CPU threads for this rank, or None to leave torch's setting alone.

    Ranks on one machine share its cores: ``cores // local ranks`` each (``host.local_ranks``),
    at least 1; torch's default (every core per
    process) would oversubscribe each core N times. The user's ``OMP_NUM_THREADS`` wins, and a
    CUDA rank is left alone. ``parallelize_model`` calls this with ``os.environ`` (its entry point
    is the only place the library reads the environment for it)."""
    if device.type != "cpu" or "OMP_NUM_THREADS" in environ:
        return None
    return max(cores // local_ranks(environ, world_size), 1)


def _kv_heads_fit(kv_heads: int, tp: int) -> bool:
    """kv heads split across ``tp`` ranks (``tp`` divides them) or held per group of ranks (they divide ``tp``)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def _heads_fit(heads: int, kv_heads: int | None, tp: int) -> bool:
    """Query heads split evenly, or in whole heads (``autotp/ops/heads.py``): at least one per rank,
    following the kv heads (each of ``kv_heads`` groups of ranks shares its kv head's query heads;
    multi-head attention is one group)."""
    if heads % tp == 0:
        return True
    kv = heads if kv_heads is None else kv_heads
    groups = 1 if kv == heads else kv if kv < tp and tp % kv == 0 else None
    return groups is not None and head_split(0, heads, groups, tp) is not None


def check_divisible(config: Any, tp_size: int) -> None:
    """Refuse, before any weight is read, a tp size the plan cannot split the config's dims by:
    hidden and intermediate sizes must divide by it; kv heads must divide by it or divide it
    (past their count each rank holds the kv head its query heads use); query heads must divide
    by it or split in whole heads, unevenly, at least one per rank and following the kv heads
    (:func:`_heads_fit`: Qwen2.5-7B's 28 heads over 4 kv heads at tp=8 are 4 + 3 per kv head)."""
    problems, sizes = [], []
    for name, why in DIVISIBLE_FIELDS:
        value = getattr(config, name, None)
        if not isinstance(value, int) or value <= 0:
            continue
        sizes.append(value)
        if value % tp_size:
            problems.append(f"{name}={value} ({why})")
    heads = getattr(config, HEADS_FIELD, None)
    heads = heads if isinstance(heads, int) and heads > 0 else None
    kv = getattr(config, KV_HEADS_FIELD, None)
    kv = kv if isinstance(kv, int) and kv > 0 and kv != heads else None  # multi-head: split with q
    if kv is not None and not _kv_heads_fit(kv, tp_size):
        problems.append(f"{KV_HEADS_FIELD}={kv} (key/value heads are split across ranks when tp divides "
                        "them, or held one per group of ranks when they divide tp)")
    if heads is not None and not _heads_fit(heads, kv, tp_size):
        problems.append(f"{HEADS_FIELD}={heads} (attention heads are split across ranks in whole heads: evenly "
                        "where tp divides them, else unevenly with at least one head per rank and each kv "
                        "head's query heads on the ranks holding that kv head)")
    if problems:
        limit = min(sizes + ([heads] if heads else [])) if sizes or heads else 64
        valid = [d for d in range(1, min(limit, 64) + 1) if all(s % d == 0 for s in sizes)
                 and (kv is None or _kv_heads_fit(kv, d)) and (heads is None or _heads_fit(heads, kv, d))]
        raise AutoTPError(
            f"tp_size={tp_size} does not divide {', '.join(problems)}. "
            f"Valid tp sizes for this model: {valid}."
        )


class _SwappingForward:
    """``model.forward`` replacement: stand-ins in for the compiled call, local shards out."""

    def __init__(self, compiled: Callable[..., Any], slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]],
                 comm: Comm, guard: InputGuard | None = None, logits_with_loss: bool = True,
                 model: torch.nn.Module | None = None):
        self.compiled = compiled
        self.slots = slots
        self.comm = comm
        self.guard = guard  # token ids and the KV cache, checked before anything runs (autotp/inputs.py)
        self.logits_with_loss = logits_with_loss  # see gather_user_values
        #: while set (the warm-up, :func:`_warm_up`), the token dim of every call's ids is marked
        #: dynamic, so the graph compiled then serves every length
        self.dynamic_tokens = False
        #: the model's config (it holds the defaults a plain call leaves out) and its forward's
        #: signature (positional ids are bound to their names); not the model (no reference cycle)
        self.config = getattr(model, "config", None)
        self.signature = _signature_or_none(model.forward) if model is not None else None
        #: while set (a generate warm-up), the next call's keywords are recorded as :attr:`prefill`
        self.record_prefill = False
        #: the warm-up's prefill keywords: a plain call is completed into them and reuses its graph
        #: (:mod:`autotp.prefill_call`)
        self.prefill: PrefillCall | None = None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # Dynamo's stored guard state (autotp/stored_graphs.py) pickles the module's callable
        # attributes; this one holds the process group, which no guard reads and no pickle holds
        return _no_forward, ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.record_prefill:
            self.record_prefill = False
            self.prefill = PrefillCall.record(args, kwargs)
        elif self.prefill is not None:
            args, kwargs = self.prefill.complete(self.signature, args, kwargs, self.config)
        if self.guard is not None:
            # every rank checks its own inputs (alike under SPMD) and refuses alone: recording the
            # refusal as a rank failure would make the peers' next, valid call fail too
            self.guard.before(args, kwargs)
            result = self._run(args, kwargs)
            self.guard.after(args, kwargs, result)
            return result
        return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.dynamic_tokens:
            for key in TOKEN_INPUTS:
                ids = kwargs.get(key)
                if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                    maybe_mark_dynamic(ids, 1)  # (batch, tokens)
        for module, name, stand in self.slots:
            module._parameters[name] = stand
        if self.comm.health is not None:
            self.comm.health.step += 1  # published by the heartbeat thread
        try:
            with peer_failures(self.comm, "the model was running"), _failures_recorded(self.comm.health), \
                    no_guard_latency_profile():
                return gather_user_values(self.compiled(*args, **kwargs), self.comm,
                                          logits_with_loss=self.logits_with_loss)
        except BackendCompilerFailed as e:  # Dynamo wraps what the backend raised
            if isinstance(e.inner_exception, AutoTPError):  # the user's error, with its own cause
                raise e.inner_exception from e.inner_exception.__cause__
            raise
        finally:
            self.swap_out()

    def swap_out(self) -> None:
        for module, name, stand in self.slots:
            local = meta_of(stand).local
            module._parameters[name] = local if local is not None else stand


def _no_forward() -> None:
    return None


def _signature_or_none(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class _EncoderEntry:
    """What ``get_encoder()`` returns under ``parallelize_model``: the encoder module (attributes
    read through) whose call runs its own compiled graph with the stand-ins swapped in, as
    ``model.forward`` does. transformers' ``generate`` runs an encoder-decoder's encoder this way,
    outside ``forward``; eagerly it would see local shards as if they were whole. Inside a graph
    being traced (a ``forward`` that calls ``get_encoder()`` itself) the plain module is called, so
    Dynamo traces the encoder into that graph."""

    def __init__(self, encoder: torch.nn.Module, forward: _SwappingForward) -> None:
        self.__dict__.update(_module=encoder, forward=forward)
        forward.__signature__ = inspect.signature(encoder.forward)  # generate filters kwargs by it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._module(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _compile_encoder(module: torch.nn.Module, slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]],
                     ctx: TPContext) -> None:
    """An encoder-decoder's encoder (``get_encoder()``) gets its own compiled forward with the same
    backend and context (its parameters are pinned by whichever graph touches them first)."""
    original = getattr(module, "get_encoder", None)
    if not getattr(module.config, "is_encoder_decoder", False) or original is None:
        return
    encoder = original()
    if encoder is module or not isinstance(encoder, torch.nn.Module):
        return
    compiled = DynamoCompiled(type(encoder).forward.__get__(encoder), make_backend(ctx))
    guard = InputGuard(TokenIdCheck.for_model(module, encoder.forward))
    entry = _EncoderEntry(encoder, _SwappingForward(compiled, slots, ctx.comm, guard))

    def get_encoder(modality: str | None = None) -> Any:
        return entry if modality is None else original(modality=modality)

    module.get_encoder = get_encoder


def gather_user_values(value: Any, comm: Comm, *, logits_with_loss: bool = True) -> Any:
    """The model boundary: every sharded value the user can read (logits, hidden states, in
    dicts, tuples and lists) is gathered to its full tensor; values held by other objects — the
    KV cache — stay sharded, so each rank keeps only its heads between decoding steps.

    With ``logits_with_loss=False``, an output that carries a loss (a ``ModelOutput`` whose
    ``loss`` is set: the model was given labels) gets ``logits=None`` instead of its logits, which
    are then never gathered: in training the ``[batch, seq, vocab]`` logits are the largest
    activation, the vocab-parallel loss needs only their shards, and gathering them for nobody
    costs an all-gather and a full copy per rank. ``None``, not the local shard or the sharded
    stand-in, so that a read is never a silently partial tensor; the field stays in place, so
    ``out[1]`` still names the logits' slot. The gather is decided here, when the call returns,
    and not lazily when ``out.logits`` is read: a gather is a collective every rank must enter,
    and user code that reads the logits on one rank only (logging) would hang the others.
    Tuple outputs (``return_dict=False``) are gathered in full (their fields have no names)."""
    if not logits_with_loss and _carries_loss(value):
        value["logits"] = None  # ModelOutput item assignment keeps the attribute in sync
    shard = shard_of(value)
    if shard is not None:
        local, placement = shard
        return redistribute(local, placement, R, comm, size=value.shape[placement.dim])
    if isinstance(value, dict):  # ModelOutput too: item assignment keeps its attributes in sync
        for key in list(value.keys()):
            value[key] = gather_user_values(value[key], comm)
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(gather_user_values(v, comm) for v in value)
    return value


def _carries_loss(value: Any) -> bool:
    return isinstance(value, dict) and value.get("loss") is not None and "logits" in value


def _resolve_module(model: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    owner, _, name = fqn.rpartition(".")
    return (model.get_submodule(owner) if owner else model), name


def parallelize_model(
    model: str | os.PathLike,
    *,
    tp_size: int | None = None,
    dtype: str | torch.dtype | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    trace_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    warmup: bool = True,
    trust_remote_code: bool = False,
    timeout: float | datetime.timedelta | None = None,
    progress: bool | None = None,
    verify: bool = False,
    sequence_parallel: bool = False,
    fuse: bool = True,
    trace_once: bool | None = None,
    layer_regions: bool | None = None,
    compile_inner: str | None = None,
    shared_memory: bool = True,
    mesh: Any = None,
    data_parallel: str | None = None,
    logits_with_loss: bool = False,
    **overrides: Any,
) -> torch.nn.Module:
    """Load ``model`` (Hub id or local folder) tensor-parallel over the current process group.

    Run it on every rank (e.g. under ``torchrun --nproc-per-node N``); without a launcher it runs
    as a single process. Returns the transformers model: ``model(...)`` gives full outputs on every
    rank (a call with labels: the loss, and logits None unless ``logits_with_loss``), ``model.generate(...)`` works, ``model.parameters()`` yields this rank's shards, and
    ``model.autotp.plan`` is the plan.

    Sources: a local folder (never written into) or a Hub id (``revision``, ``cache_dir``,
    ``token``, ``local_files_only`` as in huggingface_hub; one process per machine downloads while
    the others wait on a lock in the cache), with safetensors (single or sharded) or PyTorch
    ``.bin`` weights. ``dtype`` converts each slice as it is read. ``trust_remote_code`` is needed
    for a config whose architecture exists only as code in the checkpoint (``auto_map``).
    ``timeout`` (seconds) bounds every collective when autotp starts the process group itself (a
    rank that dies or hangs then makes the others fail with an error instead of waiting forever;
    the error, a :class:`~autotp.health.RankFailure`, names that rank and its last phase).
    ``progress`` shows the load's phases on rank 0 (:mod:`autotp.progress`: planning, a shard-read
    bar, the time of each phase; and huggingface_hub's download bars); default: on unless the
    ``CI`` environment variable is set. On CPU each rank uses
    ``cores / local ranks`` threads unless ``OMP_NUM_THREADS`` is set. ``verify=True`` checks the
    first call of every graph against a replicated run and raises at the first diverging node.
    ``sequence_parallel=True`` keeps the activations between tensor-parallel regions (residual
    stream, norms, dropout) sharded on the sequence: reduce-scatter + all-gather replace each
    all-reduce, same bytes, 1/N of those activations per rank (for training and long prefills);
    as in Megatron, every sequence length must then divide by the number of ranks (pad the batch).
    ``compile_inner`` runs each rank's rewritten graph with ``"eager"`` (FX code) or ``"inductor"``
    (``autotp/inner.py``); None picks the default for the device (:func:`default_compile_inner`).
    ``fuse=False`` keeps sibling matmuls (q/k/v, gate/up) as separate GEMMs (``autotp/passes/fuse.py``).
    ``trace_once``: one rank traces the model's frames and the others install them
    (``autotp/shared_frames.py``, with the cache on); None (default): as
    ``AUTOTP_TRACE_ONCE=1/0`` says, else off (not on by default yet, see that module).
    ``layer_regions``: Dynamo traces a repeated decoder layer once per graph and reuses it for the
    others (``autotp/regions.py``); None (default): as ``AUTOTP_LAYER_REGIONS=1/0`` says, else on
    for a stack of at least ``regions.MIN_LAYERS`` (4) layers.
    ``shared_memory`` (CPU ranks on one x86-64 host): all-reduces and small all-gathers (up to
    256 KB per rank, e.g. a decode step's logits) go through a shared-memory segment instead of
    gloo's TCP loopback (:class:`~autotp.collectives.SharedMemoryCollectives`); ``False`` keeps
    gloo for all.
    ``mesh``: a ``DeviceMesh`` with dims named ``("dp", "tp")`` (``init_device_mesh(device, (dp,
    tp), mesh_dim_names=("dp", "tp"))``): tensor parallelism runs on ``mesh["tp"]``, and
    ``data_parallel="fsdp"`` (FSDP2's ``fully_shard``) or ``"ddp"`` (``DistributedDataParallel``)
    averages gradients over ``mesh["dp"]`` (:mod:`autotp.data_parallel`); with ``data_parallel=None``
    each dp replica is an independent tensor-parallel copy (serving; its gradients are its own).
    Without a mesh the whole world is the tp group.
    ``logits_with_loss``: a call given labels returns the loss with ``logits=None`` (the
    ``[batch, seq, vocab]`` logits stay vocabulary-sharded inside the loss and are never gathered,
    see :func:`gather_user_values`); ``True`` gathers and returns the full logits too
    (``model.autotp.logits_with_loss`` changes it later, on every rank alike).
    """
    data_parallel = check_data_parallel(data_parallel)
    if data_parallel is not None and not warmup:
        raise AutoTPError(f"data_parallel={data_parallel!r} needs warmup=True: the data-parallel engine "
                          "takes the local shards the warm-up loads")
    if data_parallel == "fsdp":
        fuse = False  # FSDP2 owns the parameter storage; a fused buffer would be a second copy
    dtype = parse_dtype(dtype)
    trace_dir = trace_dir or os.environ.get("AUTOTP_TRACE_DIR") or None
    if progress is None:  # the library reads the environment here, at its entry point, only
        progress = not os.environ.get("CI")
    config = AutoTPConfig(tp_size=tp_size, dtype=dtype, trace_dir=Path(trace_dir) if trace_dir else None,
                          overrides=dict(overrides.pop("overrides", {}) or {}), verify=bool(verify),
                          sequence_parallel=bool(sequence_parallel), fuse=bool(fuse),
                          compile_inner=compile_inner or "eager", trace_once=trace_once,
                          layer_regions=_layer_regions_wish(layer_regions, os.environ))
    if overrides:
        raise AutoTPError(f"unknown arguments to parallelize_model: {sorted(overrides)}")
    check_override_styles(config.overrides)  # before anything is downloaded
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise AutoTPError(f"timeout must be a positive number of seconds, got {timeout!r}")
        timeout = datetime.timedelta(seconds=timeout)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        ensure_process_group(timeout=timeout)
    joined = dist.is_available() and dist.is_initialized()
    layout = check_layout(mesh, dist.get_world_size() if joined else 1, data_parallel)
    if layout.mesh is not None:
        comm = Comm.from_group(layout.tp_group())
    else:
        comm = Comm.from_default_group() if joined else Comm.single()
    world = comm.world_size
    health = attach_health(comm)  # names the failed rank when a collective fails (autotp.health)
    if health is not None:
        health.set_phase("loading")
    if device is None:
        device = torch.device(f"cuda:{torch.cuda.current_device()}") if comm.backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if shared_memory and device.type == "cpu" and comm.backend == "gloo":
        # the same patience as the process group's collectives (gloo's default: 30 minutes)
        comm.use_shared_memory(timeout_s=timeout.total_seconds() if timeout is not None else 1800.0)
    if compile_inner is None:
        config = dataclasses.replace(config, compile_inner=default_compile_inner(device))
    show_progress = bool(progress) and comm.rank == 0
    threads_before = torch.get_num_threads()
    threads = threads_per_rank(device, os.environ, world * layout.dp_size, usable_cores())
    if threads is not None:
        torch.set_num_threads(threads)

    folder = resolve_checkpoint(model, revision=revision, cache_dir=cache_dir, token=token,
                                local_files_only=local_files_only, progress=show_progress)
    hf_config = _load_config(folder, trust_remote_code)
    check_divisible(hf_config, config.tp_size or world)
    check_tp_size(layout, config.tp_size)
    module = build_meta_model(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)
    check_overrides(module, config.overrides)  # names checked against the model, before any weight is read
    checkpoint = Checkpoint(folder)
    checkpoint.add_conversions_for(module)  # names transformers renames / converts on load
    _install_standins(module, checkpoint, dtype, device)
    if config.layer_regions is not False:  # None: where the stack is deep enough to repay them
        install_layer_regions(module, min_layers=1 if config.layer_regions else REGION_MIN_LAYERS)
    if device.type != "cpu":
        module.to(device)

    ctx = TPContext(comm=comm, config=config, sharded_outputs=True, plan_once=timeout is None,
                    threads_before=threads_before if threads is not None else None)
    weakref.finalize(module, ctx.close)  # what the session installed goes when the model does
    unfreeze = freeze_at_exit(os.environ)  # after the finalizer above: the freeze runs before it closes the session
    if unfreeze is not None:
        ctx.installed.append(unfreeze)
    compiled = _compiled_forward(module, ctx, device, fsdp=layout.data_parallel == "fsdp")
    slots = [(m, n, p) for fqn, p in module.named_parameters(remove_duplicate=False)
             for m, n in [_resolve_module(module, fqn)]]
    forward = _SwappingForward(compiled, slots, comm, InputGuard(TokenIdCheck.for_model(module, module.forward)),
                               logits_with_loss=bool(logits_with_loss), model=module)
    module.forward = forward
    _compile_encoder(module, slots, ctx)
    module.autotp = AutoTPHandle(context=ctx, folder=Path(folder), layout=layout, entry=forward)
    if warmup:
        with load_progress(checkpoint, len({id(p) for _, _, p in slots}), show_progress), \
                peer_failures(comm, "the model was loading"), _failures_recorded(health):
            _warm_up(module, forward, world, device)
            _load_untouched(slots, ctx)
        forward.swap_out()
        checkpoint.close()  # every shard is loaded: drop file handles (and .bin mappings)
        release_free_memory(collect=False)  # what loading freed goes back to the OS before the first real call
    if layout.data_parallel is not None:
        from autotp.data_parallel import apply_data_parallel

        module.autotp.data_parallel = apply_data_parallel(module, layout.data_parallel, layout.dp_mesh(), device)
    if health is not None:
        health.set_phase("loaded")
    return module


def _compiled_forward(module: torch.nn.Module, ctx: TPContext, device: torch.device,
                      fsdp: bool = False) -> Callable[..., Any]:
    """The model's compiled forward: with the cache on, one whose graphs are stored for the next
    launch and installed from the last one (``autotp/stored_graphs.py``), else what a rank that
    stores no entry runs (``compat.DynamoCompiled``: the same compile settings, among them the
    error past Dynamo's recompile limit; with a bare ``torch.compile`` a call past it ran the
    forward uncompiled on the shards); its frames shared within the group where the gate says so
    and the model is not under FSDP2 (``autotp/shared_frames.py``, Gate)."""
    fn = type(module).forward.__get__(module)
    if not ctx.plan_cache.enabled:
        return DynamoCompiled(fn, make_backend(ctx))
    for p in module.parameters():  # a stored graph lowers for the session that placed its parameters
        meta = meta_of(p)
        if meta is not None and meta.session is None:
            meta.session = ctx
    store = GraphStore(ctx.plan_cache.root, graph_key(module, plan_options(ctx), ctx.world_size, device))
    # one rank writes the entry, so it alone pickles the graphs it compiles: the last, because rank 0
    # plans each new graph while the others wait for its broadcast (backend.py), so the writer's
    # pickling overlaps that solve instead of adding to it. Where the group shares frames, the
    # writer is the one that traces (it records the package the others install), and rank 0 plans
    # once its trace is done (measured: as fast as rank 0 tracing, tp=4 on 2 cores)
    writer = ctx.world_size - 1
    writes = ctx.rank == writer
    share = None if fsdp else _frame_channel(ctx, store, tracer=writer)
    backend = storing_backend(make_backend(ctx), ctx, share) if writes else make_backend(ctx)
    trace = Path(ctx.config.trace_dir) / f"rank{ctx.rank}" if ctx.config.trace_dir else None
    compiled = StoredForward(fn, backend, store, write=writes, session=ctx, trace=trace, share=share)
    ctx.stored_graphs = store.outcome
    ctx.installed.append(compiled.uninstaller())
    return compiled


def _frame_channel(ctx: TPContext, store: GraphStore, tracer: int) -> FrameChannel | None:
    """The channel through which rank ``tracer`` gives the group the frames it compiles
    (``autotp/shared_frames.py``), where the group shares them (the tracer's choice); None where
    every rank traces."""
    if ctx.world_size == 1 or ctx.comm.simulated:
        return None
    wish = trace_once_default(ctx.config.trace_once, os.environ, ctx.world_size)
    if not trace_once_agreed(wish, ctx.comm, tracer):
        return None
    return FrameChannel(ctx.comm, tracer, ctx, StoredGraph, store.outcome.notes)


def _layer_regions_wish(option: bool | None, environ: Mapping[str, str]) -> bool | None:
    """``layer_regions`` as given, else what ``AUTOTP_LAYER_REGIONS`` says (1/true/on/yes, 0/false/off/no),
    else None: regions where the layer stack is deep enough to repay them (``regions.MIN_LAYERS``)."""
    return switch(option, environ, "AUTOTP_LAYER_REGIONS", default=None)


def _load_config(folder: Path, trust_remote_code: bool) -> Any:
    """``AutoConfig`` of the checkpoint, with transformers' refusals turned into AutoTPErrors
    (:func:`autotp.hf_config.read_config`, shared with the CLI and the planner)."""
    return read_config(folder, trust_remote_code)


@contextlib.contextmanager
def _failures_recorded(health: Any) -> Iterator[None]:
    """An exception leaving the block is recorded as this rank's failure in the health store, so
    the other ranks' errors can name this rank and the reason (see :mod:`autotp.health`)."""
    try:
        yield
    except Exception as e:
        if health is not None:
            health.record_failure(e)
        raise


def _install_standins(module: torch.nn.Module, checkpoint: Checkpoint, dtype: torch.dtype | None,
                      device: torch.device) -> None:
    """Replace each (meta) parameter by a zero-memory global-shaped stand-in carrying its meta,
    once the checkpoint's headers are known to hold every parameter in a shape and dtype that fit
    (:func:`~autotp.checkpoint_match.match_parameters`, one error for every problem)."""
    sources = match_parameters(module, checkpoint)
    seen: dict[int, torch.nn.Parameter] = {}
    for fqn, param in list(module.named_parameters(remove_duplicate=False)):
        owner, name = _resolve_module(module, fqn)
        if id(param) in seen:
            owner._parameters[name] = seen[id(param)]
            continue
        source = sources[fqn]
        target_dtype = dtype or source.stored_dtype
        stand = standin(source.shape, target_dtype, device, param.requires_grad)
        attach_meta(stand, ParameterMeta(fqn=fqn, global_shape=source.shape, dtype=target_dtype,
                                         checkpoint_key=source.key, checkpoint=checkpoint, placement=None,
                                         tied=source.group))
        owner._parameters[name] = stand
        seen[id(param)] = stand


#: keyword inputs whose dim 1 is the token dim the warm-up marks dynamic
TOKEN_INPUTS = ("input_ids", "decoder_input_ids")


def _warm_up(module: torch.nn.Module, forward: _SwappingForward, world_size: int, device: torch.device) -> None:
    """The call that compiles the first graph, which solves the plan (pinning every parameter it
    reaches) and loads this rank's slices. It is the graph a user's first calls reuse:

    * a decoder-only model that generates with transformers' default dynamic cache warms up with
      ``generate(ids, max_new_tokens=1)`` (greedy, so no random number is drawn): its one forward
      is the prefill a user's ``generate`` makes, with the same keywords (the fresh cache,
      ``use_cache``, ``return_dict``), so that ``generate`` compiles only its decode graph (two
      graphs per job instead of three);
    * any other model calls ``forward`` with :func:`_warmup_inputs` (its ``dummy_inputs`` keys and
      its own ``use_cache`` default), the graph a plain ``model(input_ids=...)`` call reuses.

    Either way the ids are one sequence of ``2N+1`` tokens (neither batch nor length divides by
    ``N``, so the plan splits heads and hidden features, not the warm-up's batch or sequence) whose
    token dim the entry marks dynamic (``_SwappingForward.dynamic_tokens``): the graph serves any
    length, its length is symbolic and never split (``passes/decompose.py: mark_symbolic_dims``)."""
    forward.dynamic_tokens = True
    try:
        with torch.no_grad():
            if _generates_with_dynamic_cache(module):
                ids, pad = _warmup_ids(module, world_size)
                forward.record_prefill = True  # a plain call is completed into this prefill's keywords
                module.generate(ids.to(device), max_new_tokens=1, min_new_tokens=1, do_sample=False, num_beams=1,
                                pad_token_id=pad)
            else:
                module(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                          for k, v in _warmup_inputs(module, world_size).items()})
    finally:
        forward.dynamic_tokens = False
        forward.record_prefill = False


def _generates_with_dynamic_cache(module: torch.nn.Module) -> bool:
    """A decoder-only model whose ``generate`` makes transformers' default dynamic cache (the
    models :func:`_warm_up` warms up with a one-token ``generate``)."""
    try:
        return (not getattr(module.config, "is_encoder_decoder", False) and module.can_generate()
                and module._supports_default_dynamic_cache())
    except (AttributeError, TypeError):
        return False


def _warmup_ids(module: torch.nn.Module, world_size: int) -> tuple[torch.Tensor, int]:
    """``(1, 2N+1)`` token ids for the generate warm-up, none of them the pad or end-of-sequence id
    (a pad id in the prompt would make ``generate`` pass an attention mask a user's prompt does not
    need, and compile another prefill), and the pad id to pass (the model's, else its first end-of-
    sequence id, as ``generate`` itself picks; passing it keeps ``generate`` from warning)."""
    config = module.generation_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    eos = [e for e in eos if e is not None]
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    special = {pad, *eos}
    ids = [t for t in range(1, 2 * world_size + 2 + len(special) + 1) if t not in special][: 2 * world_size + 1]
    return torch.tensor(ids).unsqueeze(0), pad


def _warmup_inputs(module: torch.nn.Module, world_size: int) -> dict[str, Any]:
    """The plain warm-up call's inputs (:func:`_warm_up`): the model's own ``dummy_inputs`` keys but
    its masks, ``(1, 2N+1)`` ids for each token input, and the model's own ``use_cache`` default.
    A plain call passes ids alone (T5's ``model(input_ids=..., decoder_input_ids=...)``), and a
    keyword the warm-up passed that the call does not (T5's dummy ``decoder_attention_mask``) fails
    Dynamo's guard on the keywords: the call would compile another graph."""
    dummy = getattr(module, "dummy_inputs", None)
    inputs: dict[str, Any] = dict(dummy) if isinstance(dummy, dict) and dummy else {}
    ids = torch.arange(1, 2 * world_size + 2).unsqueeze(0)  # (1, 2N+1)
    for key in TOKEN_INPUTS:
        if key in inputs or key == "input_ids":
            inputs[key] = ids.clone()
    for mask in ("attention_mask", "decoder_attention_mask"):
        inputs.pop(mask, None)
    return inputs


def _load_untouched(slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]], ctx: TPContext) -> None:
    """Parameters no graph used (e.g. a pooler the warm-up did not reach) load replicated."""
    for _, _, stand in slots:
        meta = meta_of(stand)
        if meta.local is None:
            meta.placement = R
            meta.local = torch.nn.Parameter(
                meta.load_local(ctx.rank, ctx.world_size, dtype=meta.dtype, device=stand.device),
                requires_grad=stand.requires_grad)
            attach_meta(meta.local, meta)
