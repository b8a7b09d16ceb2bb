"""Placements are interned: each value is one object, however it was made (``autotp/placement.py``).

The solver compares and hashes placements by identity (a state is a dict key holding one per live
value), so a copy, an unpickled plan or a placement rebuilt by ``dataclasses.replace`` must be the
very object the rules made. Tolerances: none, identities.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

from autotp.placement import (
    GroupedShard,
    HeadShard,
    P,
    Partial,
    R,
    Replicate,
    Shard,
    StridedShard,
    head_split,
    parse,
)

VALUES = [R, P, Shard(1), StridedShard(2, (64, 32, 32)), StridedShard(2, (8, 1, 1), whole=(1, 2)),
          GroupedShard(1, 2), GroupedShard(1, 2, inner=2), HeadShard(0, 28, 4)]


def test_equal_placements_are_one_object_however_they_are_made() -> None:
    assert Replicate() is R and Partial() is P
    assert Shard(dim=1) is Shard(1)
    assert StridedShard(2, segments=(64, 32, 32)) is StridedShard(2, (64, 32, 32))
    assert head_split(0, 28, 4, 8) is HeadShard(0, 28, 4)
    for p in VALUES:
        assert copy.copy(p) is p and copy.deepcopy(p) is p
        assert pickle.loads(pickle.dumps(p)) is p
        assert parse(str(p)) is p
        assert dataclasses.replace(p) is p


def test_different_placements_differ_in_equality_and_in_dict_keys() -> None:
    assert R != P and Shard(1) != Shard(2)
    assert Shard(2) != StridedShard(2, (64, 32, 32))  # a fused layout is never a plain shard
    assert len({p: None for p in VALUES}) == len(VALUES)
    assert dataclasses.replace(Shard(1), dim=2) is Shard(2)
