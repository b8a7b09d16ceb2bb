"""Which Dynamo nodes can carry out a local rewrite that replaces their computation.

Most local rewrites adjust a node's arguments (``shape``, ``split_sizes``, ``slice_bounds``,
``replicated_share``) and apply to any node. The others replace or rescale the node's result, which
the rewrite pass (:mod:`autotp.passes.rewrite`) knows how to do only for some Dynamo targets:

* ``vocab_parallel`` (embedding rows on each rank): ``F.embedding``;
* ``sharded_softmax`` (softmax over a sharded dim, row statistics all-reduced): ``F.softmax``,
  ``F.log_softmax``, ``torch.softmax``, ``torch.log_softmax``, the ``softmax``/``log_softmax``
  methods, and ``F.cross_entropy`` (vocab-parallel cross-entropy);
* ``vocab_gather`` (gather along a sharded dim into a Partial): ``torch.gather`` and the
  ``gather`` method, ``F.nll_loss`` and ``F.cross_entropy``;
* ``sharded_mean`` (a mean over a sharded dim, scaled to this rank's share): ``torch.mean`` and the
  ``mean`` method, whose result is the mean itself (inside a composite such as ``F.layer_norm`` it is
  not, so the composite keeps its dim whole).

The solver asks :func:`can_host` before it accepts such a candidate, so it never picks a plan
that the rewrite cannot carry out (a softmax inside ``scaled_dot_product_attention``, say, keeps
its dim whole instead).
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from autotp.ops.embedding import VOCAB_PARALLEL
from autotp.ops.indexing import VOCAB_GATHER
from autotp.ops.norm import SHARDED_SOFTMAX
from autotp.ops.reduction import SHARDED_MEAN

SOFTMAX_FUNCTIONS = {F.softmax: False, F.log_softmax: True, torch.softmax: False, torch.log_softmax: True,
                     torch.Tensor.softmax: False, torch.Tensor.log_softmax: True}
SOFTMAX_METHODS = {"softmax": False, "log_softmax": True}
GATHER_FUNCTIONS = {torch.gather, torch.Tensor.gather}
MEAN_FUNCTIONS = {torch.mean, torch.Tensor.mean}

#: tag -> (functions, method names) that can host it
HOSTS: dict[str, tuple[frozenset, frozenset]] = {
    VOCAB_PARALLEL: (frozenset({F.embedding}), frozenset()),
    SHARDED_SOFTMAX: (frozenset(SOFTMAX_FUNCTIONS) | {F.cross_entropy}, frozenset(SOFTMAX_METHODS)),
    VOCAB_GATHER: (frozenset(GATHER_FUNCTIONS) | {F.nll_loss, F.cross_entropy}, frozenset({"gather"})),
    SHARDED_MEAN: (frozenset(MEAN_FUNCTIONS), frozenset({"mean"})),
}


def needs_host(tag: str | None) -> bool:
    """Whether the local rewrite ``tag`` replaces its node's function (see the module docstring)."""
    return tag in HOSTS


def can_host(tag: str, node: torch.fx.Node) -> bool:
    """Whether the rewrite pass can apply ``tag`` to the Dynamo node ``node``."""
    functions, methods = HOSTS[tag]
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


def hosted_tags(node: torch.fx.Node) -> frozenset[str]:
    """The replacing local rewrites ``node`` can carry out."""
    return frozenset(tag for tag in HOSTS if can_host(tag, node))
