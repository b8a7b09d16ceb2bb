"""The private torch internals autotp relies on, in one place (one section each).

Each function names the internal it touches and why no public API does the job; when torch
changes one of them, this module is the one to fix.

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

**Data-parallel composition (2-D mesh).** DDP's graph splitting and FSDP2's parameter objects,
which the 2-D mesh reaches into (``tests/distributed/test_mesh.py`` notices a change).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["fsdp_params", "grouped_mm_accepts_standins", "no_ddp_graph_split", "use_as_unsharded_param"]


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
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
            warnings.simplefilter("ignore", UserWarning)
            self.library.impl("_grouped_mm", self.meta, "Meta")

    def meta(self, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> Any:
        return self.original(_unexpanded(mat_a), _unexpanded(mat_b), offs=offs, bias=bias, out_dtype=out_dtype)


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
        raise RuntimeError(f"FSDP2's unsharded parameter {tuple(unsharded.shape)} {unsharded.dtype} does not "
                           f"match the local shard {tuple(local.shape)} {local.dtype}")
    with torch.no_grad():
        local.data = unsharded.data
    local.requires_grad_(unsharded.requires_grad)
    fsdp_param._unsharded_param = local
