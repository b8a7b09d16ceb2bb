"""Embedding lookup, including the vocab-parallel form.

``embedding(weight (V, H), indices (...)) -> (..., H)``:

* weight R, indices R -> R; weight R, indices S(d) -> S(d) (each rank looks up its own tokens);
* weight S(1) (column split), indices R -> S(last): each rank looks up its own columns of every
  row. The rule offers it for every table; which tables may *take* it is the backend's choice of
  parameter placements (:func:`vocabulary_tables`, below), not this rule's;
* weight S(0) (vocab split), indices R -> Partial with ``local="vocab_parallel"``: each rank looks
  up the rows it holds and returns zeros for tokens outside its range, so the rank results add up;
* weight P, indices R -> P (the lookup is linear in the weight);
* a strided, head or grouped split of the weight: rejected (the lookup has no local form for them).

Indices are integers and are never Partial.

Which tables are split by columns. A *vocabulary* - a table :func:`vocabulary_tables` finds looked
up by the graph's own inputs (token ids as given, viewed or copied; BERT's position ids, a buffer,
count too) - is offered row splits only (:func:`rows_only`, in ``backend._solve``). Its column
split would be correct, and its all-gather moves half the bytes of the vocab-parallel all-reduce,
but it does not compose with a tied lm_head (whose contraction over split columns leaves the logits
partial) or with vocab-parallel cross-entropy (which reads the head's vocab-split logits), and it
would make the plan of a tied and an untied model differ. Every other table - T5's relative-attention bias, a
(32 buckets, heads) table looked up by buckets the graph computes from positions - may take either
split: the solver prices both. For T5's table the column split is what attention wants (its output
``(q, k, heads)`` is permuted onto the scores' heads dim), so block 0 of each stack issues no
collective for it; a row split would leave a partial lookup that a reduce-scatter puts onto the
heads.

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
from autotp.ops.fused import behind_brackets
from autotp.ops.registry import Candidate, OpCall, register, register_local, reject
from autotp.ops.shape import VIEW_OPS
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


#: ops that hand their first argument's values on unchanged (views and copies): token ids keep
#: being token ids through them
_ID_PRESERVING = {*VIEW_OPS, *aten_ops(
    "clone.default", "alias.default", "alias_copy.default", "unsqueeze.default", "unsqueeze_copy.default", "squeeze.dim",
    "squeeze_copy.dim", "expand.default", "expand_copy.default", "slice.Tensor", "slice_copy.Tensor",
    "_to_copy.default")}


def vocabulary_tables(graph: torch.fx.Graph) -> frozenset[torch.fx.Node]:
    """The tables (placeholders) that ``aten.embedding`` looks up in ``graph`` by one of the graph's
    inputs, as given or through views and copies: the token (and input position) embeddings, which
    are split by rows only (see the module docstring). A table looked up by indices the graph
    computes (T5's relative-position buckets) is not one."""

    def is_input(x: Any) -> bool:
        while isinstance(x, torch.fx.Node):
            x = behind_brackets(x)
            if x.op == "placeholder":
                return True
            if x.op != "call_function" or x.target not in _ID_PRESERVING or not x.args:
                return False
            x = x.args[0]
        return False

    found = set()
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.embedding.default and len(n.args) > 1 \
                and isinstance(n.args[0], torch.fx.Node) and is_input(n.args[1]):
            found.add(behind_brackets(n.args[0]))
    return frozenset(found)


def rows_only(options: list[tuple[Placement, float]]) -> list[tuple[Placement, float]]:
    """A vocabulary's placement options (:func:`vocabulary_tables`): of ``options`` (placement,
    memory cost), the replica and the row splits."""
    return [(p, cost) for p, cost in options if isinstance(p, Replicate) or p.dim == 0]


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
    if type(pw) is not Shard:  # a strided, head or grouped split of a table: the lookup has no local form
        return reject(f"an embedding table is split by plain rows or columns only, got {pw}")
    if pw.dim == 1:
        if op.tensor_inputs[0].shape[1] % op.world_size:
            return reject("an uneven column split of an embedding table is not offered")
        return same(Shard(op.out.ndim - 1))  # each rank's columns of the rows looked up
    if not out_is_float(op):
        return reject("a vocab-parallel lookup must be floating to be Partial")
    return [Candidate(P, local=VOCAB_PARALLEL)]
