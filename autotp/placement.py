"""Placements: how one logical tensor is laid out over the ranks of the tensor-parallel group.

* ``Replicate()`` — every rank holds the whole tensor.
* ``Shard(dim)`` — rank ``r`` holds chunk ``r`` of ``torch.chunk(t, N, dim)``; ``dim`` is a *tensor*
  dimension (never called an axis: "axis" is reserved for the device mesh). Chunks are
  ``ceil(size / N)`` long and the trailing ones shorter when ``N`` does not divide the size (GPT-2's
  50257-entry vocabulary at tp=2: rows 25129 / 25128), as in DTensor's uneven sharding. The chunk
  arithmetic lives here only (:func:`chunk_range`, :func:`local_size`, :func:`local_shape`):
  planning, weight loading, the rewrite and the collectives all ask these functions.
* ``Partial()`` — every rank holds a summand; the logical tensor is the sum over ranks.
* ``StridedShard(dim, segments)`` — a ``Shard(dim)`` of a fused tensor (q | k | v): rank ``r`` holds
  chunk ``r`` of each segment. Produced by parameters whose fused output is split later, and by
  merging a sharded dim behind other dims (eager attention's ``(B, heads) -> B*heads`` with heads
  sharded is ``B`` equal segments of ``heads``). Segments listed in ``whole`` are held whole by
  every rank: Falcon's fused multi-query ``query_key_value`` (q heads | one k head | one v head),
  its q split by heads and its single k and v head on every rank. With ``heads`` (a head count per
  segment) each split segment is split in whole heads as a :class:`HeadShard` splits them, where
  no tp divides the heads: GPT-2 XL's ``c_attn`` (25 heads in each of q | k | v) at tp=2 holds
  heads 0-12 of each on rank 0, ``S(1|1600:25h+1600:25h+1600:25h)``; Falcon-7B's 71 q heads beside
  its whole k and v head, ``S(0|4544:71h+64r+64r)``. Local lengths then differ by rank.
* ``GroupedShard(dim, groups)`` — ``groups`` (a divisor of N, below N) chunks of ``dim``, each held
  by ``N / groups`` consecutive ranks: rank ``r`` holds chunk ``r * groups // N``. The placement of
  key/value heads when tp exceeds their count (grouped-query attention): each rank holds the kv
  head its query heads use. Not a ``Shard`` (its local size is ``size / groups``, not ``size / N``),
  so nothing that handles shards meets one by accident; rules see it through the registry only
  (``autotp/ops/registry.py``).
* ``HeadShard(dim, heads, groups)`` — ``dim`` is ``heads`` attention heads whose count no tp divides
  (Qwen2.5-7B's 28 query heads at tp=8), split in whole heads: the heads fall into ``groups`` equal
  groups (the kv heads of grouped-query attention, 1 for multi-head attention), group ``g`` is held
  by ranks ``[g * N/groups, (g+1) * N/groups)``, which split its heads as evenly as they go
  (:func:`balanced_range`: 7 heads over 2 ranks are 4 + 3, 25 over 8 are 4 + 3 x 7). Each rank's query heads then
  use only the kv head its group holds. Like a grouped shard it is not a ``Shard``: rules see it
  through the registry as a plain shard over ``heads`` virtual ranks, one head each.

Placements are small frozen values that print as ``R``, ``S(1)``, ``P``. They are *interned*: each
value is one object (:class:`_Interned`, also through ``dataclasses.replace``, ``copy`` and
``pickle``), so equality is identity and the hash is the object's, both computed in C. The solver
hashes a state's every placement for each option it weighs (a state is a dict key), and with
dataclass equality each of those hashes was a Python call building a tuple of the fields.
A multi-output op has a tuple of placements; a non-tensor value has ``None``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class _Interned(type):
    """Metaclass of the placements: a call returns the one object of that value, made by the first
    call with it. Looked up first by the call's arguments (``Shard(1)``), then, for a call not seen
    before, by the value it made (``Shard(dim=1)`` is ``Shard(1)``); an argument that does not hash
    (a list) skips the first lookup only."""

    _calls: dict[tuple, Any] = {}
    _values: dict[tuple, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        key = (cls, args, *kwargs.items())
        try:
            made = _Interned._calls.get(key)
        except TypeError:
            key, made = None, None
        if made is None:
            made = super().__call__(*args, **kwargs)
            made = _Interned._values.setdefault((cls, *_fields(made)), made)
            if key is not None:
                _Interned._calls[key] = made
        return made


def _fields(p: Any) -> tuple:
    return tuple(getattr(p, f.name) for f in dataclasses.fields(p))


class _Value(metaclass=_Interned):
    """Base of the placement classes: copies and unpickled objects are the interned object too."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return type(self), _fields(self)

    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: dict) -> Any:
        return self


