"""The private torch internals the data-parallel composition needs, in one place.

Each function names the internal it touches and why no public API does the job; when torch
changes one of them, this module is the one to fix (and ``tests/distributed/test_mesh.py`` the
test that notices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["fsdp_params", "no_ddp_graph_split", "use_as_unsharded_param"]


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
        raise RuntimeError(f"FSDP2's unsharded parameter {tuple(unsharded.shape)} {unsharded.dtype} does not "
                           f"match the local shard {tuple(local.shape)} {local.dtype}")
    with torch.no_grad():
        local.data = unsharded.data
    local.requires_grad_(unsharded.requires_grad)
    fsdp_param._unsharded_param = local
