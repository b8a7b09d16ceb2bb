"""Random ops of another tensor's shape or values: rand_like, bernoulli, native_dropout.

* Replicate (or Partial, where only ``x``'s shape is read) inputs -> Replicate: every rank draws
  the same numbers from the default generator, which the user seeds alike on every rank.
* Shard inputs -> the same Shard, with the local rewrite ``rank_rng`` (:data:`RANK_RNG`): each
  rank draws the numbers of *its* chunk from its own stream (``autotp/rng.py``). The values differ
  from one process's (no per-element stream exists there either), the distribution is the same:
  every element is an independent draw. Fused (strided) shards pass through the same way.
* ``native_dropout(x, p, train=True)`` of a Partial ``x`` is Partial with a Replicate mask: the
  mask does not depend on ``x``'s values, so scaling every summand by the same mask scales the sum.
  With ``train=False`` it is the identity and keeps any placement.
* ``bernoulli(x)`` reads ``x``'s values as probabilities, so a Partial ``x`` is infeasible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autotp.ops._common import R, aten_ops, same
from autotp.ops.registry import POINTWISE, Candidate, OpCall, register, register_local, reject
from autotp.placement import Partial, Placement, Shard

RANK_RNG = "rank_rng"


@register(*aten_ops("rand_like.default", "randn_like.default", "randint_like.default",
                    "randint_like.low_dtype", "bernoulli.p", "bernoulli_.float"), strided=POINTWISE)
def random_like_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """Random numbers of ``x``'s shape: a shard draws its own (``rank_rng``), R or P draw alike."""
    p = inputs[0]
    if isinstance(p, Shard):
        return [Candidate(p, RANK_RNG)]
    return same(R)


@register(*aten_ops("bernoulli.default"), strided=POINTWISE)
def bernoulli_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """bernoulli(probabilities): elementwise in ``x``'s values."""
    p = inputs[0]
    if isinstance(p, Partial):
        return reject("bernoulli reads its input's values: a Partial sum is not a probability")
    if isinstance(p, Shard):
        return [Candidate(p, RANK_RNG)]
    return same(R)


@register(*aten_ops("native_dropout.default"), strided=POINTWISE)
def native_dropout_rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
    """native_dropout(x, p, train) -> (out, mask)."""
    p = inputs[0]
    if op.arg(2, "train") is False:
        # identity: out = x, mask = ones (a constant of x's shape)
        return same((p, p if isinstance(p, Shard) else R))
    if isinstance(p, Shard):
        return [Candidate((p, p), RANK_RNG)]
    if isinstance(p, Partial):
        return same((p, R))  # every summand scaled by the same mask
    return same((R, R))


@register_local(RANK_RNG)
def rank_rng_local(target: Any, args: tuple, kwargs: dict, in_placements: Sequence[Any],
                   out_placement: Any, rank: int, world_size: int) -> Any:
    """Run the op on this rank's own stream (the one-process stand-in for ``autotp/rng.py``)."""
    from autotp.rng import rank_stream

    with rank_stream(rank, torch.device("cpu")):
        return target(*args, **kwargs)

