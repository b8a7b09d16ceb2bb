"""More ranks than key/value heads, planned at real widths: Megatron's plan, one kv head per rank.

``autotp.planner.plan_model`` (meta device, no weights, one process, 2 layers) with public models'
attention widths where tp exceeds the kv heads: the forward and one decode step must communicate
as Megatron's plan does (2 all-reduces per block and the embedding's, no all-gather but the
logits'), q and o are
sharded, and each k/v projection keeps whole heads: grouped (``S(0/KV)``, every rank holds the
kv head its query heads use, ``1/KV`` of the projection) or, with one kv head, replicated. The KV
cache per rank is then the cache's ``1/KV``.

Falcon's own layout keeps its one k and one v head inside the fused ``query_key_value`` weight:
that weight is stored with its q heads split and the k and v head whole on every rank
(``S(0|H*D+Dr+Dr)``), planned at 64 heads of 64 below (Falcon-7B's own 71 heads divide by no tp).
Its multi-query widths are also planned as a Llama-style config with one kv head.

Tolerances: none, these are exact counts of the collectives the planned program issues.
"""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from autotp.planner import plan_model

#: case -> (config fields, tp, expected k/v placement)
WIDTHS: dict[str, tuple[dict[str, Any], int, str]] = {
    # Llama-3-8B's attention and MLP widths (32 heads, 8 kv heads of 128) at tp=16: 2 ranks per kv head
    "llama3-8b-tp16": (
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
        ),
        16,
        "S(0/8)",
    ),
    # Falcon-7B-like multi-query widths as a Llama config: 64 heads of 64, one kv head, tp=8
    "mqa-64x64-tp8": (
        dict(
            hidden_size=4096,
            num_attention_heads=64,
            num_key_value_heads=1,
            intermediate_size=16384,
            vocab_size=65024,
        ),
        8,
        "R",
    ),
}


def _config(fields: dict[str, Any]) -> Any:
    return transformers.LlamaConfig(**fields, num_hidden_layers=2)


@pytest.mark.parametrize("case", list(WIDTHS))
def test_more_ranks_than_kv_heads_plan_megatrons_collectives(case: str) -> None:
    fields, tp, kv_placement = WIDTHS[case]
    report = plan_model(_config(fields), tp)
    assert report.block_collectives() == {"model.layers": {layer: {"all_reduce": 2} for layer in range(2)}}
    for call in (report.forward, report.decode):
        # the decode step may keep the residual stream partial and reduce it before each norm
        # instead (the same count): 2 per block + the vocab-parallel embedding's, and the logits
        assert call.collectives == {"all_reduce": 2 * 2 + 1, "all_gather": 1}
        assert [s["origin"] for s in call.sites if s["kind"] == "all_gather"] == ["lm_head"]
    kv_heads = fields["num_key_value_heads"]
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn."
        assert report.parameters[attn + "q_proj.weight"]["placement"] == "S(0)"
        assert report.parameters[attn + "o_proj.weight"]["placement"] == "S(1)"
        for name in ("k_proj.weight", "v_proj.weight"):
            assert report.parameters[attn + name]["placement"] == kv_placement
            assert report.parameters[attn + name]["local_shape"] == [head_dim, fields["hidden_size"]]
    assert (
        report.kv_cache_bytes_per_rank * kv_heads == report.kv_cache_bytes_total
    )  # one kv head of each layer's cache per rank


def test_grouped_placements_print_parse_and_size_one_kv_head_per_rank() -> None:
    from autotp.placement import GroupedShard, local_shape, parse

    grouped, spread = GroupedShard(0, 2), GroupedShard(1, 2, 2)
    assert (str(grouped), str(spread)) == ("S(0/2)", "S(1/2:2)")
    assert parse(str(grouped)) == grouped and parse(str(spread)) == spread
    assert local_shape((16, 64), grouped, 4) == (8, 64)  # one of 2 kv heads of 8 rows, on 2 ranks each
    assert local_shape((1, 2, 4, 9, 8), spread, 4) == (1, 1, 2, 9, 8)  # its kv head, 2 of 4 copies
    assert [grouped.group(r, 4) for r in range(4)] == [0, 0, 1, 1]


def test_a_kv_projection_is_tier_one_only_beyond_one_kv_head_per_rank() -> None:
    from autotp.passes.solve import head_floor

    nbytes, tp = 1024.0, 8
    replicated = nbytes * (tp - 1) / tp
    assert head_floor(replicated, 0, tp) == 0.0  # not a k/v projection
    assert head_floor(replicated, 8, tp) == 0.0  # as many kv heads as ranks: plain shards
    assert head_floor(replicated, 2, tp) == nbytes * (1 / 2 - 1 / 8)  # a kv head is 1/2 of it
    assert head_floor(replicated, 1, tp) == replicated  # multi-query: replicating it is the floor


def test_falcons_fused_multi_query_projection_splits_q_and_keeps_its_kv_head_whole_at_tp8() -> None:
    """Falcon-7B's block at 64 heads of 64, tp=8: each rank reads its 8 q heads and the whole k and v
    head out of ``query_key_value`` (640 of its 4224 rows); the prefill and the decode step then
    issue one all-reduce per block (parallel attention and MLP), the embedding's, and the logits'
    gather, and the KV cache (one kv head) is whole on every rank."""
    config = transformers.FalconConfig(hidden_size=4096, num_attention_heads=64, vocab_size=65024,
                                       num_hidden_layers=2, multi_query=True, new_decoder_architecture=False,
                                       parallel_attn=True, bias=False, alibi=False)
    report = plan_model(config, 8)
    assert report.block_collectives() == {"transformer.h": {layer: {"all_reduce": 1} for layer in range(2)}}
    for call in (report.forward, report.decode):
        assert call.collectives == {"all_reduce": 2 + 1, "all_gather": 1}
        assert [s["origin"] for s in call.sites if s["kind"] == "all_gather"] == ["lm_head"]
    for layer in range(2):
        qkv = report.parameters[f"transformer.h.{layer}.self_attention.query_key_value.weight"]
        assert qkv["placement"] == "S(0|4096+64r+64r)" and qkv["local_shape"] == [640, 4096]
    assert report.kv_cache_bytes_per_rank == report.kv_cache_bytes_total
    assert report.tp_plan is None and "held whole by every rank" in report.tp_plan_refusal
