"""Heads no tp divides, split in whole heads (``HeadShard``): the arithmetic, and the rules run on it.

Rules see a head shard as a plain shard over its heads (``registry.over_heads``). Each claim here is
checked against ground truth in one process, as tests/unit/test_rules.py does for plain shards:
every rank's piece is cut with ``HeadShard.index_range``, the op runs on the pieces (view sizes
localized by ``localize_sizes``), and the pieces are put back by the claimed placement (head shard:
concatenated in rank order; partial: summed) and compared with the op on whole tensors.

Tolerance: data movement exact; matmuls and attention on smaller blocks reorder fp32 additions,
``rtol = atol = 1e-5`` (values are O(1)).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from autotp.api import check_divisible
from autotp.errors import AutoTPError
from autotp.ops import registry
from autotp.ops.registry import OpCall, TensorSpec
from autotp.ops.shape import localize_sizes
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Partial,
    R,
    Shard,
    head_split,
    local_shape,
    parse,
    uneven_note,
)

aten = torch.ops.aten
TOL = dict(rtol=1e-5, atol=1e-5)


def test_qwen2_5_7b_query_heads_are_4_and_3_per_kv_head_at_tp8() -> None:
    split = head_split(0, 28, 4, 8)
    assert split == HeadShard(0, 28, 4)
    assert split.heads_per_rank(8) == [4, 3, 4, 3, 4, 3, 4, 3]
    assert [split.index_range(3584, r, 8) for r in (0, 1, 2)] == [(0, 512), (512, 896), (896, 1408)]
    assert [local_shape((3584, 3584), split, 8, r) for r in (0, 1)] == [(512, 3584), (384, 3584)]
    assert uneven_note((3584, 3584), split, 8) == \
        "dim 0 of 3584 (28 heads of 128, 4 kv groups) over tp=8: heads 4/3/4/3/4/3/4/3"
    assert parse(str(split)) == split and str(split) == "S(0:28h/4)"


def test_an_even_split_is_a_plain_shard_and_one_leaving_a_rank_without_a_head_is_none() -> None:
    assert head_split(1, 32, 8, 16) == Shard(1)  # 4 heads per kv head over 2 ranks: 2 + 2
    assert head_split(0, 3, 1, 2) == HeadShard(0, 3)  # multi-head: 2 + 1
    assert head_split(0, 6, 1, 4) == HeadShard(0, 6)  # as evenly as they go: 2 + 2 + 1 + 1
    assert HeadShard(0, 6).heads_per_rank(4) == [2, 2, 1, 1]  # (torch.chunk would give 2 + 2 + 2 + 0)
    assert HeadShard(0, 25).heads_per_rank(8) == [4, 3, 3, 3, 3, 3, 3, 3]
    assert head_split(0, 3, 1, 4) is None  # fewer heads than ranks
    assert head_split(0, 28, 4, 32) is None  # 7 per kv head over 8 ranks
    assert head_split(0, 28, 3, 6) is None  # the groups do not divide the heads


def test_check_divisible_accepts_whole_head_splits_and_refuses_the_rest() -> None:
    qwen = transformers.Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                    intermediate_size=18944, vocab_size=152064)
    check_divisible(qwen, 8)
    check_divisible(qwen, 16)  # 7 per kv head over 4 ranks: 2 + 2 + 2 + 1
    mha = transformers.LlamaConfig(hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                                   intermediate_size=96)
    check_divisible(mha, 2)
    with pytest.raises(AutoTPError, match=r"num_attention_heads=3 .*Valid tp sizes for this model: \[1, 2, 3\]"):
        check_divisible(mha, 4)  # a rank would hold no head


def _pieces(x: torch.Tensor, p: object, world: int) -> list[torch.Tensor]:
    if isinstance(p, HeadShard):
        return [x.narrow(p.dim, a, b - a) for a, b in (p.index_range(x.shape[p.dim], r, world) for r in range(world))]
    if isinstance(p, GroupedShard):
        return [x.chunk(p.groups, p.dim)[p.group(r, world)] for r in range(world)]
    return [x] * world


def _whole(pieces: list[torch.Tensor], p: object) -> torch.Tensor:
    if isinstance(p, HeadShard):
        return torch.cat(pieces, p.dim)
    if isinstance(p, Partial):
        return sum(pieces)
    return pieces[0]


def _claim(target: object, args: tuple, placements: list, out: torch.Tensor, world: int) -> object:
    specs = tuple(TensorSpec(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    op = OpCall(target, specs, {}, TensorSpec(tuple(out.shape), out.dtype), world)
    (cand,) = registry.lookup(target)(op, placements)[:1]
    return cand


WORLD = 4
SPLIT = HeadShard(2, 6, 2)  # (B, S, 6 heads * D): 2 kv groups, 3 query heads each over 2 ranks: 2 + 1


def test_a_view_into_heads_then_a_transpose_keeps_each_ranks_heads() -> None:
    x = torch.randn(2, 5, 6 * 4)
    out = x.view(2, 5, 6, 4)
    cand = _claim(aten.view.default, (x, [2, 5, 6, 4]), [SPLIT], out, WORLD)
    assert cand.output == HeadShard(2, 6, 2) and cand.local == "shape"
    pieces = [p.view(localize_sizes([2, 5, 6, 4], cand.output, WORLD, r)) for r, p in enumerate(_pieces(x, SPLIT, WORLD))]
    assert torch.equal(_whole(pieces, cand.output), out)
    t = _claim(aten.transpose.int, (out, 1, 2), [cand.output], out.transpose(1, 2), WORLD)
    assert t.output == HeadShard(1, 6, 2)
    assert torch.equal(_whole([p.transpose(1, 2) for p in pieces], t.output), out.transpose(1, 2))


def test_a_row_parallel_matmul_over_the_heads_is_a_partial_sum() -> None:
    x, w = torch.randn(5, 6 * 4), torch.randn(6 * 4, 7)  # attention output @ o_proj.weight.T
    cand = _claim(aten.mm.default, (x, w), [HeadShard(1, 6, 2), HeadShard(0, 6, 2)], x @ w, WORLD)
    assert cand.output == Partial()
    pieces = [a @ b for a, b in zip(_pieces(x, HeadShard(1, 6, 2), WORLD), _pieces(w, HeadShard(0, 6, 2), WORLD),
                                    strict=True)]
    torch.testing.assert_close(_whole(pieces, cand.output), x @ w, **TOL)


def test_attention_pairs_each_ranks_query_heads_with_its_groups_kv_head() -> None:
    q, k, v = torch.randn(1, 6, 5, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    target = aten._scaled_dot_product_flash_attention_for_cpu.default
    specs = (TensorSpec(tuple(q.shape), q.dtype), TensorSpec(tuple(k.shape), k.dtype),
             TensorSpec(tuple(v.shape), v.dtype))
    op = OpCall(target, specs, {"is_causal": True}, (TensorSpec(tuple(out.shape), out.dtype),
                                                     TensorSpec((1, 6, 5), torch.float32)), WORLD)
    qs, kv = HeadShard(1, 6, 2), GroupedShard(1, 2)
    (cand,) = registry.lookup(target)(op, [qs, kv, kv])
    assert cand.output[0] == qs
    pieces = [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
              for a, b, c in zip(_pieces(q, qs, WORLD), _pieces(k, kv, WORLD), _pieces(v, kv, WORLD), strict=True)]
    torch.testing.assert_close(_whole(pieces, qs), out, **TOL)
    assert registry.lookup(target)(op, [qs, R, R]) == []  # two kv heads cannot be replicated here


def test_spread_kv_heads_merge_into_the_query_heads_split() -> None:
    """repeat_kv: (B, 2, 1, S, D) -> (B, 2, 3, S, D) -> (B, 6, S, D), each rank its query heads' copies."""
    k = torch.randn(1, 2, 1, 5, 4)
    wide = k.expand(1, 2, 3, 5, 4)
    op = OpCall(aten.expand.default, (TensorSpec(tuple(k.shape), k.dtype), [1, 2, 3, 5, 4]), {},
                TensorSpec(tuple(wide.shape), wide.dtype), WORLD)
    spread = [c for c in registry.lookup(aten.expand.default)(op, [GroupedShard(1, 2)]) if c.output.inner is not None]
    (cand,) = spread
    assert cand.output == GroupedShard(1, 2, 2)  # 3 copies over the group's 2 ranks: 2 + 1
    merged = wide.reshape(1, 6, 5, 4)
    view = _claim(aten.view.default, (wide, [1, 6, 5, 4]), [cand.output], merged, WORLD)
    assert view.output == HeadShard(1, 6, 2)
    pieces = [p.expand(localize_sizes([1, 2, 3, 5, 4], cand.output, WORLD, r)).reshape(
        localize_sizes([1, 6, 5, 4], view.output, WORLD, r)) for r, p in enumerate(_pieces(k, GroupedShard(1, 2), WORLD))]
    assert torch.equal(_whole(pieces, view.output), merged)


