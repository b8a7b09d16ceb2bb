"""autotp: tensor parallelism for any PyTorch / Hugging Face model, with no per-model code.

    torch.compile(model, backend="autotp")      # any nn.Module, on every rank
    parallelize_model("org/name" or "/dir")     # Hub id or folder -> compiled, sharded model
    session_of(model).plans                     # what was planned for each compiled graph
"""

from autotp.api import AutoTPHandle, parallelize_model
from autotp.backend import autotp_backend, session_of
from autotp.checkpoints import load_checkpoint, save_checkpoint, save_pretrained
from autotp.config import AutoTPConfig
from autotp.errors import AutoTPError, CheckpointError, ShardingError, SolverError
from autotp.health import RankFailure
from autotp.placement import Partial, Replicate, Shard
from autotp.training import clip_grad_norm_

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
