"""Data parallelism over ``mesh["dp"]`` for a tensor-parallel model, through torch's own engines.

``parallelize_model(..., mesh=mesh, data_parallel="fsdp" | "ddp")`` plans and loads the model
tensor-parallel over ``mesh["tp"]`` as always, then hands the local shards to FSDP2's
``fully_shard`` or to ``DistributedDataParallel`` over ``mesh["dp"]``. Every rank of one dp group
holds the same tp rank's shards, so to the data-parallel engine each local shard *is* the full
parameter: the usual 2-D composition for a tensor-parallel layer that is not DTensor-based. The
model object the user gets back stays the transformers model (``model.generate``,
``model.autotp``), and a plain ``torch.optim`` optimizer over ``model.parameters()`` trains it.

**DDP.** A ``DistributedDataParallel`` wraps an entry module (:class:`_Entry`) that holds the
model and calls its compiled forward; ``model.forward`` calls the DDP object. DDP's reducer
averages each local shard's gradient over ``mesh["dp"]`` as the backward produces it, and
``model.parameters()`` are the local shards (the same objects the compiled graphs bind). The DDP
object is ``model.autotp.data_parallel.ddp`` (``no_sync()`` for gradient accumulation). Dynamo's
DDP graph splitting is off for autotp's calls (:func:`autotp.compat.no_ddp_graph_split`).

**FSDP2.** ``fully_shard(model, mesh=mesh["dp"])`` shards every local shard on its dim 0 over dp
(a ``DTensor`` parameter holding ``1/(dp*tp)`` of the logical parameter; optimizers hold these)
and all-gathers them before each forward and again before backward, reduce-scattering (mean)
the gradients after it. The compiled graphs bind the local shard objects (``get_attr``), so each
local shard is made the very tensor FSDP2 all-gathers into (:func:`autotp.compat.
use_as_unsharded_param`); outside a call its storage is freed. One FSDP unit covers the whole
model (the root): autotp compiles the whole forward as one graph that reads every shard, so
per-block units, whose hooks would run inside that graph, do not apply; a rank's peak therefore
holds its whole tp shard during a step and ``1/(dp*tp)`` between steps. Sibling-matmul fusion
is off under FSDP2 (a fused buffer would be a second copy of the weights, outside FSDP2's
storage).

Gradients are averaged over dp exactly as the engines do for any model: with equal token counts
per dp rank, the averaged gradient is the one of the whole batch's mean loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autotp.collectives import Comm
from autotp.compat import (
    fsdp_params,
    no_ddp_graph_split,
    param_location,
    sharded_param,
    use_as_unsharded_param,
)
from autotp.context import attach_meta, meta_of
from autotp.errors import AutoTPError

__all__ = ["DataParallel", "apply_data_parallel"]


@dataclass
class DataParallel:
    """The data-parallel side of a 2-D model: the engine (``"fsdp"`` or ``"ddp"``), the 1-D
    ``mesh["dp"]``, a communicator over it (global gradient norms), and DDP's wrapper object."""

    kind: str
    mesh: Any
    comm: Comm
    ddp: torch.nn.parallel.DistributedDataParallel | None = None


class _Entry(torch.nn.Module):
    """The module DDP wraps: it holds the model (so DDP's reducer sees the local shards) and runs
    the model's compiled forward (the model's own ``forward`` calls DDP)."""

    def __init__(self, model: torch.nn.Module, run: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self._run = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(*args, **kwargs)


class _DDPForward:
    """``model.forward`` under DDP: the call goes through the DDP object (which prepares its
    reducer when gradients are enabled) with Dynamo's DDP graph splitting off."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, signature: Any) -> None:
        self.ddp = ddp
        if signature is not None:
            self.__signature__ = signature  # transformers' generate filters kwargs by it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with no_ddp_graph_split():
            return self.ddp(*args, **kwargs)


def apply_data_parallel(model: torch.nn.Module, kind: str, dp_mesh: Any, device: torch.device) -> DataParallel:
    """Hand ``model``'s local shards (outside forward) to ``kind``'s engine over ``dp_mesh``."""
    comm = Comm.from_group(dp_mesh.get_group())
    if kind == "ddp":
        return DataParallel(kind, dp_mesh, comm, ddp=_apply_ddp(model, dp_mesh, device))
    if kind == "fsdp":
        _apply_fsdp(model, dp_mesh)
        return DataParallel(kind, dp_mesh, comm)
    raise AutoTPError(f"unknown data_parallel engine {kind!r}")


def _apply_ddp(model: torch.nn.Module, dp_mesh: Any, device: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    run = model.forward
    entry = _Entry(model, run)
    ddp = torch.nn.parallel.DistributedDataParallel(
        entry, device_mesh=dp_mesh, device_ids=[device] if device.type == "cuda" else None,
        forward_sync_buffers=False,  # buffers are constants rebuilt from the config (rotary tables)
    )
    model.forward = _DDPForward(ddp, getattr(run, "__signature__", None) or _signature(model))
    return ddp


def _signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return None


def _apply_fsdp(model: torch.nn.Module, dp_mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    if getattr(model.config, "is_encoder_decoder", False):
        raise AutoTPError(
            "data_parallel=\"fsdp\" is not supported for encoder-decoder models yet: generate() runs the "
            "encoder outside the model's forward, where FSDP2 has not gathered the parameters. Use "
            "data_parallel=\"ddp\""
        )
    locals_at = {(id(m), n): p for m in model.modules() for n, p in m._parameters.items() if p is not None}
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)
    model.unshard()  # the first all-gather creates FSDP2's unsharded parameters
    for fsdp_param in fsdp_params(model):
        owner, name = param_location(fsdp_param)
        local = locals_at[(id(owner), name)]
        meta = meta_of(local)
        if meta is None or meta.local is not local:
            raise AutoTPError(f"parameter {name!r} of {type(owner).__name__} is not a local shard of autotp")
        use_as_unsharded_param(fsdp_param, local)
        attach_meta(sharded_param(fsdp_param), meta)  # the tp placement, for norms and checkpoints
    model.reshard()