@dataclass(frozen=True, eq=False)
class Replicate(_Value):
    def __str__(self) -> str:
        return "R"

    __repr__ = __str__


@dataclass(frozen=True, eq=False)
class Shard(_Value):
    dim: int

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"Shard dim must be normalized to >= 0, got {self.dim}")

    def __str__(self) -> str:
        return f"S({self.dim})"

    __repr__ = __str__


@dataclass(frozen=True, eq=False)
class StridedShard(Shard):
    """``Shard(dim)`` of a *fused* tensor: ``dim`` is the concatenation of ``segments`` (e.g. the
    q | k | v outputs of one fused projection), and rank ``r`` holds chunk ``r`` of *each* segment,
    concatenated in segment order. Its local size is ``sum(segments) / N`` like a plain shard's, but
    the rows differ, so it never equals ``Shard(dim)`` and no collective moves it (an all-gather
    would interleave the segments). Rules must opt in to see one (``register(..., strided=...)``).

    ``whole``: the indices of segments every rank holds whole instead (replicated within the fused
    tensor): a segment of one kv head that no rank count divides, beside q heads that are split.
    Rank ``r`` then holds chunk ``r`` of each other segment and all of these, in segment order;
    its local size is ``sum(split segments) / N + sum(whole segments)``. Printed with an ``r``:
    ``S(2|8+1r+1r)``.

    ``groups``: where set, one count per segment, nonzero for a segment of kv heads fewer than the
    ranks (Phi-3's fused ``qkv_proj`` with grouped-query attention past its kv heads): rank ``r``
    holds kv head group ``r * groups // N`` of it, as a :class:`GroupedShard` does, ``S(0|3072+256/2+256/2)``.

    ``heads``: where set, one head count per segment (0 for a whole one), and rank ``r`` holds
    the heads :meth:`HeadShard.head_range` gives it of each split segment instead of chunk ``r``:
    ``S(2|71:71h+1r+1r)``. Then the local length differs by rank (rank 0 holds the most); set only
    where some split segment's heads no tp divides (one name per layout, as :func:`head_split`).
    """

    segments: tuple[int, ...] = ()
    whole: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        segments = (f"{s}r" if i in self.whole else f"{s}/{self.groups[i]}" if self.groups and self.groups[i]
                    else f"{s}:{self.heads[i]}h" if self.heads else str(s) for i, s in enumerate(self.segments))
        return f"S({self.dim}|{'+'.join(segments)})"

    @property
    def even(self) -> bool:
        """Whether every rank holds ``1 / N`` of every segment (its local length is the dim's / N)."""
        return not self.whole and not self.heads and not any(self.groups)

    @property
    def shared(self) -> bool:
        """Whether some piece is held by several ranks (whole or grouped segments): a contraction
        over the fused dim would count it once per holder, and its gradient too."""
        return bool(self.whole) or any(self.groups)

    __repr__ = __str__

    def segment_range(self, i: int, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, stop)`` inside segment ``i`` that rank ``rank`` holds: all of a whole segment,
        its whole heads (:meth:`HeadShard.head_range` over ``heads[i]``) where the segments are
        split in heads, else chunk ``rank`` of ``N`` equal chunks."""
        size = self.segments[i]
        if i in self.whole:
            return 0, size
        if self.groups and self.groups[i]:  # kv heads fewer than ranks: the group's kv heads
            step, g = size // self.groups[i], rank * self.groups[i] // world_size
            return g * step, (g + 1) * step
        if self.heads:
            start, stop = HeadShard(0, self.heads[i]).head_range(rank, world_size)
            unit = size // self.heads[i]
            return start * unit, stop * unit
        step = size // world_size
        return rank * step, (rank + 1) * step

    def segment_placement(self, i: int, world_size: int) -> Placement:
        """The placement segment ``i`` has once cut out of the fused dim (on the same dim): ``R``
        where held whole, its head split where split in whole heads, else ``Shard``."""
        if i in self.whole:
            return R
        if self.groups and self.groups[i]:
            return GroupedShard(self.dim, self.groups[i])
        if self.heads:
            return head_split(self.dim, self.heads[i], 1, world_size) or Shard(self.dim)
        return Shard(self.dim)

    def local_segments(self, world_size: int, rank: int = 0) -> list[int]:
        """Each segment's length on rank ``rank``, in segment order: ``size / N``, its heads' rows,
        or, whole, ``size``. The same on every rank unless the segments are split in heads."""
        return [b - a for a, b in (self.segment_range(i, rank, world_size) for i in range(len(self.segments)))]

    def local_length(self, world_size: int, rank: int = 0) -> int:
        """The length of ``dim`` on rank ``rank`` (rank 0 holds the most)."""
        return sum(self.local_segments(world_size, rank))

    def local_length_of(self, size: Any, world_size: int, rank: int = 0) -> Any:
        """Rank ``rank``'s length of a dim of ``size`` (an int, or a symbolic size: any object
        with ``//`` and ``*``) in this layout: with equal segments ``size`` is a whole number of
        them (a dynamic batch merged with the heads), each of which the rank holds its piece of;
        otherwise ``size`` is the sum of the segments."""
        segment = self.segment_size
        if segment is None:
            return self.local_length(world_size, rank)
        return size // segment * self.local_segments(world_size, rank)[0]

    def whole_share(self, world_size: int) -> float:
        """The share of the fused dim a rank holds beyond ``1 / N``: its whole segments' copies.
        Segments split in whole heads count as ``1 / N`` (rank 0's extra head is the split's
        unevenness, as a :class:`HeadShard`'s, not a copy)."""
        grouped = sum(s * (1 / g - 1 / world_size) for s, g in zip(self.segments, self.groups, strict=True) if g) \
            if self.groups else 0.0
        return (sum(self.segments[i] for i in self.whole) * (1 - 1 / world_size) + grouped) / sum(self.segments)

    def bounds(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of each segment along the global ``dim``."""
        out, offset = [], 0
        for size in self.segments:
            out.append((offset, offset + size))
            offset += size
        return out

    def local_bounds(self, world_size: int, rank: int = 0) -> list[tuple[int, int]]:
        """``[start, stop)`` of each segment's piece along rank ``rank``'s local ``dim``."""
        out, offset = [], 0
        for size in self.local_segments(world_size, rank):
            out.append((offset, offset + size))
            offset += size
        return out

    def whole_local_bounds(self, world_size: int, rank: int = 0) -> list[tuple[int, int]]:
        """``[start, stop)`` along rank ``rank``'s local ``dim`` of each segment every rank holds
        whole (after that rank's pieces of the split segments, which may be uneven)."""
        bounds = self.local_bounds(world_size, rank)
        return [bounds[i] for i in sorted(self.whole)]

    def grouped_local_bounds(self, world_size: int, rank: int = 0) -> dict[int, list[tuple[int, int]]]:
        """Kv group count -> ``[start, stop)`` along rank ``rank``'s local ``dim`` of each segment
        held per group of ranks with that count (Phi-3's k and v heads: ``{2: [(16, 24), (24, 32)]}``
        for ``S(0|64+16/2+16/2)`` at tp=4); the ``N / count`` ranks of a group hold those rows alike."""
        out: dict[int, list[tuple[int, int]]] = {}
        for i, bounds in enumerate(self.local_bounds(world_size, rank)):
            if self.groups and self.groups[i]:
                out.setdefault(self.groups[i], []).append(bounds)
        return out

    def holders(self, i: int, world_size: int) -> int:
        """How many ranks hold the same piece of segment ``i``: every rank a whole one, the ``N /
        groups`` ranks of a group one held per group of ranks, else one (each its own piece)."""
        if i in self.whole:
            return world_size
        return world_size // self.groups[i] if self.groups and self.groups[i] else 1

    @property
    def segment_size(self) -> int | None:
        """The size every segment has, or None when they differ (q | k | v of unequal sizes).

        Equal segments are what merging a sharded dim behind other dims gives (``(B, heads) ->
        B*heads``): the layout then means the same whatever the number of segments, so it may
        lie on a dim of symbolic size (a dynamic batch) as long as the segment size is static.
        Segments split in whole heads count as equal when their head counts are (heads no tp
        divides merged behind the batch: ``S(0|25:25h+25:25h)``)."""
        if self.shared or not self.segments or len(set(self.segments)) != 1 or len(set(self.heads)) > 1:
            return None
        return self.segments[0]

    def pieces(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` along ``dim`` of each piece rank ``rank`` holds, in local order."""
        return [(start + a, start + b) for i, (start, _) in enumerate(self.bounds())
                for a, b in [self.segment_range(i, rank, world_size)]]

    def fits(self, size: int, world_size: int) -> bool:
        """Whether the segments tile a dim of ``size`` and every split one divides by ``world_size``
        (or, split in heads, into its whole heads with at least one head per rank)."""
        if sum(self.segments) != size:
            return False
        if any(self.groups) and not all(s % g == 0 and world_size % g == 0 and g < world_size
                                        for s, g in zip(self.segments, self.groups, strict=True) if g):
            return False
        if self.heads:
            return len(self.heads) == len(self.segments) and all(
                s % h == 0 and head_split(0, h, 1, world_size) is not None
                for i, (s, h) in enumerate(zip(self.segments, self.heads, strict=True))
                if i not in self.whole and not (self.groups and self.groups[i]))
        return all(s % world_size == 0 for i, s in enumerate(self.segments)
                   if i not in self.whole and not (self.groups and self.groups[i]))


@dataclass(frozen=True, eq=False)
class Partial(_Value):
    def __str__(self) -> str:
        return "P"

    __repr__ = __str__


@dataclass(frozen=True, eq=False)
class GroupedShard(_Value):
    """``groups`` chunks of ``dim``, chunk ``g`` held by ranks ``[g * N/groups, (g+1) * N/groups)``.

    Over N ranks it is a ``Shard(dim)`` over ``groups`` *virtual ranks* (each a block of
    ``N / groups`` consecutive ranks holding the same chunk): a rule's reasoning about a shard over
    ``groups`` ranks holds for it unchanged (``autotp/ops/registry.py``). Rank ``r``'s chunk of a
    ``Shard(dim)`` over N lies inside its grouped chunk, at ``r % (N / groups)``, so narrowing to a
    plain shard is local; gathering it whole is an all-gather that keeps one chunk per group.

    ``inner``: the ranks of a group also split dim ``inner`` (``dim + 1``) among them, rank ``r``
    holding chunk ``r % (N / groups)`` (:func:`spread_size`; uneven where they do not divide it). That is a kv head spread over its query heads,
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


@dataclass(frozen=True, eq=False)
class HeadShard(_Value):
    """``dim`` holds ``heads`` equal blocks (a head of ``size / heads`` indices each), split over
    the ranks in whole heads: ``groups`` equal groups of heads, group ``g`` held by the ``N /
    groups`` consecutive ranks ``[g * N/groups, (g+1) * N/groups)``, which share its heads by
    :func:`balanced_range` (the first ranks one head more where they do not divide). Every rank's
    heads are contiguous and the ranks hold them in rank order, so concatenating the ranks' blocks
    gives the whole dim. Built by :func:`head_split`, which gives a plain ``Shard`` where the split
    is even (one name per layout)."""

    dim: int
    heads: int
    groups: int = 1

    def __post_init__(self) -> None:
        if self.dim < 0 or self.heads < 1 or self.groups < 1 or self.heads % self.groups:
            raise ValueError(f"HeadShard needs dim >= 0 and groups dividing heads, got {self}")

    def __str__(self) -> str:
        return f"S({self.dim}:{self.heads}h{'' if self.groups == 1 else f'/{self.groups}'})"

    __repr__ = __str__

    def head_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, stop)`` of the heads rank ``rank`` holds."""
        per_group, ranks = self.heads // self.groups, world_size // self.groups
        start, stop = balanced_range(per_group, rank % ranks, ranks)
        base = (rank * self.groups // world_size) * per_group
        return base + start, base + stop

    def index_range(self, size: int, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, stop)`` along ``dim`` (of ``size`` indices) that rank ``rank`` holds."""
        start, stop = self.head_range(rank, world_size)
        unit = size // self.heads
        return start * unit, stop * unit

    def heads_per_rank(self, world_size: int) -> list[int]:
        """Every rank's head count: ``[4, 3, 4, 3, 4, 3, 4, 3]`` for 28 heads in 4 groups at tp=8."""
        return [b - a for a, b in (self.head_range(r, world_size) for r in range(world_size))]


def head_split(dim: int, heads: int, groups: int, world_size: int) -> Shard | HeadShard | None:
    """The placement of a dim of ``heads`` heads split over ``world_size`` ranks in whole heads,
    ``groups`` groups of them per kv head (1 for multi-head attention): a plain ``Shard`` where
    every rank gets the same count, a :class:`HeadShard` where not, None where the split cannot be
    made (``groups`` neither divides tp nor the heads, or some rank would get no head)."""
    if groups < 1 or heads % groups or world_size % groups or heads < world_size:
        return None
    per_group, ranks = heads // groups, world_size // groups
    if per_group % ranks == 0:
        return Shard(dim)
    if per_group < ranks:
        return None
    return HeadShard(dim, heads, groups)


Placement = Replicate | Shard | Partial | GroupedShard | HeadShard

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
    """Inverse of ``str``: ``"R"``, ``"P"``, ``"S(2)"``, ``"S(2|64+32+32)"``, ``"S(2|8+1r+1r)"``,
    ``"S(1/2)"`` or ``"S(2:28h/4)"``."""
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")") and "h" in text and "|" not in text:
        dim, _, heads = text[2:-1].partition(":")
        heads, _, groups = heads.partition("h")
        return HeadShard(int(dim), int(heads), int(groups.lstrip("/") or 1))
    if text.startswith("S(") and text.endswith(")"):
        if "/" in text and "|" not in text:
            dim, _, groups = text[2:-1].partition("/")
            groups, _, inner = groups.partition(":")
            return GroupedShard(int(dim), int(groups), int(inner) if inner else None)
        dim, _, segments = text[2:-1].partition("|")
        if segments:
            parts = segments.split("+")
            heads = tuple(int(x.partition(":")[2].rstrip("h") or 0) for x in parts)
            groups = tuple(int(x.partition("/")[2] or 0) for x in parts)
            return StridedShard(int(dim), tuple(int(x.rstrip("r").partition(":")[0].partition("/")[0]) for x in parts),
                                tuple(i for i, x in enumerate(parts) if x.endswith("r")),
                                heads if any(heads) else (), groups if any(groups) else ())
        return Shard(int(dim))
    raise ValueError(f"not a placement: {text!r}")


def chunk_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``rank`` of ``torch.chunk`` over a dim of ``size`` into ``world_size``.

    Chunk size is ``ceil(size / world_size)``; trailing ranks get a short chunk, or an empty range
    ``(size, size)`` where ``torch.chunk`` returns fewer than ``world_size`` chunks. The one place
    shard bounds are computed (DTensor's uneven sharding follows the same rule).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    step = -(-size // world_size)
    start = min(rank * step, size)
    return start, min(start + step, size)


def balanced_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s share of ``size`` whole units (attention heads) split
    as evenly as they go, the first ``size % N`` ranks one more: 25 heads over 8 ranks are 4 + 3 x 7,
    12 over 8 are 2 x 4 + 1 x 4. Unlike :func:`chunk_range` (``ceil(size / N)`` each, which would
    leave the last ranks of 25 over 8 with 1 and 0 heads) no rank is left empty while ``size >= N``;
    the most any rank holds, ``ceil(size / N)``, is the same."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def local_size(size: int, rank: int, world_size: int) -> int:
    """How many indices of a dim of ``size`` rank ``rank`` holds under a Shard of that dim."""
    start, stop = chunk_range(size, rank, world_size)
    return stop - start


def chunk_sizes(size: int, world_size: int) -> list[int]:
    """Every rank's share of a dim of ``size``: ``[25129, 25128]`` for 50257 over 2 ranks."""
    return [local_size(size, r, world_size) for r in range(world_size)]


def is_uneven(size: int, world_size: int) -> bool:
    """Whether a Shard of a dim of ``size`` gives the ranks unequal chunks."""
    return size % world_size != 0


def uneven_rows(shape: tuple[int, ...], placement: Placement | None, world_size: int) -> list[int] | None:
    """Every rank's share of the sharded dim when the ranks carry unequal work, else None."""
    if isinstance(placement, HeadShard):
        return [n * (shape[placement.dim] // placement.heads) for n in placement.heads_per_rank(world_size)]
    if isinstance(placement, Shard) and not isinstance(placement, StridedShard) \
            and is_uneven(shape[placement.dim], world_size):
        return chunk_sizes(shape[placement.dim], world_size)
    return None


def uneven_note(shape: tuple[int, ...], placement: Placement | None, world_size: int) -> str | None:
    """Where ranks carry unequal work, in words: ``"dim 0 of 50257 over tp=2: rows 25129/25128"``."""
    rows = uneven_rows(shape, placement, world_size)
    if rows is None:
        return None
    if isinstance(placement, HeadShard):  # "dim 0 of 3584 (28 heads of 128, 4 groups) over tp=8: heads 4/3/..."
        groups = f", {placement.groups} kv groups" if placement.groups > 1 else ""
        return (f"dim {placement.dim} of {shape[placement.dim]} ({placement.heads} heads of "
                f"{shape[placement.dim] // placement.heads}{groups}) over tp={world_size}: heads "
                f"{'/'.join(map(str, placement.heads_per_rank(world_size)))}")
    return f"dim {placement.dim} of {shape[placement.dim]} over tp={world_size}: rows {'/'.join(map(str, rows))}"


def shard_candidates(shape: tuple[int, ...], world_size: int, uneven_sizes: frozenset[int] = frozenset()
                     ) -> list[Shard]:
    """The Shard placements a tensor of ``shape`` can take: dims whose size divides evenly, and dims
    whose size is in ``uneven_sizes`` (vocabularies, see ``autotp.ops.embedding.vocabulary_sizes``)
    when every rank still gets at least one index."""
    return [Shard(d) for d, size in enumerate(shape)
            if size >= world_size and (size % world_size == 0 or size in uneven_sizes and min(chunk_sizes(size, world_size)) > 0)]


def local_shape(shape: tuple[int, ...], placement: Placement | None, world_size: int, rank: int = 0
                ) -> tuple[int, ...]:
    """The shape rank ``rank`` holds of a tensor with global ``shape`` under ``placement`` (rank 0
    holds the largest chunk of an uneven shard)."""
    if isinstance(placement, StridedShard):
        out = list(shape)
        out[placement.dim] = placement.local_length(world_size, rank)
        return tuple(out)
    if isinstance(placement, Shard):
        out = list(shape)
        out[placement.dim] = local_size(shape[placement.dim], rank, world_size)
        return tuple(out)
    if isinstance(placement, GroupedShard):
        out = list(shape)
        out[placement.dim] = shape[placement.dim] // placement.groups
        if placement.inner is not None:
            out[placement.inner] = spread_size(shape[placement.inner], placement, world_size, rank)
        return tuple(out)
    if isinstance(placement, HeadShard):
        out = list(shape)
        start, stop = placement.index_range(shape[placement.dim], rank, world_size)
        out[placement.dim] = stop - start
        return tuple(out)
    return tuple(shape)


def spread_size(size: int, placement: GroupedShard, world_size: int, rank: int) -> int:
    """Rank ``rank``'s share of a grouped shard's ``inner`` dim (its group's query heads per kv
    head, ``size``): :func:`balanced_range` over the group's ranks, as :class:`HeadShard` splits
    the query heads, so 7 over 2 ranks is 4 + 3."""
    ranks = world_size // placement.groups
    start, stop = balanced_range(size, rank % ranks, ranks)
    return stop - start


def chunks(placement: Placement | None, world_size: int) -> int:
    """How many distinct chunks of its dim a sharded placement cuts: N, or a grouped shard's groups
    (a :class:`HeadShard`'s chunks are uneven: ask :meth:`HeadShard.index_range` for sizes)."""
    return placement.groups if isinstance(placement, GroupedShard) else world_size
