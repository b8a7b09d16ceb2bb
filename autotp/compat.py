"""Where autotp adapts private torch internals to its stand-ins (one module, one job each).

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
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["grouped_mm_accepts_standins"]


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