def test_a_fused_shard_split_in_whole_heads_gives_each_rank_the_same_heads_of_every_segment() -> None:
    """GPT-2 XL's c_attn (q | k | v of 25 heads of 64) at tp=8: rank r holds heads 4 + 3 x 7 of each
    segment, the same ones in q, k and v; Falcon-7B's 71 q heads beside its whole k and v head."""
    from autotp.placement import StridedShard

    qkv = StridedShard(1, (1600, 1600, 1600), (), (25, 25, 25))
    assert str(qkv) == "S(1|1600:25h+1600:25h+1600:25h)" and parse(str(qkv)) == qkv
    assert qkv.fits(4800, 8) and not qkv.fits(4800, 32)  # 25 heads cannot give each of 32 ranks one
    assert [qkv.local_length(8, r) for r in (0, 1, 7)] == [768, 576, 576]
    assert qkv.pieces(1, 8) == [(256, 448), (1856, 2048), (3456, 3648)]  # heads 4-6 of q, k and v
    assert qkv.segment_placement(1, 8) == HeadShard(1, 25)
    assert qkv.whole_share(8) == 0  # unequal heads are the split's unevenness, not copies
    falcon = StridedShard(0, (4544, 64, 64), (1, 2), (71, 0, 0))
    assert parse(str(falcon)) == falcon and str(falcon) == "S(0|4544:71h+64r+64r)"
    assert falcon.pieces(7, 8) == [(4032, 4544), (4544, 4608), (4608, 4672)]  # its last 8 q heads, k, v
    assert [local_shape((4672, 4544), falcon, 8, r)[0] for r in (0, 7)] == [704, 640]
    merged = StridedShard(0, (25, 25), (), (25, 25))  # (B, 25 heads) merged into B*25 at batch 2
    assert merged.segment_size == 25 and merged.local_length_of(75, 8, 0) == 12  # 3 batches of heads 0-3


def test_kv_heads_held_per_group_inside_a_fused_shard_name_the_rows_a_group_shares() -> None:
    """Phi-3's qkv_proj with 8 query heads over 2 kv heads of 8 at tp=4: rank r holds its 2 q heads
    (16 rows) and kv head ``r // 2`` of k and of v (8 rows each), which the 2 ranks of its group
    hold alike; their gradient is summed over the group and their squares counted once (the
    training helpers ask ``grouped_local_bounds`` and ``holders``). Whole segments are held by all."""
    from autotp.placement import StridedShard

    qkv = parse("S(0|64+16/2+16/2)")
    assert qkv == StridedShard(0, (64, 16, 16), (), (), (0, 2, 2))
    assert qkv.pieces(3, 4) == [(48, 64), (72, 80), (88, 96)]  # q heads 6-7, kv head 1 of k and of v
    assert qkv.grouped_local_bounds(4, 3) == {2: [(16, 24), (24, 32)]}
    assert [qkv.holders(i, 4) for i in range(3)] == [1, 2, 2]
    falcon = parse("S(0|48:3h+16r+16r)")
    assert falcon.grouped_local_bounds(2, 1) == {} and [falcon.holders(i, 2) for i in range(3)] == [1, 2, 2]
