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
"""

from __future__ import annotations

from torch import Tensor, nn

from autotp import collectives
from autotp.collectives import Comm
from autotp.errors import AutoTPError
from autotp.placement import Placement

__all__ = ["Redistribute", "VocabParallelEmbedding", "vocab_range"]


class Redistribute(nn.Module):
    """Change the placement of a tensor: ``src -> dst`` with the conjugate collective in backward.

    A thin module around :func:`autotp.collectives.redistribute` so that the plan's communication
    shows up by name in the rewritten graph (``print(gm)`` lists e.g. ``S(2) -> R, all_gather``).
    """

    def __init__(self, src: Placement, dst: Placement, comm: Comm, grad_partial: bool = False) -> None:
        super().__init__()
        # Validate now rather than at the first forward: raises AutoTPError for R/S -> P and for
        # grad_partial with a non-Replicate destination.
        collectives.backward_kind_of(src, dst, grad_partial)
        self.src = src
        self.dst = dst
        self.comm = comm
        self.grad_partial = grad_partial

    def forward(self, x: Tensor) -> Tensor:
        return collectives.redistribute(x, self.src, self.dst, self.comm, self.grad_partial)

    def extra_repr(self) -> str:
        kind = collectives.kind_of(self.src, self.dst)
        if kind is None:
            kind = "identity" if self.src == self.dst else "narrow"
        text = f"{self.src} -> {self.dst}, {kind}"
        if self.grad_partial:
            text += f", backward {collectives.backward_kind_of(self.src, self.dst, True)}"
        return text


def vocab_range(num_embeddings: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of a ``num_embeddings``-row table that ``rank`` holds.

    ``torch.chunk`` semantics: chunks of ``ceil(V / N)`` rows, the last ones shorter or empty. The
    vocabulary need not divide evenly: the output is Partial either way.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise AutoTPError(f"invalid rank {rank} for world size {world_size}")
    chunk = -(-num_embeddings // world_size)
    start = min(rank * chunk, num_embeddings)
    return start, min(start + chunk, num_embeddings)


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

