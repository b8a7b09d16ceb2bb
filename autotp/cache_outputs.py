"""Which outputs of a Dynamo graph are KV-cache entries, decided from the graph alone.

``torch.compile(model, backend="autotp")`` has no model boundary of its own: Dynamo rebuilds the
user's return value and the cache's attributes from the graph's flat outputs, so the callable the
backend returns must decide, per output, whether to gather it (what the user reads: logits, hidden
states) or to leave it a sharded stand-in (a KV-cache entry the next graph receives). Planning is
untouched by this; only the gather after the call is.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx

from autotp.context import shard_of
from autotp.errors import AutoTPError

#: concatenations a cache layer grows by (the Dynamo graph's torch-level op, or its ATen form)
_CONCATENATIONS = (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default)


def cache_entry_leaves(gm: torch.fx.GraphModule, cache_inputs: Iterable[torch.fx.Node]) -> frozenset[int]:
    """Indices, among the output's node leaves (in order, as ``backend.ShardedOutput.leaf``
    counts them), of the outputs that are KV-cache entries.

    Rule: an output is a cache entry when it is a concatenation (``torch.cat``) one of whose
    operands is a cache source, possibly sliced afterwards (``t[...]``: a sliding-window layer
    keeps its last positions), or a cache source returned as it came in. A cache source is a graph
    input that arrived as a cache entry (``cache_inputs``: the placeholders whose value is a
    sharded stand-in an earlier graph returned) or an empty 1-D ``(0,)`` tensor, what a fresh ``DynamicCache`` layer starts from
    (``DynamicLayer.lazy_initialization``; the cat rule in ``autotp/ops/indexing.py`` skips it).
    That is how transformers' ``DynamicCache`` (and its sliding-window and encoder-decoder layers)
    grows: prefill ``cat([tensor([]), k], -2)``, decode ``cat([cached_k, k], -2)``.

    Limits. A cache updated in place (``StaticCache``'s ``index_copy_`` into preallocated
    buffers) or state not grown by concatenation (Mamba's conv / SSM states) is not recognized:
    it is gathered, which is correct and costs one all-gather per entry per call. A user-visible
    output built by concatenating onto the cache would be taken for a cache entry and reach the
    user as a stand-in, which reads as NaN (and a graph compiled on a stand-in that is later given
    a plain tensor in its place raises ``AutoTPError``): never a silently wrong number."""
    sources = set(cache_inputs)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves: list[torch.fx.Node] = []
    torch.fx.node.map_arg(output.args[0], leaves.append)
    return frozenset(k for k, node in enumerate(leaves) if _grown_cache(node, sources))


def _grown_cache(node: torch.fx.Node, sources: set[torch.fx.Node]) -> bool:
    """Is ``node`` a cache source, a concatenation onto one, or a slice of either (see above)?"""
    while node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[0], torch.fx.Node) and _is_tensor(node.args[0]):
        node = node.args[0]
    if node in sources:  # an entry returned as it came in
        return True
    if node.op != "call_function" or node.target not in _CONCATENATIONS or not node.args:
        return False
    operands = node.args[0] if isinstance(node.args[0], (tuple, list)) else ()
    return any(isinstance(a, torch.fx.Node) and (a in sources or _is_empty_1d(a)) for a in operands)


def _value(node: torch.fx.Node) -> object:
    """The example value Dynamo (``example_value``) or a trace (``val``) recorded for ``node``."""
    return node.meta.get("example_value", node.meta.get("val"))


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(_value(node), torch.Tensor)


def _is_empty_1d(node: torch.fx.Node) -> bool:
    value = _value(node)
    return isinstance(value, torch.Tensor) and tuple(value.shape) == (0,)


def refuse_spent_standins(user_inputs: Iterable[tuple[str, object]]) -> None:
    """Refuse a graph input made eagerly from a cache entry this entry left sharded.

    A stand-in reads as NaN. Eager code that reorders, crops or copies the cache (beam search's
    ``reorder_cache`` is ``index_select`` on every entry) turns it into a plain tensor of NaN,
    the shard it carried lost; Dynamo recompiles for the new strides, and that graph would read
    the NaN as a replicated cache and generate garbage without an error (seen: ``num_beams=2`` on a
    tiny GPT-NeoX gave 2 tokens one process does not give, then stopped). So a floating
    input that is entirely NaN and not a stand-in is refused here, at that compile, before any
    plan (every rank sees the same input, so all raise). ``user_inputs``: (Dynamo source, value)
    of the graph's non-parameter inputs. The ``parallelize_model`` entry refuses the same change
    earlier, at its boundary (``autotp.inputs.CacheWatch``)."""
    for source, value in user_inputs:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0 \
                and shard_of(value) is None and bool(torch.isnan(value).all()):
            raise AutoTPError(
                f"graph input {source} is all NaN: it looks like a KV-cache entry that "
                "torch.compile(backend='autotp') returned sharded (each rank holds only its heads; the tensor "
                "itself reads as NaN) and that was then changed outside the model (cloned, cropped or reordered "
                "eagerly, as beam search does). Keep the cache the compiled model returned as it is, start a new "
                "one, or pass use_cache=False (for beam search, num_beams=1, or parallelize_model, whose cache "
                "follows the library's reorder)."
            )
