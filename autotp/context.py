"""Runtime state shared by every graph of one parallelized model: the group, the config, a graph
counter for traces. Per-parameter state (``ParameterMeta``) lives on the parameter object itself,
so it outlives graphs and recompiles without any global registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from autotp.collectives import Comm
from autotp.config import AutoTPConfig
from autotp.weights import ParameterMeta

META_ATTR = "_autotp_meta"


@dataclass
class TPContext:
    comm: Comm
    config: AutoTPConfig = field(default_factory=AutoTPConfig)
    graphs_compiled: int = 0
    on_plan: Callable[[dict], None] | None = None

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
    shard instead."""
    value = fill if dtype.is_floating_point or dtype.is_complex else 0
    base = torch.full((), value, dtype=dtype, device=device)
    return torch.nn.Parameter(base.expand(shape), requires_grad=requires_grad)
