"""The rule registry: per-op placement rules keyed by ATen overload.

A *rule* is a pure function ``rule(op, inputs) -> list[Candidate]``:

* ``op`` is an :class:`OpCall` — the ATen overload, its arguments with every tensor replaced by a
  :class:`TensorSpec` (global shape and dtype), the output spec(s), and the world size;
* ``inputs`` holds the placement of each tensor input, in the order of ``op.tensor_inputs``
  (pytree order over ``(args, kwargs)``, so tensors inside lists such as ``cat``'s count too).

It returns the output placements the op can produce *from exactly those input placements*, best
first. An empty list means "infeasible"; return :func:`reject` to say why (the reason goes into the
solver trace). Rules never redistribute: the solver inserts collectives between Dynamo nodes and
asks the rule again with other input placements. Rules never touch the graph and never import
``torch.distributed``.

A candidate may name a *local rewrite* (``Candidate.local``): the per-rank program must then run a
different local computation than the plain op on local shards (``"shape"``: constant sizes on the
sharded dim are divided by the world size; ``"vocab_parallel"``: embedding rows are looked up with a
per-rank offset and masked). Local implementations used by the ground-truth tests are registered
with :func:`register_local`; the runtime equivalents live in ``autotp/passes/rewrite.py`` and
``autotp/layers.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autotp.placement import GroupedShard, HeadShard, Partial, Placement, Replicate, Shard, StridedShard

PlacementOut = Placement | tuple[Placement | None, ...] | None


#: ``node.meta`` key of a constant's ``get_attr`` node in the shadow graph: the flat values of a
#: small integer constant (``autotp/passes/decompose.py`` records it, ``TensorSpec.value`` carries it)
CONSTANT_VALUE = "autotp_constant_value"


@dataclass(frozen=True)
class TensorSpec:
    """Global (logical) shape and dtype of a tensor argument or result. ``symbolic``: the dims
    whose size is symbolic in a dynamic-shape graph (never sharded: the graph runs at every size).
    ``value``: the flat values of a small integer constant (a list index such as Falcon's
    ``qkv[..., [-2], :]``, recorded by decompose as ``CONSTANT_VALUE``), None otherwise."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    symbolic: frozenset[int] = frozenset()
    value: tuple[int, ...] | None = None

    def shardable(self, dim: int, placement: Placement | None = None) -> bool:
        """False for a symbolic dim (see ``symbolic``), unless ``placement`` is a StridedShard of
        equal segments: rules place one on a symbolic dim only with a static segment size (a
        dynamic batch merged with sharded heads, ``autotp/ops/shape.py``), so every size the graph
        runs at is a whole number of segments, each of which divides by N."""
        if dim not in self.symbolic:
            return True
        return isinstance(placement, StridedShard) and placement.segment_size is not None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * (torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point
                             else torch.iinfo(self.dtype).bits // 8 if self.dtype != torch.bool else 1)


@dataclass
class OpCall:
    """What a rule sees of one ATen call."""

    target: Any
    args: tuple
    kwargs: dict
    out: TensorSpec | tuple | None
    world_size: int
    tensor_inputs: list[TensorSpec] = field(init=False)

    def __post_init__(self) -> None:
        self.tensor_inputs = _tensor_specs((self.args, self.kwargs), [])

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional-or-keyword argument lookup (ATen schemas allow both)."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


def _tensor_specs(value: Any, out: list[TensorSpec]) -> list[TensorSpec]:
    """Append the TensorSpecs in ``value`` to ``out``, in pytree order: through tuples, lists and
    dicts (in insertion order), the containers of an ATen call's arguments. (Not ``tree_flatten``:
    its generic walk was ~3% of a solve's CPU, one OpCall per ATen node.)"""
    if isinstance(value, TensorSpec):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensor_specs(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensor_specs(v, out)
    return out


@dataclass(frozen=True)
class Candidate:
    """One output placement a rule can produce, and the local rewrite it needs (if any).

    ``collectives`` lists the collectives the local rewrite itself issues, as ``(kind, bytes)``
    with the bytes each rank hands over (a softmax over a sharded dim all-reduces its row maxima
    and sums). The solver adds their cost to the candidate's; placement changes between nodes are
    never listed here (the solver prices those on the edges).
    """

    output: PlacementOut
    local: str | None = None
    collectives: tuple[tuple[str, int], ...] = ()


class Rejected(list):
    """An empty candidate list that carries the reason the op is infeasible."""

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


def reject(reason: str) -> Rejected:
    return Rejected(reason)


Rule = Callable[[OpCall, Sequence[Placement | None]], list[Candidate]]
LocalImpl = Callable[..., Any]

_RULES: dict[Any, Rule] = {}
_LOCALS: dict[str, LocalImpl] = {}
_ACROSS_RANKS: set[str] = set()


#: ``register(..., strided=POINTWISE)``: the op treats the sharded dim position by position (the
#: same function of every index, as elementwise ops, matmuls and dim shuffles do), so a fused
#: :class:`~autotp.placement.StridedShard` input may be read as a plain ``Shard`` and the output
#: Shard on a dim of the same size is strided the same way.
POINTWISE = "pointwise"
#: ``register(..., strided=OWN)``: the rule handles StridedShard inputs itself (views, split, slice).
OWN = "own"


def register(*targets: Any, single_placements: bool = True, strided: str | None = None,
             grouped: str | None = None) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each ATen overload in ``targets``; a second registration raises.

    With ``single_placements`` (the default) the registry rejects, before the rule runs, a call
    where some tensor input has no single placement (None, or a tuple from a multi-output op), so
    rules only ever see R / S / P. ``strided`` says how the rule meets a fused
    :class:`~autotp.placement.StridedShard` input: ``None`` rejects it (the safe default: a rule
    that moves data along the sharded dim would silently mix up the segments), :data:`POINTWISE`
    or :data:`OWN`. ``grouped=OWN`` hands :class:`~autotp.placement.GroupedShard` inputs to the
    rule as they are; otherwise the registry runs the rule over the groups (:func:`over_groups`).
    The returned function is the rule itself, wrapped the same way.
    """

    def deco(fn: Rule) -> Rule:
        rule = _checked(fn, strided, grouped) if single_placements else fn
        for t in targets:
            if t in _RULES:
                raise ValueError(f"duplicate placement rule for {t}: {_RULES[t].__name__} and {fn.__name__}")
            _RULES[t] = rule
        return rule

    return deco


def _checked(fn: Rule, strided: str | None = None, grouped: str | None = None) -> Rule:
    @functools.wraps(fn)
    def rule(op: OpCall, inputs: Sequence[Placement | None]) -> list[Candidate]:
        for i, p in enumerate(inputs):
            if not isinstance(p, (Replicate, Shard, Partial, GroupedShard, HeadShard)):
                return reject(f"tensor input {i} has no single placement ({p!r})")
        if grouped != OWN and any(isinstance(p, HeadShard) for p in inputs):
            return over_heads(fn, op, inputs)
        if grouped != OWN and any(isinstance(p, GroupedShard) for p in inputs):
            return over_groups(fn, op, inputs)
        if strided != OWN and any(isinstance(p, StridedShard) for p in inputs):
            if strided != POINTWISE:
                return reject(f"a fused (strided) shard reaches {op.target}, which moves data along "
                              "the sharded dim")
            return _pointwise_strided(fn, op, inputs)
        return fn(op, inputs)

    return rule


def _pointwise_strided(fn: Rule, op: OpCall, inputs: Sequence[Placement]) -> list[Candidate]:
    """Run a :data:`POINTWISE` rule on StridedShard inputs read as plain Shards, then mark each
    Shard result strided again (its dim must have the fused size). With segments held whole
    (``StridedShard.whole``), a ``Partial`` result is dropped: a sum over the fused dim (a matmul
    contracting it) would count every rank's copy of a whole segment."""
    strided = {p for p in inputs if isinstance(p, StridedShard)}
    layouts = {dataclasses.replace(p, dim=0) for p in strided}
    if len(layouts) > 1 or any(isinstance(p, Shard) and not isinstance(p, StridedShard) for p in inputs):
        return reject(f"inputs mix differently fused shards: {list(inputs)}")
    (layout,) = layouts
    segs = layout.segments
    cands = fn(op, [Shard(p.dim) if isinstance(p, StridedShard) else p for p in inputs])
    if layout.shared:  # a piece on several ranks would be summed once per holder
        cands = [c for c in cands if not any(isinstance(q, Partial) for q in
                                             (c.output if isinstance(c.output, tuple) else (c.output,)))]
    if not cands:
        return cands
    outs = op.out if isinstance(op.out, (tuple, list)) else (op.out,)

    def restride(p: Any, spec: Any) -> Any:
        if not isinstance(p, Shard):
            return p
        if not isinstance(spec, TensorSpec) or spec.shape[p.dim] != sum(segs):
            return None
        return dataclasses.replace(layout, dim=p.dim)

    out: list[Candidate] = []
    for c in cands:
        if isinstance(c.output, tuple):
            placed = tuple(restride(p, spec) for p, spec in zip(c.output, outs, strict=False))
            if any(q is None and p is not None for p, q in zip(c.output, placed, strict=False)):
                continue
        else:
            placed = restride(c.output, outs[0])
            if placed is None and c.output is not None:
                continue
        out.append(dataclasses.replace(c, output=placed))
    return out if out else reject(f"a fused shard {segs} does not survive {op.target}")


#: ops that copy their one input unchanged: a spread grouped shard (``GroupedShard.inner``) passes
_COPIES = {"aten.clone.default", "aten.alias.default", "aten.contiguous.default", "aten.detach.default"}


def over_groups(fn: Rule, op: OpCall, inputs: Sequence[Placement]) -> list[Candidate]:
    """Run a rule on :class:`~autotp.placement.GroupedShard` inputs as on plain shards over the
    groups: ``groups`` virtual ranks, each a block of ranks holding the same chunk. Whatever the
    rule claims for a shard over ``groups`` ranks then holds chunk by chunk, so its ``Shard``
    results are grouped shards of the same groups. Refused: inputs that mix the grouping with
    plain shards, partial sums or another grouping; ``Partial`` results (a sum over the groups is
    not a sum over the ranks); local rewrites other than ``shape`` (which divides by the chunks a
    placement cuts, :func:`autotp.placement.chunks`) and any that communicate (both use the
    rank and world size)."""
    spread = [p for p in inputs if isinstance(p, GroupedShard) and p.inner is not None]
    if spread:  # only a copy keeps it; views and expands handle it themselves (grouped=OWN)
        if str(op.target) in _COPIES and len(inputs) == 1:
            return [Candidate(spread[0])]
        return reject(f"a spread grouped shard {spread[0]} reaches {op.target}")
    groups = {p.groups for p in inputs if isinstance(p, GroupedShard)}
    if len(groups) > 1 or any(isinstance(p, (Shard, Partial)) for p in inputs):
        return reject(f"grouped shards meet other shards or partial sums at {op.target}: {list(inputs)}")
    (g,) = groups
    cands = fn(dataclasses.replace(op, world_size=g),
               [Shard(p.dim) if isinstance(p, GroupedShard) else p for p in inputs])

    def leaves(p: Any) -> list[Any]:
        return [q for x in p for q in leaves(x)] if isinstance(p, tuple) else [p]

    def regroup(p: Any) -> Any:
        if isinstance(p, tuple):
            return tuple(regroup(q) for q in p)
        return GroupedShard(p.dim, g) if isinstance(p, Shard) else p

    out = [dataclasses.replace(c, output=regroup(c.output)) for c in cands
           if c.local in (None, "shape", "replicated_share") and not c.collectives
           and not any(isinstance(q, (Partial, StridedShard)) for q in leaves(c.output))]
    return out if out else reject(f"no candidate of {op.target} keeps the grouped shards of {list(inputs)}")


def over_heads(fn: Rule, op: OpCall, inputs: Sequence[Placement]) -> list[Candidate]:
    """Run a rule on :class:`~autotp.placement.HeadShard` inputs as on plain shards over the heads:
    ``heads`` virtual ranks of one head each, of which every rank holds a contiguous run. Whatever
    the rule claims for a shard over ``heads`` ranks holds head by head, and so for a run of heads:
    its ``Shard`` results are head shards of the same heads and groups, and its ``Partial`` results
    stay partial (every head is on exactly one rank, so the sum over heads is the sum over ranks).
    A strided result of equal segments (the heads merged behind the batch, ``(B, H, S, D) -> (B*H,
    S, D)``) is each segment split in whole heads, ``StridedShard.heads`` (one group only).
    Refused: inputs that mix it with plain or grouped shards or another head split; other fused
    (strided) results; local rewrites other than ``shape`` (which localizes by the rank's heads,
    ``autotp/ops/shape.py: localize_sizes``), ``replicated_share`` (a Replicate bias of a
    row-parallel result, GPT-2's ``c_proj``: each rank adds ``1 / N`` of it, whatever its heads)
    and ``rank_rng`` (random numbers of the rank's heads from its own stream: every head is on
    one rank, so every element is still one independent draw; the attention dropout of heads no
    tp divides), and any that communicate."""
    heads = {(p.heads, p.groups) for p in inputs if isinstance(p, HeadShard)}
    if len(heads) > 1 or any(isinstance(p, (Shard, GroupedShard)) for p in inputs):
        return reject(f"head shards meet other shards at {op.target}: {list(inputs)}")
    ((h, g),) = heads
    cands = fn(dataclasses.replace(op, world_size=h), [Shard(p.dim) if isinstance(p, HeadShard) else p for p in inputs])

    def leaves(p: Any) -> list[Any]:
        return [q for x in p for q in leaves(x)] if isinstance(p, tuple) else [p]

    def rehead(p: Any) -> Any:
        if isinstance(p, tuple):
            return tuple(rehead(q) for q in p)
        if isinstance(p, StridedShard):  # segments over h virtual ranks: each segment split in whole heads
            return dataclasses.replace(p, heads=(h,) * len(p.segments))
        return HeadShard(p.dim, h, g) if isinstance(p, Shard) else p

    def merged(p: Any) -> bool:  # (B, H) merged: equal segments, each split as the heads are (one group)
        return g == 1 and p.even and p.segment_size is not None and p.segment_size % h == 0

    out = [dataclasses.replace(c, output=rehead(c.output)) for c in cands
           if c.local in (None, "shape", "replicated_share", "rank_rng") and not c.collectives
           and all(merged(q) for q in leaves(c.output) if isinstance(q, StridedShard))]
    return out if out else reject(f"no candidate of {op.target} keeps the head shards of {list(inputs)}")


def register_local(name: str, *, across_ranks: bool = False) -> Callable[[LocalImpl], LocalImpl]:
    """Register the ATen-level local implementation of a local rewrite (used by ground-truth tests).

    Signature: ``impl(target, args, kwargs, in_placements, out_placement, rank, world_size)`` where
    ``args``/``kwargs`` hold this rank's local tensors. A rewrite that communicates (its candidates
    list ``collectives``) registers with ``across_ranks=True`` and runs all ranks in lockstep:
    ``impl(target, rank_args, rank_kwargs, in_placements, out_placement, world_size)`` with one
    ``args`` / ``kwargs`` per rank, returning one result per rank.
    """

    def deco(fn: LocalImpl) -> LocalImpl:
        if name in _LOCALS:
            raise ValueError(f"duplicate local implementation {name!r}")
        _LOCALS[name] = fn
        if across_ranks:
            _ACROSS_RANKS.add(name)
        return fn

    return deco


def local_impl_is_across_ranks(name: str) -> bool:
    """Whether the local implementation ``name`` runs all ranks at once (see :func:`register_local`)."""
    _ensure_loaded()
    return name in _ACROSS_RANKS


def lookup(target: Any) -> Rule | None:
    """The rule for an ATen overload, or None (the solver then replicates the op and says so).

    Ops of other libraries (custom ops such as ``transformers.grouped_mm_fallback.default``) exist
    only once that library registered them, so their rules are registered under the overload's
    qualified name (``str(overload)``) and found by it."""
    _ensure_loaded()
    rule = _RULES.get(target)
    return rule if rule is not None or isinstance(target, str) else _RULES.get(str(target))


def local_impl(name: str) -> LocalImpl:
    _ensure_loaded()
    return _LOCALS[name]


def registered_targets() -> list[Any]:
    _ensure_loaded()
    return list(_RULES)


_loaded = False


def _ensure_loaded() -> None:
    """Import every rule module once (they register themselves on import)."""
    global _loaded
    if not _loaded:
        _loaded = True
        import autotp.ops  # noqa: F401
