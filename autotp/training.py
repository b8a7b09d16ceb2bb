"""Training helpers that must see the whole model, not one rank's shards.

``torch.nn.utils.clip_grad_norm_`` over a rank's ``model.parameters()`` computes the norm of that
rank's pieces: a sharded parameter contributes only its shard, so the norm (and the clipping) is
wrong. :func:`clip_grad_norm_` sums the squared shards over the ranks and counts replicated
parameters once, so every rank gets the global norm one process would compute and scales alike.

:func:`saved_activation_bytes` measures what a training forward leaves for backward on this rank
(the activation memory sequence parallelism shrinks), with or without the weights it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from autotp.collectives import Comm, sum_over_ranks
from autotp.context import meta_of
from autotp.errors import AutoTPError
from autotp.placement import GroupedShard, HeadShard, Shard, StridedShard


def clip_grad_norm_(model: torch.nn.Module, max_norm: float, norm_type: float = 2.0,
                    parameters: Iterable[torch.nn.Parameter] | None = None) -> torch.Tensor:
    """Clip the gradients of a model from ``parallelize_model`` to a global ``max_norm`` (L2).

    Returns the global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does on one
    process. ``parameters`` defaults to ``model.parameters()``.

    On a 2-D mesh the norm is global over both dims: a gradient that FSDP2 shards over
    ``mesh["dp"]`` (a ``DTensor``) is summed over dp, one sharded by tensor parallelism over tp,
    and a gradient that is whole on every rank of a dim (DDP's averaged gradients over dp, a
    replicated parameter's over tp) is counted once along it; a grouped kv-head shard's once per
    group, as are the rows of a fused projection that several ranks hold alike (its kv heads whole
    on every rank or held per group of ranks).
    """
    handle = getattr(model, "autotp", None)
    if handle is None:
        raise AutoTPError("clip_grad_norm_ needs a model returned by autotp.parallelize_model (it has .autotp)")
    if float(norm_type) != 2.0:
        raise AutoTPError(f"clip_grad_norm_ supports the L2 norm (norm_type=2.0), got {norm_type}")
    tp_comm: Comm = handle.context.comm
    dp = getattr(handle, "data_parallel", None)
    params = [p for p in (parameters if parameters is not None else model.parameters()) if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    # squared sums by where the gradient is split: [tp and dp, dp only, tp only, neither]
    squares = torch.zeros(4, dtype=torch.float64, device=_local(params[0].grad).device)
    for p in params:
        grad = p.grad.detach()
        meta = meta_of(p)
        over_tp = meta is not None and isinstance(meta.placement, (Shard, GroupedShard, HeadShard))
        over_dp = isinstance(grad, DTensor)
        square = _local(grad).double().pow(2).sum()
        if over_tp and isinstance(meta.placement, GroupedShard):  # the N / groups ranks of a group hold one chunk
            square = square * meta.placement.groups / tp_comm.world_size
        if over_tp and isinstance(meta.placement, StridedShard) and meta.placement.shared:  # shared rows: once
            layout, n = meta.placement, tp_comm.world_size
            for i, (a, b) in enumerate(layout.local_bounds(n, tp_comm.rank)):
                if layout.holders(i, n) > 1:  # whole on every rank, or kv heads held per group of ranks
                    rows = _local(grad).narrow(layout.dim, a, b - a).double().pow(2).sum()
                    square = square - rows * (1 - 1 / layout.holders(i, n))
        squares[(0 if over_dp else 2) if over_tp else (1 if over_dp else 3)] += square
    if dp is not None:
        squares[:2] = sum_over_ranks(squares[:2], dp.comm)  # FSDP2's dp shards
    total = (sum_over_ranks(squares[0] + squares[2], tp_comm) + squares[1] + squares[3]).sqrt()
    coef = float(max_norm) / (float(total) + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return total.to(_local(params[0].grad).dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (a ``DTensor``'s local tensor, or ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def saved_activation_bytes(forward: Callable[[], torch.Tensor],
                           weights: Callable[[], Iterable[torch.Tensor]] | None = None) -> tuple[torch.Tensor, int]:
    """Run ``forward`` (a training forward returning the loss) and count the bytes of the distinct
    storages autograd saves for its backward on this rank (meta tensors excluded). Returns
    ``(loss, bytes)``; the caller runs ``loss.backward()``.

    ``weights`` leaves out the storages of the tensors it returns: a matmul saves its weight to
    compute its input's gradient, and at small batches those parameter bytes are most of what is
    saved, though no activation. It is called once, when the first tensor is saved (inside the
    forward), so tensors that exist only during the call (FSDP2's all-gathered shards) can be named."""
    storages: dict[int, int] = {}
    excluded: set[int] | None = None

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal excluded
        if excluded is None:
            excluded = {w.untyped_storage().data_ptr() for w in weights()} if weights is not None else set()
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in excluded:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return loss, sum(storages.values())
