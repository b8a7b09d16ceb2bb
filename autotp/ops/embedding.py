"""Embedding lookup, including the vocab-parallel form.

``embedding(weight (V, H), indices (...)) -> (..., H)``:

* weight R, indices R -> R; weight R, indices S(d) -> S(d) (each rank looks up its own tokens);
* weight S(1) (hidden split) is *not* offered: a looked-up table is sharded by rows only. A
  column split would be correct (each rank's columns of every row, output S(last)) and its
  all-gather moves half the bytes of the vocab-parallel all-reduce, but it does not compose with a
  tied lm_head or with vocab-parallel cross-entropy, and it makes the plan of a tied and an untied
  model differ. This is the one place a rule withholds a valid candidate on purpose;
* weight S(0) (vocab split), indices R -> Partial with ``local="vocab_parallel"``: each rank looks
  up the rows it holds and returns zeros for tokens outside its range, so the rank results add up;
* weight P, indices R -> P (the lookup is linear in the weight).

Indices are integers and are never Partial.

A vocabulary that the world size does not divide (GPT-2's 50257 at tp=2) is still split by rows:
:func:`vocabulary_sizes` names the table sizes found in a graph, and the backend offers parameters
a Shard of dims of those sizes even when uneven (``placement.shard_candidates``), with
``torch.chunk``'s chunks (rows 25129 / 25128). The lookup masks ids outside each rank's rows as
for an even split; the logits of a tied or untied ``lm_head`` come out sharded the same way and are
gathered with the padded all-gather of :mod:`autotp.collectives`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from autotp.ops._common import P, R, aten_ops, out_is_float, same
from autotp.ops.registry import Candidate, OpCall, register, register_local, reject
from autotp.placement import Partial, Placement, Replicate, Shard

VOCAB_PARALLEL = "vocab_parallel"


def vocabulary_sizes(graph: torch.fx.Graph, world_size: int) -> frozenset[int]:
    """The row counts of the tables ``aten.embedding`` looks up in ``graph`` that ``world_size``
    does not divide: the dims that may be split unevenly (embedding rows, a tied or untied
    ``lm_head``'s rows, a decoder bias, the logits' class dim all have this size)."""
    found = set()
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.embedding.default and n.args:
            value = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            if isinstance(value, torch.Tensor) and value.dim() == 2 and isinstance(value.shape[0], int) \
                    and value.shape[0] % world_size:
                found.add(int(value.shape[0]))
    return frozenset(found)


def vocab_parallel_embedding(indices: torch.Tensor, weight_local: torch.Tensor, vocab_start: int,
                             padding_idx: int | None = None) -> torch.Tensor:
    """Look up ``indices`` in the rows ``[vocab_start, vocab_start + len(weight_local))`` only.

    Tokens outside this rank's range give zero rows, so summing the results of all ranks (an
    all-reduce) gives the full embedding. ``padding_idx`` is a global, non-negative row index (or
    None); it is passed on as the local row when it falls in this shard, else dropped (it only
    affects the gradient).
    """
    rows = weight_local.shape[0]
    outside = (indices < vocab_start) | (indices >= vocab_start + rows)
    local = (indices - vocab_start).masked_fill(outside, 0)
    local_pad = None
    if padding_idx is not None and vocab_start <= padding_idx < vocab_start + rows:
        local_pad = padding_idx - vocab_start
    out = F.embedding(local, weight_local, padding_idx=local_pad)  # (..., H)
    return out.masked_fill(outside.unsqueeze(-1), 0)


@register_local(VOCAB_PARALLEL)
def vocab_parallel_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                         out_placement: Any, rank: int, world_size: int) -> torch.Tensor:
    """``aten.embedding(weight_local, indices, padding_idx=-1, ...)`` on a vocab-sharded weight."""
    weight, indices = args[0], args[1]
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    return vocab_parallel_embedding(indices, weight, rank * weight.shape[0],  # (ground truth: even shards)
                                    padding_idx if padding_idx is not None and padding_idx >= 0 else None)


@register(*aten_ops("embedding.default"))
def embedding_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """embedding(weight, indices, padding_idx, ...): see the module docstring."""
    pw, pi = inputs[0], inputs[1]
    if isinstance(pi, Partial):
        return reject("embedding indices cannot be Partial")
    if isinstance(pi, Shard):
        if isinstance(pw, Replicate):
            return same(pi)
        return reject(f"sharded indices need a Replicate weight, got {pw}")
    if isinstance(pw, Replicate):
        return same(R)
    if isinstance(pw, Partial):
        return same(P)
    if pw.dim == 1:
        return reject("embedding tables are sharded by rows (vocab) only; see the module docstring")
    if not out_is_float(op):
        return reject("a vocab-parallel lookup must be floating to be Partial")
    return [Candidate(P, local=VOCAB_PARALLEL)]
