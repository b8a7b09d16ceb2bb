"""Frozen user intent: what the user asked for, checked once at the entry point."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from autotp.errors import AutoTPError


@dataclass(frozen=True)
class AutoTPConfig:
    """Everything the compiler needs to know about the user's wishes.

    ``tp_size``: ranks in the tensor-parallel group (None: the world size).
    ``dtype``: parameter dtype after loading (None: the checkpoint's).
    ``trace_dir``: where each rank writes one folder per compiled graph (None: no trace).
    ``memory_weight``: solver cost of one replicated parameter byte relative to one communicated
    byte per token (see ``autotp/passes/solve.py``).
    ``beam_width``: the solver's bound on partial plans kept per node.
    ``compile_inner``: "eager" runs the rewritten graph as FX Python code; "inductor" hands this
    rank's rewritten inference graphs to inductor, collectives as functional collectives
    (``autotp/inner.py``; training graphs and graphs inductor refuses run eagerly, with a trace note).
    ``fuse``: after the rewrite, sibling matmuls that read the same input (q/k/v, gate/up) become
    one matmul on a concatenated weight per rank, in inference graphs (``autotp/passes/fuse.py``).
    ``sequence_parallel``: keep activations between tensor-parallel regions (residual stream,
    norms, dropout) sharded on the sequence, reduce-scatter + all-gather instead of all-reduce
    (a second solve prices replicated activations, ``SolverOptions.activation_weight``).
    ``verify``: check each graph's first call against a replicated run, node by node, and raise at
    the first node that diverges (``autotp/verify.py``).
    ``trace_once``: one rank traces the model's frames and the others install them
    (``autotp/shared_frames.py``; needs the cache on); None: as ``AUTOTP_TRACE_ONCE=1/0`` says,
    else on where this host's ranks outnumber its cores (``shared_frames.ranks_outnumber_cores``).
    ``layer_regions``: Dynamo traces a repeated decoder layer once per graph and stamps out the
    others (``autotp/regions.py``); None: where the stack has at least ``regions.MIN_LAYERS`` layers
    (``parallelize_model`` reads ``AUTOTP_LAYER_REGIONS=1/0`` first).
    """

    tp_size: int | None = None
    dtype: torch.dtype | None = None
    trace_dir: Path | None = None
    memory_weight: float = 1.0
    beam_width: int = 32
    compile_inner: str = "eager"
    overrides: Mapping[str, str] = field(default_factory=dict)
    verify: bool = False
    sequence_parallel: bool = False
    fuse: bool = True
    trace_once: bool | None = None
    layer_regions: bool | None = None

    def __post_init__(self) -> None:
        if self.tp_size is not None and (not isinstance(self.tp_size, int) or self.tp_size < 1):
            raise AutoTPError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if self.compile_inner not in ("eager", "inductor"):
            raise AutoTPError(f"compile_inner={self.compile_inner!r} is not supported; use 'eager' or 'inductor'")
        if self.beam_width < 1:
            raise AutoTPError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.trace_dir is not None and not isinstance(self.trace_dir, Path):
            object.__setattr__(self, "trace_dir", Path(self.trace_dir))


def switch(option: bool | None, environ: Mapping[str, str], variable: str, *, default: bool | None) -> bool | None:
    """A switch the caller may set and the environment may override: ``option`` if the caller set
    it, else on where the environment variable ``variable`` says 1/true/on/yes, off where it says
    0/false/off/no, else ``default``."""
    if option is not None:
        return bool(option)
    word = environ.get(variable, "").strip().lower()
    if word in ("1", "true", "on", "yes"):
        return True
    if word in ("0", "false", "off", "no"):
        return False
    return default


DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise AutoTPError(f"unknown dtype {value!r}; use one of {sorted(DTYPES)}")
    return DTYPES[value]
