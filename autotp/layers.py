"""Parallel building blocks that the rewrite pass puts into the per-rank graph.

The design follows Megatron-LM's conjugate pairs, generalized by placements: a layer computes on
its local shards and says which placement its output has; the compiler inserts a
:class:`Redistribute` wherever a consumer needs another placement. Communication never hides inside
a layer, so the plan's collectives are exactly the ``Redistribute`` modules in the graph.

* Column-parallel matmul: ``R`` input -> ``Redistribute(R, R, grad_partial=True)`` (forward
  identity, backward all-reduce: every rank's input gradient is only its columns' share) -> local
  matmul with a ``S(0)`` weight -> ``S(-1)`` output.
* Row-parallel matmul: ``S(-1)`` input x ``S(1)`` weight -> ``P`` output ->
  ``Redistribute(P, R)`` (forward all-reduce, backward identity).
* Vocab-parallel embedding: rows ``[vocab_start, vocab_end)`` of the table on each rank; ids
  outside the range look up zeros, so the output is ``P``, made ``R`` by a ``Redistribute(P, R)``.
* Vocab-parallel cross-entropy: the logits stay ``S(class dim)``; :class:`ShardedSoftmax`
  normalizes each rank's chunk with the whole rows' max and sum-exp, :class:`VocabGather` picks the
  target log-probabilities a rank holds (zeros for the others), and :class:`VocabParallelLoss`
  combines them into this rank's summand of the loss (``P``, all-reduced by the usual
  ``Redistribute(P, R)``): O(rows) bytes cross the wire instead of the full logits.

The one exception to "no communication inside a layer" is :class:`ShardedSoftmax`: a softmax over
a sharded dim needs the rows' statistics, so it all-reduces them itself (two in forward, one in
backward, each one value per row). The solver prices them (``Candidate.collectives``), the plan's
collective counts include them, and the calls are still made in :mod:`autotp.collectives`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autotp import collectives
from autotp.collectives import Comm
from autotp.errors import AutoTPError
from autotp.placement import Placement, Shard, StridedShard, chunk_range, chunk_sizes

__all__ = ["LinearOnGatheredInput", "Redistribute", "ShardedSoftmax", "VocabGather", "VocabParallelEmbedding", "VocabParallelLoss",
           "vocab_range"]

#: rows ``[start, stop)`` of a table that a rank holds (``torch.chunk`` semantics, uneven allowed)
vocab_range = chunk_range


class ChunkGroupGradient(nn.Module):
    """A parameter held per group of ranks (``GroupedShard``: a k/v projection whose kv heads the
    ranks outnumber) as a graph that may train reads it: identity forward; backward sums its
    gradient over the ranks of this rank's group (:class:`autotp.collectives.ReduceOverChunkGroup`).
    With ``rows`` (``[start, stop)`` along ``dim``) only those rows are summed: the kv heads of a
    fused q|k|v projection held per group of ranks beside its split q heads (``StridedShard.groups``).
    A module, like :class:`Redistribute`, so the rewritten graph names it."""

    def __init__(self, comm: Comm, groups: int, dim: int = 0, rows: tuple[tuple[int, int], ...] | None = None
                 ) -> None:
        super().__init__()
        self.comm = comm
        self.groups = groups
        self.dim, self.rows = dim, rows

    def forward(self, x: Tensor) -> Tensor:
        return collectives.reduce_over_chunk_group(x, self.comm, self.groups, self.dim, self.rows)

    def extra_repr(self) -> str:
        rows = "" if self.rows is None else f" of rows {list(self.rows)} of dim {self.dim}"
        return f"backward all_reduce{rows} over each group of {self.comm.world_size // self.groups} ranks"


class WholeSegmentGradient(nn.Module):
    """Segments every rank holds whole (``StridedShard.whole``: Falcon's one k and v head beside its
    split q heads) as a graph that may train reads them: identity forward. On the parameter
    (``owner=False``), backward all-reduces the whole segments' rows of its gradient; on the
    projection's output (``owner=True``), backward keeps their gradient on rank 0 only, so the
    input gradient counts them once (:class:`autotp.collectives.WholeSegmentBackward`). A module,
    like :class:`Redistribute`, so the rewritten graph names it."""

    def __init__(self, placement: StridedShard, comm: Comm, owner: bool) -> None:
        super().__init__()
        self.placement, self.comm, self.owner = placement, comm, owner

    def forward(self, x: Tensor) -> Tensor:
        return collectives.whole_segment_backward(x, self.placement, self.comm, self.owner)

    def extra_repr(self) -> str:
        return f"{self.placement}, backward: " + (
            "whole segments' gradient kept on rank 0" if self.owner else "all_reduce of the whole segments' rows")


class Redistribute(nn.Module):
    """Change the placement of a tensor: ``src -> dst`` with the conjugate collective in backward.

    A thin module around :func:`autotp.collectives.redistribute` so that the plan's communication
    shows up by name in the rewritten graph (``print(gm)`` lists e.g. ``S(2) -> R, all_gather``).
    """

    def __init__(self, src: Placement, dst: Placement, comm: Comm, grad_partial: bool = False,
                 size: int | None = None) -> None:
        super().__init__()
        # Validate now rather than at the first forward: raises AutoTPError for R/S -> P and for
        # grad_partial with a non-Replicate destination.
        collectives.backward_kind_of(src, dst, grad_partial)
        self.src = src
        self.dst = dst
        self.comm = comm
        self.grad_partial = grad_partial
        #: the global size of the source's sharded dim, when ranks may hold unequal chunks of it
        self.size = size

    def forward(self, x: Tensor) -> Tensor:
        return collectives.redistribute(x, self.src, self.dst, self.comm, self.grad_partial, self.size)

    def extra_repr(self) -> str:
        kind = collectives.kind_of(self.src, self.dst)
        if kind is None:
            kind = "identity" if self.src == self.dst else "narrow"
        text = f"{self.src} -> {self.dst}, {kind}"
        if self.grad_partial:
            text += f", backward {collectives.backward_kind_of(self.src, self.dst, True)}"
        if self.size is not None and isinstance(self.src, Shard) and self.size % self.comm.world_size:
            text += f", uneven {self.size} ({'/'.join(map(str, chunk_sizes(self.size, self.comm.world_size)))})"
        return text


class _LinearSavingShard(torch.autograd.Function):
    """``linear(x_full, weight, bias)`` that saves ``x_shard`` (this rank's chunk of ``x_full``
    along ``dim``) instead of ``x_full``, and all-gathers it again in backward for the weight's
    gradient. The input's gradient is computed from the output's and the weight alone; it flows
    to ``x_full`` (whose edges reduce-scatter it back to the shard), never to ``x_shard``."""

    @staticmethod
    def forward(ctx: Any, x_full: Tensor, x_shard: Tensor, weight: Tensor, bias: Tensor | None, dim: int,
                comm: Comm) -> Tensor:
        ctx.save_for_backward(x_shard, weight)
        ctx.dim, ctx.comm = dim, comm
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x_shard, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            x_full = collectives.regather(x_shard, ctx.dim, ctx.comm)
            # (..., out) x (..., in) summed over every leading dim -> (out, in)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(x_full.reshape(-1, x_full.shape[-1]))
        if ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, None, grad_weight, grad_bias, None, None


class LinearOnGatheredInput(nn.Module):
    """A column-parallel ``linear`` whose input was all-gathered from ``S(dim)`` (sequence
    parallelism): autograd keeps the input's shard, 1/N of the gathered input, and backward
    gathers it again, as Megatron-LM does (``autotp/passes/save_shards.py`` puts it in place).
    Its forward is the plain ``linear``; its backward adds one all-gather of the input shard."""

    def __init__(self, dim: int, comm: Comm) -> None:
        super().__init__()
        self.dim = dim
        self.comm = comm

    def forward(self, x_full: Tensor, x_shard: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x_full, weight, bias)
        return _LinearSavingShard.apply(x_full, x_shard, weight, bias, self.dim, self.comm)

    def extra_repr(self) -> str:
        return f"input saved as S({self.dim}), all-gathered again in backward"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose table is split by rows (vocabulary) across ranks; output is ``Partial``.

    ``weight`` is this rank's shard, rows ``[vocab_start, vocab_start + weight.shape[0])`` of the
    global ``(num_embeddings, embedding_dim)`` table; the Parameter object is kept as is (not
    copied), so ``.parameters()`` yields the real local shard. ``padding_idx`` is global (negative
    values count from the end); ``local_padding_idx`` is its row in this shard, or None when that
    row lives on another rank (which then keeps its gradient zero).

    ``forward(ids)`` returns this rank's summand: the looked-up rows for ids it owns and zeros for
    the others. The compiler follows it with ``Redistribute(P, R)`` (an all-reduce).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        num_embeddings: int,
        vocab_start: int,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise AutoTPError(f"embedding weight shard must be 2-d, got shape {tuple(weight.shape)}")
        local_rows = weight.shape[0]
        if vocab_start < 0 or vocab_start + local_rows > num_embeddings:
            raise AutoTPError(
                f"weight shard rows [{vocab_start}, {vocab_start + local_rows}) do not fit a vocabulary "
                f"of {num_embeddings}; check the shard's vocab_start and the global num_embeddings"
            )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise AutoTPError(f"padding_idx {padding_idx} is outside the vocabulary of {num_embeddings}")
            padding_idx %= num_embeddings
        self.weight = weight
        self.num_embeddings = num_embeddings
        self.embedding_dim = weight.shape[1]
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + local_rows
        self.padding_idx = padding_idx
        self.local_padding_idx: int | None = (
            padding_idx - vocab_start
            if padding_idx is not None and vocab_start <= padding_idx < self.vocab_end
            else None
        )

    def forward(self, ids: Tensor) -> Tensor:
        # Imported here: the op family module registers rules on import, and this keeps
        # ``autotp.layers`` importable on its own.
        from autotp.ops.embedding import vocab_parallel_embedding

        # ids (*), weight (V/N, H) -> (*, H), zeros where ids fall outside [vocab_start, vocab_end).
        # The op takes the *global* padding index and maps it to the local row (or drops it) itself.
        return vocab_parallel_embedding(ids, self.weight, self.vocab_start, padding_idx=self.padding_idx)

    def extra_repr(self) -> str:
        text = (
            f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, {self.vocab_end})"
        )
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx} (local {self.local_padding_idx})"
        return text + ", output=P"



class _ShardedSoftmaxFunction(torch.autograd.Function):
    """(Log-)softmax along a dim whose chunks live on different ranks.

    Forward: the row maximum and the row sum of ``exp(x - max)`` are all-reduced (max, then sum),
    and each rank normalizes its chunk. Backward (``y`` the output, ``g`` its gradient, both this
    rank's chunk): softmax ``dx = y * (g - sum(g * y))``, log-softmax ``dx = g - exp(y) * sum(g)``,
    where the row sums run over the whole row, so they are all-reduced too (one, in backward).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, log: bool, comm: Comm) -> Tensor:
        from autotp.ops.norm import softmax_from_stats

        with torch.no_grad():
            row_max = collectives.reduce_over_ranks(x.amax(dim, keepdim=True), comm, "max")
            row_sum = collectives.reduce_over_ranks((x - row_max).exp().sum(dim, keepdim=True), comm, "sum")
        out = softmax_from_stats(x, dim, row_max, row_sum, log)
        ctx.save_for_backward(out)
        ctx.dim, ctx.log, ctx.comm = dim, log, comm
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        (out,) = ctx.saved_tensors
        if ctx.log:
            total = collectives.reduce_over_ranks(grad.sum(ctx.dim, keepdim=True), ctx.comm, "sum", backward=True)
            return grad - out.exp() * total, None, None, None
        total = collectives.reduce_over_ranks((grad * out).sum(ctx.dim, keepdim=True), ctx.comm, "sum",
                                              backward=True)
        return out * (grad - total), None, None, None


