"""The session of one parallelized model (:class:`TPContext`): the group, the options, the plan
cache, the graph counter for traces and every graph compiled for the model with its plan
(:class:`CompiledGraph`). One model has one session whichever entry point compiled it:
``parallelize_model`` makes it, and ``backend="autotp"`` finds the session of the parameters a
graph reads (:func:`session_of`), so graph ids are unique in the model's traces and an override is
checked against every graph of the model. Per-parameter state (``ParameterMeta``) lives on the
parameter object itself, so it outlives graphs and recompiles without any global registry; it
names the session that placed the parameter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autotp.collectives import Comm, detach_health
from autotp.compat import grouped_mm_accepts_standins
from autotp.config import AutoTPConfig
from autotp.placement import GroupedShard, HeadShard, Shard, chunks
from autotp.plan_cache import PlanCache
from autotp.weights import ParameterMeta

META_ATTR = "_autotp_meta"


@dataclass
class CompiledGraph:
    """What compiling one graph produced, kept by the session (``TPContext.graphs``): its id, the
    per-parameter plan (``autotp/plan.py``), what lowering did (fusion, sequence-parallel saved
    shards, checkpointed blocks), the values its result leaves sharded, what runs it (the inner
    compiler's report) and, for tools (``TPContext.keep_solve_records``), the solver's record."""

    graph_id: int
    plan: dict[str, Any]
    fusion: dict[str, Any] | None
    save_shards: dict[str, Any] | None
    checkpoints: dict[str, Any] | None
    sharded_outputs: list[Any]
    inner: dict[str, Any]
    #: ``backend.SolveRecord`` where this process solved and the session keeps records, else None
    solve: Any = None


@dataclass
class TPContext:
    comm: Comm
    config: AutoTPConfig = field(default_factory=AutoTPConfig)
    #: graph ids handed out (a graph takes its id when compilation starts; ``graphs`` holds those done)
    graphs_compiled: int = 0
    #: every graph compiled for this model, in order (see :class:`CompiledGraph`)
    graphs: list[CompiledGraph] = field(default_factory=list)
    #: graph outputs may stay sharded (as :func:`sharded_standin`): the caller gathers what the
    #: user reads at the model boundary and keeps KV-cache entries sharded (``parallelize_model``)
    sharded_outputs: bool = False
    #: with ``sharded_outputs``, the callable the backend returns gathers every sharded output except
    #: the KV-cache entries (``autotp/cache_outputs.py``), which stay stand-ins: the model boundary
    #: of ``torch.compile(model, backend="autotp")``, which has no forward wrapper of its own
    #: (``parallelize_model``'s ``_SwappingForward`` gathers at its boundary, so it leaves this off)
    gather_outputs: bool = False
    #: keep each graph's solver record (shadow ATen graph, solution) in ``CompiledGraph.solve`` for
    #: tools that read it (``autotp plan``); at run time it is dropped before the weights are read,
    #: so the tracing's fake tensors and graphs are freed, not held next to the shards
    keep_solve_records: bool = False
    #: the persistent plan cache (``autotp/plan_cache.py``; location and switch from the
    #: environment when the context is made) and each graph's hit / miss
    plan_cache: PlanCache = field(default_factory=PlanCache.from_environment)
    #: rank 0 plans each graph for the group and broadcasts it (``backend._plans_once``); the
    #: other ranks wait in that broadcast while rank 0 plans, so ``parallelize_model`` turns it on
    #: only under the default collective timeout (a ``timeout=`` of a few seconds bounds peer skew,
    #: not planning), and ``backend="autotp"`` only where the caller's group waits at least as
    #: long (``backend.waits_for_a_plan``)
    plan_once: bool = False
    #: override patterns some graph of this model matched (``backend._apply_overrides``)
    overrides_matched: set[str] = field(default_factory=set)
    #: torch's intra-op thread count before the entry point set this rank's share (restored on close)
    threads_before: int | None = None
    #: what became of the model's stored graphs (``autotp/stored_graphs.py``: ``StoredOutcome``);
    #: None where the session does not store them
    stored_graphs: Any = None
    #: what undoes the rest the session installed (the stored graphs' frames on the model's code)
    installed: list[Callable[[], None]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        """Undo what the session installed in the process: the rank-health heartbeat and excepthook
        (once no other session's communicator uses them), the shared-memory transport's mapping,
        the thread count and the stored graphs' frames. Idempotent; ``parallelize_model`` also runs
        it when the model is garbage-collected. The model still runs afterwards, through the process group alone."""
        if self.closed:
            return
        self.closed = True
        detach_health(self.comm)
        self.comm.shared_memory = None  # the mapping goes with the last reference
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        while self.installed:
            self.installed.pop()()

    def next_graph_id(self) -> int:
        """A new graph's id: unique among this model's graphs (trace folders ``graphNNN``)."""
        self.graphs_compiled += 1
        return self.graphs_compiled - 1

    @property
    def plans(self) -> list[dict[str, Any]]:
        """The per-parameter plan of every compiled graph, in order."""
        return [g.plan for g in self.graphs]

    @property
    def inner_reports(self) -> list[dict[str, Any]]:
        """Per compiled graph, what runs it (``autotp/inner.py``): compiler and any fallback reason."""
        return [g.inner for g in self.graphs]

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size


def meta_of(t: torch.Tensor) -> ParameterMeta | None:
    """The ParameterMeta attached to a parameter (or its zero-memory stand-in), if any."""
    return getattr(t, META_ATTR, None)


def attach_meta(t: torch.Tensor, meta: ParameterMeta) -> None:
    setattr(t, META_ATTR, meta)


def standin(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
            requires_grad: bool, fill: float = 0.0) -> torch.nn.Parameter:
    """A zero-memory, global-shaped parameter for Dynamo to trace and guard on: one element
    expanded (stride 0) to ``shape``. Read-only by construction; compiled graphs bind the real local
    shard instead. Ops that check their operands' strides while tracing accept stand-ins
    (``compat.grouped_mm_accepts_standins``)."""
    grouped_mm_accepts_standins()
    value = fill if dtype.is_floating_point or dtype.is_complex else 0
    base = torch.full((), value, dtype=dtype, device=device)
    return torch.nn.Parameter(base.expand(shape), requires_grad=requires_grad)


SHARD_ATTR = "_autotp_shard"
OUTPUT_PATH_ATTR = "_autotp_output_path"


def sharded_standin(local: torch.Tensor, placement: Shard | GroupedShard | HeadShard, world_size: int,
                    output_path: tuple[int, ...] | None = None, size: int | None = None) -> torch.Tensor:
    """A value that leaves a compiled graph sharded (a KV-cache entry), as a global-shaped,
    NaN-filled, zero-memory tensor that carries this rank's shard.

    Dynamo traces and guards the global shape; a later compiled graph that receives it binds the
    shard (see ``backend.compile_graph``), and ``parallelize_model`` gathers any such value the
    user would read. Eager code that reads the stand-in itself sees NaN, never plausible numbers.
    ``size`` is the global size of the sharded dim (needed where the ranks' chunks are uneven:
    vocabulary logits, heads no tp divides); else it is the local size times N.
    """
    shape = list(local.shape)
    # local (.., s/N, ..) -> global (.., s, ..); an uneven split names its global size
    shape[placement.dim] = size if size is not None else shape[placement.dim] * chunks(placement, world_size)
    # requires grad as the shard does: a later graph traced on the stand-in must plan the
    # backward of its input (a training graph after a graph break), though the gradient reaches
    # the shard it binds at run time, not this
    base = torch.full((), float("nan") if local.dtype.is_floating_point else 0, dtype=local.dtype,
                      device=local.device, requires_grad=local.requires_grad)
    out = base.expand(shape)
    setattr(out, SHARD_ATTR, (local, placement))
    setattr(out, OUTPUT_PATH_ATTR, output_path)
    return out


def shard_of(t: Any) -> tuple[torch.Tensor, Shard | GroupedShard | HeadShard] | None:
    """``(local shard, placement)`` of a :func:`sharded_standin`, else None."""
    return getattr(t, SHARD_ATTR, None) if isinstance(t, torch.Tensor) else None


def output_path_of(t: Any) -> tuple[int, ...] | None:
    """Where a :func:`sharded_standin` was returned in its graph's result, else None."""
    return getattr(t, OUTPUT_PATH_ATTR, None) if isinstance(t, torch.Tensor) else None
