"""Placements: how one logical tensor is laid out over the ranks of the tensor-parallel group.

* ``Replicate()`` — every rank holds the whole tensor.
* ``Shard(dim)`` — rank ``r`` holds chunk ``r`` of ``torch.chunk(t, N, dim)``; ``dim`` is a *tensor*
  dimension (never called an axis: "axis" is reserved for the device mesh).
* ``Partial()`` — every rank holds a summand; the logical tensor is the sum over ranks.
* ``StridedShard(dim, segments)`` — a ``Shard(dim)`` of a fused tensor (q | k | v): rank ``r`` holds
  chunk ``r`` of each segment. Produced by parameters whose fused output is split later, and by
  merging a sharded dim behind other dims (eager attention's ``(B, heads) -> B*heads`` with heads
  sharded is ``B`` equal segments of ``heads``).
* ``GroupedShard(dim, groups)`` — ``groups`` (a divisor of N, below N) chunks of ``dim``, each held
  by ``N / groups`` consecutive ranks: rank ``r`` holds chunk ``r * groups // N``. The placement of
  key/value heads when tp exceeds their count (grouped-query attention): each rank holds the kv
  head its query heads use. Not a ``Shard`` (its local size is ``size / groups``, not ``size / N``),
  so nothing that handles shards meets one by accident; rules see it through the registry only
  (``autotp/ops/registry.py``).

Placements are small frozen values: they hash, compare, and print as ``R``, ``S(1)``, ``P``.
A multi-output op has a tuple of placements; a non-tensor value has ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True)
class Shard:
    dim: int

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard dim must be normalized to >= 0, got {self.dim}")

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True)
class StridedShard(Shard):
    """``Shard(dim)`` of a *fused* tensor: ``dim`` is the concatenation of ``segments`` (e.g. the
    q | k | v outputs of one fused projection), and rank ``r`` holds chunk ``r`` of *each* segment,
    concatenated in segment order. Its local size is ``sum(segments) / N`` like a plain shard's, but
    the rows differ, so it never equals ``Shard(dim)`` and no collective moves it (an all-gather
    would interleave the segments). Rules must opt in to see one (``register(..., strided=...)``).
    """

    segments: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"S({self.dim}|{'+'.join(str(s) for s in self.segments)})"

    __repr__ = __str__

    @property
    def segment_size(self) -> int | None:
        """The size every segment has, or None when they differ (q | k | v of unequal sizes).

        Equal segments are what merging a sharded dim behind other dims gives (``(B, heads) ->
        B*heads``): the layout then means the same whatever the number of segments, so it may
        lie on a dim of symbolic size (a dynamic batch) as long as the segment size is static."""
        return self.segments[0] if self.segments and len(set(self.segments)) == 1 else None

    def pieces(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` along ``dim`` of each piece rank ``rank`` holds, in local order."""
        out, offset = [], 0
        for size in self.segments:
            step = size // world_size
            out.append((offset + rank * step, offset + (rank + 1) * step))
            offset += size
        return out


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"

    __repr__ = __str__


@dataclass(frozen=True)
class GroupedShard:
    """``groups`` chunks of ``dim``, chunk ``g`` held by ranks ``[g * N/groups, (g+1) * N/groups)``.

    Over N ranks it is a ``Shard(dim)`` over ``groups`` *virtual ranks* (each a block of
    ``N / groups`` consecutive ranks holding the same chunk): a rule's reasoning about a shard over
    ``groups`` ranks holds for it unchanged (``autotp/ops/registry.py``). Rank ``r``'s chunk of a
    ``Shard(dim)`` over N lies inside its grouped chunk, at ``r % (N / groups)``, so narrowing to a
    plain shard is local; gathering it whole is an all-gather that keeps one chunk per group.

    ``inner``: the ranks of a group also split dim ``inner`` (``dim + 1``) among them, rank ``r``
    holding chunk ``r % (N / groups)``. That is a kv head spread over its query heads,
    ``(B, KV, 1, S, D) -> (B, KV, H/KV, S, D)`` with one kv head per group: merged into
    ``(B, H, S, D)`` it is a plain ``Shard`` of the heads, each rank holding its query heads' copies
    of its kv head (what attention with ``enable_gqa`` computes on each rank's shards)."""

    dim: int
    groups: int
    inner: int | None = None

    def __post_init__(self) -> None:
        if self.dim < 0 or self.groups < 2:
            raise ValueError(f"GroupedShard needs dim >= 0 and groups >= 2, got {self.dim}, {self.groups}")

    def __str__(self) -> str:
        return f"S({self.dim}/{self.groups}{'' if self.inner is None else f':{self.inner}'})"

    __repr__ = __str__

    def group(self, rank: int, world_size: int) -> int:
        """The chunk rank ``rank`` holds."""
        return rank * self.groups // world_size


Placement = Replicate | Shard | Partial | GroupedShard

R = Replicate()
P = Partial()


def is_shard(p: object, dim: int | None = None) -> bool:
    """True if ``p`` is a Shard (on ``dim`` when given)."""
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def normalize_dim(dim: int, ndim: int) -> int:
    """Map a possibly negative tensor dim into ``[0, ndim)``."""
    if ndim == 0:
        return 0
    return dim % ndim


def parse(text: str) -> Placement:
    """Inverse of ``str``: ``"R"``, ``"P"``, ``"S(2)"``, ``"S(2|64+32+32)"`` or ``"S(1/2)"``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")"):
        if "/" in text:
            dim, _, groups = text[2:-1].partition("/")
            groups, _, inner = groups.partition(":")
            return GroupedShard(int(dim), int(groups), int(inner) if inner else None)
        dim, _, segments = text[2:-1].partition("|")
        if segments:
            return StridedShard(int(dim), tuple(int(x) for x in segments.split("+")))
        return Shard(int(dim))
    raise ValueError(f"not a placement: {text!r}")


def shard_candidates(shape: tuple[int, ...], world_size: int) -> list[Shard]:
    """The Shard placements a tensor of ``shape`` can take: dims whose size divides evenly."""
    return [Shard(d) for d, size in enumerate(shape) if size >= world_size and size % world_size == 0]


def local_shape(shape: tuple[int, ...], placement: Placement | None, world_size: int) -> tuple[int, ...]:
    """The shape one rank holds of a tensor with global ``shape`` under ``placement``."""
    if isinstance(placement, Shard):
        out = list(shape)
        out[placement.dim] = shape[placement.dim] // world_size
        return tuple(out)
    if isinstance(placement, GroupedShard):
        out = list(shape)
        out[placement.dim] = shape[placement.dim] // placement.groups
        if placement.inner is not None:
            out[placement.inner] = shape[placement.inner] // (world_size // placement.groups)
        return tuple(out)
    return tuple(shape)


def chunks(placement: Placement | None, world_size: int) -> int:
    """How many distinct chunks of its dim a sharded placement cuts: N, or a grouped shard's groups."""
    return placement.groups if isinstance(placement, GroupedShard) else world_size
