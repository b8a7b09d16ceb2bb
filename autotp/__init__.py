"""autotp: tensor parallelism for any PyTorch / Hugging Face model, with no per-model code.

    torch.compile(model, backend="autotp")      # any nn.Module, on every rank
    parallelize_model("org/name" or "/dir")     # Hub id or folder -> compiled, sharded model
    session_of(model).plans                     # what was planned for each compiled graph

The names below are imported on first use (PEP 562), so ``import autotp`` (and the ``autotp``
command, whose ``plan`` serves a cached report without torch) does not load torch by itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotp.api import AutoTPHandle, parallelize_model
    from autotp.backend import autotp_backend, session_of
    from autotp.checkpoints import load_checkpoint, save_checkpoint, save_pretrained
    from autotp.config import AutoTPConfig
    from autotp.errors import AutoTPError, CheckpointError, ShardingError, SolverError
    from autotp.health import RankFailure
    from autotp.placement import Partial, Replicate, Shard
    from autotp.training import clip_grad_norm_

#: public name -> the module that defines it
_EXPORTS = {
    "AutoTPConfig": "autotp.config",
    "AutoTPError": "autotp.errors",
    "AutoTPHandle": "autotp.api",
    "CheckpointError": "autotp.errors",
    "Partial": "autotp.placement",
    "RankFailure": "autotp.health",
    "Replicate": "autotp.placement",
    "Shard": "autotp.placement",
    "ShardingError": "autotp.errors",
    "SolverError": "autotp.errors",
    "autotp_backend": "autotp.backend",
    "clip_grad_norm_": "autotp.training",
    "load_checkpoint": "autotp.checkpoints",
    "parallelize_model": "autotp.api",
    "save_checkpoint": "autotp.checkpoints",
    "save_pretrained": "autotp.checkpoints",
    "session_of": "autotp.backend",
}

__all__ = [
    "AutoTPConfig",
    "AutoTPError",
    "AutoTPHandle",
    "CheckpointError",
    "Partial",
    "RankFailure",
    "Replicate",
    "Shard",
    "ShardingError",
    "SolverError",
    "autotp_backend",
    "clip_grad_norm_",
    "load_checkpoint",
    "parallelize_model",
    "save_checkpoint",
    "save_pretrained",
    "session_of",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autotp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