class ShardedSoftmax(nn.Module):
    """``softmax`` / ``log_softmax`` over ``dim`` of a tensor sharded along ``dim``: output ``S(dim)``.

    ``dtype`` casts the input first, as ``F.softmax(x, dim, dtype=...)`` does.
    """

    def __init__(self, dim: int, log: bool, comm: Comm, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim, self.log, self.comm, self.dtype = dim, log, comm, dtype

    def forward(self, x: Tensor) -> Tensor:
        if self.dtype is not None:
            x = x.to(self.dtype)
        return _ShardedSoftmaxFunction.apply(x, self.dim, self.log, self.comm)

    def extra_repr(self) -> str:
        return f"{'log_softmax' if self.log else 'softmax'}, dim={self.dim}, all_reduce x2 (row max, row sum)"


class VocabGather(nn.Module):
    """``gather(x, dim, index)`` with ``x`` split along ``dim`` (``size`` indices in all, chunks by
    :func:`~autotp.placement.chunk_range`): output ``P`` (this rank's picks, zeros where the index
    falls on another rank)."""

    def __init__(self, dim: int, size: int, comm: Comm) -> None:
        super().__init__()
        self.dim, self.size = dim, size
        self.start = chunk_range(size, comm.rank, comm.world_size)[0]

    def forward(self, x: Tensor, index: Tensor) -> Tensor:
        from autotp.ops.indexing import vocab_gather

        return vocab_gather(x, self.dim % x.dim(), index, self.start)


class VocabParallelLoss(nn.Module):
    """This rank's summand of ``F.cross_entropy`` / ``F.nll_loss`` over class-sharded scores.

    ``input`` is this rank's chunk of the ``classes`` (:func:`~autotp.placement.chunk_range`, so
    ranks may hold unequal chunks): logits for cross-entropy (normalized here by
    :class:`ShardedSoftmax`) or log-probabilities for ``nll_loss`` (``from_logits=False``). Class
    indices, ``ignore_index``, class ``weight`` (whole, Replicate), ``label_smoothing``, class
    probabilities as targets (sharded like ``input``) and every ``reduction`` follow torch's
    definitions term by term, so the ranks' results sum to the one-process loss. The denominators
    (valid targets, their weights) come from the replicated targets, identical on every rank. The
    class weight arrives as the solver placed it: whole (``R``) or, with ``weight_sharded``, this
    rank's chunk of the classes (then only ``sum``/``none`` reductions, which need no denominator).

    With ``classes_sharded=False`` the input is split along another dim (rows, ``rows_per_rank``
    ranks' worth of them in the whole batch): each rank's loss is a plain local loss over its rows,
    and only the constant denominator of a ``mean`` over probability targets (the row count, which
    torch derives from the local shape) is scaled to the global one. A ``mean`` over class indices
    divides by the number of valid targets, a partial sum the solver never plans to divide by.
    """

    def __init__(self, comm: Comm, *, classes: int, from_logits: bool, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, weight_sharded: bool = False,
                 classes_sharded: bool = True, rows_per_rank: int = 1) -> None:
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise AutoTPError(f"cross_entropy reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        if weight_sharded and reduction == "mean":
            # the mean divides by the weights of all targets, which a rank holding a chunk lacks;
            # the solver never plans it (the division of two partial sums is infeasible)
            raise AutoTPError("a class-sharded weight cannot be used with reduction='mean'")
        self.comm, self.from_logits = comm, from_logits
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.weight_sharded, self.classes_sharded, self.rows_per_rank = weight_sharded, classes_sharded, rows_per_rank
        #: the global number of classes; a rank holds its chunk of them (uneven when N does not divide it)
        self.classes = classes

    def forward(self, input: Tensor, target: Tensor, weight: Tensor | None = None) -> Tensor:
        class_dim = 0 if input.dim() == 1 else 1
        if not self.classes_sharded:
            return self._rows_sharded(input, target, weight, class_dim)
        logp = _ShardedSoftmaxFunction.apply(input, class_dim, True, self.comm) if self.from_logits else input
        local_classes = input.shape[class_dim]
        start = chunk_range(self.classes, self.comm.rank, self.comm.world_size)[0]
        if target.is_floating_point():
            return self._probability_targets(logp, target, weight, class_dim, start)
        valid = target != self.ignore_index
        safe_target = target.masked_fill(~valid, 0)
        # (N, C/n, ...) -> (N, ...): this rank's log-probability of each target it holds, else 0
        picked = VocabGather(class_dim, self.classes, self.comm)(logp, safe_target.unsqueeze(class_dim)).squeeze(class_dim)
        if weight is None:
            target_weight = valid.to(logp.dtype)
        elif self.weight_sharded:  # this rank's targets' weights (zeros elsewhere, where picked is 0 too)
            target_weight = VocabGather(0, self.classes, self.comm)(weight, safe_target.flatten()).view_as(safe_target) * valid
        else:
            target_weight = weight[safe_target] * valid
        nll = -picked * target_weight
        if self.reduction == "mean":
            nll = nll.sum() / target_weight.sum()
        elif self.reduction == "sum":
            nll = nll.sum()
        if not self.label_smoothing:
            return nll
        if weight is not None:
            shape = [1] * logp.dim()
            shape[class_dim] = local_classes
            smooth = -(logp * self._local_weight(weight, start, local_classes).view(shape)).sum(class_dim)
        else:
            smooth = -logp.sum(class_dim)
        smooth = smooth.masked_fill(~valid, 0)
        if self.reduction == "mean":
            smooth = smooth.sum() / (target_weight.sum() if weight is not None else valid.sum())
        elif self.reduction == "sum":
            smooth = smooth.sum()
        return (1 - self.label_smoothing) * nll + smooth * (self.label_smoothing / self.classes)

    def _rows_sharded(self, input: Tensor, target: Tensor, weight: Tensor | None, class_dim: int) -> Tensor:
        """Rows split across ranks, classes whole: the local loss, with a global row count."""
        if not target.is_floating_point():
            if self.reduction == "mean":
                raise AutoTPError("a mean over class-index targets split by rows needs the global count of valid "
                                  "targets; this plan should not have been made (please report it)")
            loss_fn = F.cross_entropy if self.from_logits else F.nll_loss
            kwargs = {"label_smoothing": self.label_smoothing} if self.from_logits else {}
            return loss_fn(input, target, weight, ignore_index=self.ignore_index, reduction=self.reduction, **kwargs)
        logp = input.log_softmax(class_dim) if self.from_logits else input
        return self._probability_targets(logp, target, weight, class_dim, 0)

    def _probability_targets(self, logp: Tensor, target: Tensor, weight: Tensor | None, class_dim: int,
                             start: int) -> Tensor:
        """Class probabilities as targets (sharded like ``logp``): ``-sum_c w_c t_c log p_c``."""
        local_classes = logp.shape[class_dim]
        if self.label_smoothing:
            target = target * (1 - self.label_smoothing) + self.label_smoothing / self.classes
        terms = logp * target
        if weight is not None:
            shape = [1] * logp.dim()
            shape[class_dim] = local_classes
            terms = terms * self._local_weight(weight, start, local_classes).view(shape)
        loss = -terms.sum(class_dim)
        if self.reduction == "mean":  # torch divides by the number of rows: numel / classes
            return loss.sum() / (logp.numel() // local_classes * self.rows_per_rank)
        if self.reduction == "sum":
            return loss.sum()
        return loss

    def _local_weight(self, weight: Tensor, start: int, local_classes: int) -> Tensor:
        """The class weights of this rank's classes."""
        return weight if self.weight_sharded or not self.classes_sharded else weight[start:start + local_classes]

    def extra_repr(self) -> str:
        kind = "cross_entropy" if self.from_logits else "nll_loss"
        split = "classes sharded (vocab-parallel)" if self.classes_sharded else "rows sharded"
        return (f"{kind}, {split}, ignore_index={self.ignore_index}, reduction={self.reduction}, "
                f"label_smoothing={self.label_smoothing}, output=P")
