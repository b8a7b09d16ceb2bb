"""The plan is Megatron's at the widths users run, not only at hidden 64.

Each architecture of the coverage table is planned (``autotp.planner.plan_model``: meta device, no
weights, one process) with a public model's real widths - hidden, heads, kv heads, head dim,
intermediate and vocabulary sizes - and 2 layers (deeper models repeat the same block), at every
tp in 2, 4 and 8 its sizes divide, at batch 1, and at batch 2 at the largest of them (planned once
for both batches: a batch-2 plan's warm-up graph is the batch-1 plan). A block's forward must then
communicate exactly as Megatron's
hand-written plan does: no all-gather inside any block, 2 all-reduces per block (1 for a parallel
residual, where the attention and MLP partial sums are added before one reduction; plus one value
per token for each norm over a sharded dim: OLMo-2's q/k norms), and at most one
all-gather in the whole forward: the logits, gathered at the model boundary (plus one for an
encoder's MLM head, see ``HEAD_MATRIX``). Every weight matrix of
a block is sharded (no per-token communication was traded for memory, and no memory for a few KB
of norm weights either way).

Tolerances: none, these are exact counts of the collectives the planned program issues.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import transformers

from autotp.plan_report import STATISTIC
from autotp.planner import plan_model
from tests.distributed.test_architectures import STATISTICS_PER_BLOCK, T5_ALL_REDUCES

#: arch -> (the public model whose widths these are, config class, fields, all-reduces per block, or
#: per stack of blocks for an encoder-decoder)
REAL_WIDTHS: dict[str, tuple[str, str, dict[str, Any], int | dict[str, int]]] = {
    "llama": ("Llama-3-8B", "LlamaConfig", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256), 2),
    "mistral": ("Mistral-7B", "MistralConfig", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=32000), 2),
    "qwen2": ("Qwen2.5-7B", "Qwen2Config", dict(
        hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
        vocab_size=152064), 2),
    "gpt2": ("GPT-2", "GPT2Config", dict(
        n_embd=768, n_head=12, n_inner=3072, vocab_size=50257), 2),
    "opt": ("OPT-1.3B", "OPTConfig", dict(
        hidden_size=2048, num_attention_heads=32, ffn_dim=8192, word_embed_proj_dim=2048, vocab_size=50272), 2),
    "bert": ("BERT-base", "BertConfig", dict(
        hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522), 2),
    "roberta": ("RoBERTa-base", "RobertaConfig", dict(
        hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=50265), 2),
    "gpt_neox": ("Pythia-1.4B", "GPTNeoXConfig", dict(
        hidden_size=2048, num_attention_heads=16, intermediate_size=8192, vocab_size=50304), 1),
    "phi3": ("Phi-3-mini", "Phi3Config", dict(
        hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
        vocab_size=32064), 2),
    "gemma2": ("Gemma-2-9B", "Gemma2Config", dict(
        hidden_size=3584, num_attention_heads=16, head_dim=256, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=256000), 2),
    "bloom": ("BLOOM-560M", "BloomConfig", dict(hidden_size=1024, n_head=16, vocab_size=250880), 2),
    "mixtral": ("Mixtral-8x7B", "MixtralConfig", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000), 2),
    # Falcon-7B's fused multi-query layout (parallel attention and MLP, one k and one v head inside
    # query_key_value) at 64 heads of 64: its own 71 heads of 64 (hidden 4544) divide by no tp
    "falcon": ("Falcon-7B, 64 heads", "FalconConfig", dict(
        hidden_size=4096, num_attention_heads=64, vocab_size=65024, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False), 1),
    # heads no tp divides inside a fused q|k|v projection, split in whole heads (StridedShard.heads):
    # Falcon-7B's own 71 heads of 64 beside its one k and v head, and GPT-2 XL's 25 heads of 64 in each
    # of q | k | v (c_attn cut by split)
    "falcon-7b": ("Falcon-7B", "FalconConfig", dict(
        hidden_size=4544, num_attention_heads=71, vocab_size=65024, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False), 1),
    "gpt2-xl": ("GPT-2 XL", "GPT2Config", dict(n_embd=1600, n_head=25, n_inner=6400, vocab_size=50257), 2),
    # an encoder-decoder: both stacks in one forward, per-stack all-reduces (T5_ALL_REDUCES)
    "t5": ("T5-base", "T5Config", dict(
        d_model=768, d_kv=64, d_ff=3072, num_heads=12, vocab_size=32128, num_decoder_layers=2,
        architectures=["T5ForConditionalGeneration"]), T5_ALL_REDUCES),
    "olmo2": ("OLMo-2-7B", "Olmo2Config", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
        vocab_size=100352), 2),
}

#: encoder heads with a hidden x hidden matrix of their own (the MLM transform): a large parameter,
#: so it is sharded (column-parallel), and its output is all-gathered before the head's layer norm:
#: one all-gather per forward outside the blocks, where Megatron keeps that matrix replicated
HEAD_MATRIX = {"bert", "roberta"}

#: sizes that must divide by tp (heads, kv heads, intermediate) - KV-head replication is planned
#: separately; a vocabulary need not divide (it is split unevenly, see the tests at the end)
_SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "intermediate_size", "n_inner",
                 "ffn_dim", "d_ff")
_BLOCK_MATRIX = re.compile(r"\.(?:layers|h|layer|block)\.\d+\..*weight$|\.experts\.")


#: widths planned only past the kv heads (not in the matrix): Phi-3-mini's fused qkv_proj with 4 kv heads
KV_PAST_RANKS: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "phi3-4kv": ("Phi-3-mini, 4 kv heads", "Phi3Config", dict(
        hidden_size=3072, num_attention_heads=32, num_key_value_heads=4, intermediate_size=8192,
        vocab_size=32064), 2),
}


def _config(arch: str) -> Any:
    _, cls, fields, _ = REAL_WIDTHS.get(arch) or KV_PAST_RANKS[arch]
    config = getattr(transformers, cls)(**fields, num_hidden_layers=2)  # (every config maps the name)
    if arch == "gemma2":
        config._attn_implementation = "eager"  # its soft-capping needs it, as transformers says
    return config


#: configs whose query heads no tp divides: split in whole heads at every tp that leaves each rank one
UNEVEN_HEADS = {"falcon-7b", "gpt2-xl"}


def _valid_tps(arch: str) -> list[int]:
    fields = REAL_WIDTHS[arch][2]
    split = [f for f in _SPLIT_FIELDS if f in fields and not (arch in UNEVEN_HEADS and f in ("num_attention_heads",
                                                                                              "n_head"))]
    return [tp for tp in (2, 4, 8) if all(fields[f] % tp == 0 for f in split)]


#: every valid tp at batch 1; batch 2 (eager attention merges batch and heads into one dim) at the
#: largest valid tp, where each rank holds the fewest heads (every valid tp at batch 2 passed when it
#: was added; the whole matrix twice would cost the suite another ~90 s)
CASES = [pytest.param(arch, tp, 1, id=f"{arch}-tp{tp}") for arch in REAL_WIDTHS for tp in _valid_tps(arch)] + \
    [pytest.param(arch, max(_valid_tps(arch)), 2, id=f"{arch}-tp{max(_valid_tps(arch))}-batch2") for arch in REAL_WIDTHS]

#: arch -> its batch-2 plan at the largest valid tp, made by that tp's batch-1 case and read by its
#: batch-2 case (then dropped)
_BATCH2_PLANS: dict[str, Any] = {}

#: (arch, tp) -> a batch-1 plan of the matrix that a later test reads too (None until the matrix
#: made it): GPT-2's at tp=2 is :func:`test_a_batch_2_plan_keeps_its_warm_up_which_is_the_batch_1_plan`'s
_READ_AGAIN: dict[tuple[str, int], Any] = {("gpt2", 2): None}


def _planned(arch: str, tp: int, batch: int) -> tuple[Any, Any]:
    """The plan of ``arch`` at ``tp`` and ``batch`` (decode not planned) and its forward graph at that
    batch. A batch-2 plan compiles the warm-up (batch 1, ``2*tp+1`` tokens: the free solve that fixes
    the plan) before the batch-2 forward, and keeps it (``PlanReport.warmup``): at the largest tp
    that graph is the batch-1 case, so the model is planned once for both (the warm-up is the
    batch-1 plan: :func:`test_a_batch_2_plan_keeps_its_warm_up_which_is_the_batch_1_plan`)."""
    largest = tp == max(_valid_tps(arch))
    if largest and batch == 2 and arch in _BATCH2_PLANS:
        report = _BATCH2_PLANS.pop(arch)
    else:
        report = plan_model(_config(arch), tp, decode=False, batch=2 if largest else batch)
    if largest and batch == 1:
        _BATCH2_PLANS[arch] = report
        return report, report.warmup
    if (arch, tp) in _READ_AGAIN and batch == 1:
        _READ_AGAIN[arch, tp] = report
    return report, report.forward


@pytest.mark.parametrize(("arch", "tp", "batch"), CASES)
def test_a_real_width_forward_communicates_like_megatron(arch: str, tp: int, batch: int) -> None:
    report, forward = _planned(arch, tp, batch)
    assert forward.input_shape == (batch, 2 * tp + 1)
    all_reduces = REAL_WIDTHS[arch][3]
    # norms over a sharded dim add one value per token each (statistics)
    statistics = {"all_reduce" + STATISTIC: STATISTICS_PER_BLOCK[arch]} if arch in STATISTICS_PER_BLOCK else {}

    def blocks(n: int) -> dict[int, dict[str, int]]:
        return {layer: {"all_reduce": n, **statistics} for layer in range(2)}

    if isinstance(all_reduces, dict):  # an encoder-decoder, whose stacks' blocks share indices
        assert forward.block_collectives() == {stack: blocks(n) for stack, n in all_reduces.items()}
    else:
        assert list(forward.block_collectives().values()) == [blocks(all_reduces)]  # one stack
    gathers = [s["origin"] for s in forward.sites if s["kind"] == "all_gather"]
    assert len(gathers) <= 1 + (arch in HEAD_MATRIX), gathers

    replicated_matrices = [name for name, p in report.parameters.items()
                           if p["placement"] == "R" and len(p["global_shape"]) >= 2 and _BLOCK_MATRIX.search(name)
                           # an MoE router and T5's (32 buckets, heads) position-bias table are a few KB: replicated
                           and not name.endswith((".gate.weight", ".relative_attention_bias.weight"))]
    assert replicated_matrices == []


def test_a_batch_2_plan_keeps_its_warm_up_which_is_the_batch_1_plan() -> None:
    """``plan_model`` at batch 2 first compiles the warm-up (batch 1, ``2*tp+1`` tokens), whose free
    solve fixes the plan: the report keeps that graph, and it is what a plan at batch 1 reports as
    its forward (the same collectives, at the same sites, of the same bytes), with the same
    parameter placements. A plan at the warm-up shape has no separate warm-up."""
    config = _config("gpt2")
    one = _READ_AGAIN["gpt2", 2] or plan_model(config, 2, decode=False)  # the matrix's, where it ran first
    two = plan_model(config, 2, decode=False, batch=2)

    assert one.warmup is None and two.warmup is not None
    assert (two.warmup.input_shape, two.forward.input_shape) == ((1, 5), (2, 5))
    for field in ("input_shape", "collectives", "collective_bytes", "sites", "cost"):
        assert getattr(two.warmup, field) == getattr(one.forward, field), field
    assert two.parameters == one.parameters


@pytest.mark.parametrize("tp", _valid_tps("t5"))
def test_t5_decode_steps_reduce_three_times_per_decoder_block_and_gather_only_the_logits(tp: int) -> None:
    """T5-base's decode steps as ``generate`` runs them under ``parallelize_model``, the first and
    every later one: the decoder alone, one new token per sequence, reading the encoder's output
    (gathered when the encoder's call returned) and a KV cache, empty on the first step and filled
    by the prefill on the later one. Each decoder block issues
    Megatron's all-reduces, one after each row-parallel matmul (self-attention, cross-attention,
    MLP); the encoder does not run; outside the blocks the vocab-parallel lookup of the new token
    is reduced and the logits are gathered. The cache each rank holds is its share of the
    self-attention's and the cross-attention's keys and values."""
    report = plan_model(_config("t5"), tp)

    assert report.decode is not None, report.decode_note
    # generate's first decoder call (an empty cache: each block projects the cross-attention's keys
    # and values from the encoder's output and stores them) is a graph of its own, and communicates alike
    for step in (report.first_decode, report.decode):
        assert step is not None and step.input_shape == (1, 1)
        assert step.block_collectives() == {"decoder.block": {layer: {"all_reduce": 3} for layer in range(2)}}
        outside = [(s["kind"], s["origin"]) for s in step.outside_blocks()]
        assert outside == [("all_reduce", "decoder.embed_tokens"), ("all_gather", "lm_head")]
    # the prefill before it (with the cache it fills) is the matrix's forward
    assert report.block_collectives() == {
        stack: {layer: {"all_reduce": n} for layer in range(2)} for stack, n in T5_ALL_REDUCES.items()}
    fields = REAL_WIDTHS["t5"][2]
    positions = 2 * tp + 1  # self-attention's decoder positions, cross-attention's encoder positions
    cache_bytes = 2 * 2 * 2 * positions * fields["d_model"] * 4  # layers x (self, cross) x (k, v), fp32
    assert (report.kv_cache_bytes_total, report.kv_cache_bytes_per_rank) == (cache_bytes, cache_bytes // tp)


def _vocabulary_rows(report: Any) -> dict[str, list[int]]:
    """Each vocabulary-sized parameter's rows on every rank, from the plan."""
    return {name: p["rows_per_rank"] for name, p in report.parameters.items() if p.get("rows_per_rank")}


def test_gpt2_with_its_real_vocabulary_holds_about_half_the_model_per_rank_at_tp2() -> None:
    """50257 = 25129 + 25128: the tied table is split unevenly instead of replicated (31% of GPT-2
    small on every rank before), so a rank holds at most 0.55 of the parameters."""
    config = transformers.GPT2Config(n_embd=768, n_head=12, n_inner=3072, vocab_size=50257, n_layer=12)
    report = plan_model(config, 2, decode=False)

    assert report.parameters["transformer.wte.weight"]["placement"] == "S(0)"
    assert _vocabulary_rows(report) == {"transformer.wte.weight": [25129, 25128], "lm_head.weight": [25129, 25128]}
    assert report.param_bytes_per_rank <= 0.55 * report.param_bytes_total


def test_a_bert_vocabulary_of_30522_is_split_over_four_ranks() -> None:
    """MiniLM / BERT's 30522 entries at tp=4: 7631 + 7631 + 7631 + 7629 rows, the word embedding and
    the tied MLM decoder with its bias alike, and the blocks still communicate like Megatron."""
    config = transformers.BertConfig(hidden_size=384, num_attention_heads=12, intermediate_size=1536,
                                     vocab_size=30522, num_hidden_layers=2)
    config.architectures = ["BertForMaskedLM"]
    report = plan_model(config, 4, decode=False)

    rows = _vocabulary_rows(report)
    assert rows["bert.embeddings.word_embeddings.weight"] == [7631, 7631, 7631, 7629]
    assert all(r == [7631, 7631, 7631, 7629] for r in rows.values()), rows
    assert report.block_collectives() == {"bert.encoder.layer": {layer: {"all_reduce": 2} for layer in range(2)}}


def test_an_untied_lm_head_over_a_vocabulary_with_one_added_token_is_split_like_its_table() -> None:
    """Mistral-7B's widths with one token added (32001, odd): the table and the separate lm_head
    both hold 16001 / 16000 rows, and only the logits are gathered."""
    _, cls, fields, _ = REAL_WIDTHS["mistral"]
    config = getattr(transformers, cls)(**{**fields, "vocab_size": 32001}, num_hidden_layers=2)
    report = plan_model(config, 2, decode=False)

    assert _vocabulary_rows(report) == {"model.embed_tokens.weight": [16001, 16000], "lm_head.weight": [16001, 16000]}
    assert report.block_collectives() == {"model.layers": {layer: {"all_reduce": 2} for layer in range(2)}}
    assert [s["origin"] for s in report.forward.sites if s["kind"] == "all_gather"] == ["lm_head"]


def test_qwen2_5_7b_plans_at_tp8_with_its_28_heads_split_4_and_3_per_kv_head() -> None:
    """28 query heads over 4 kv heads at tp=8: 4 groups of 2 ranks, each group holds its kv head and
    shares its 7 query heads as 4 + 3, so attention stays on each rank. Prefill and decode step
    communicate as Megatron's (2 all-reduces per block, only the logits gathered), and the plan says
    where ranks carry unequal work."""
    report = plan_model(_config("qwen2"), 8)

    for step in (report.forward, report.decode):
        assert step.block_collectives() == {"model.layers": {layer: {"all_reduce": 2} for layer in range(2)}}
        assert [s["origin"] for s in step.sites if s["kind"] == "all_gather"] == ["lm_head"]
    params = report.parameters
    attn = "model.layers.0.self_attn."
    assert {name: params[attn + name]["placement"] for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                                 "v_proj.weight", "o_proj.weight")} == {
        "q_proj.weight": "S(0:28h/4)", "q_proj.bias": "S(0:28h/4)", "k_proj.weight": "S(0/4)",
        "v_proj.weight": "S(0/4)", "o_proj.weight": "S(1:28h/4)"}
    assert params[attn + "q_proj.weight"]["rows_per_rank"] == [512, 384] * 4
    assert params[attn + "o_proj.weight"]["uneven"] == \
        "dim 1 of 3584 (28 heads of 128, 4 kv groups) over tp=8: heads 4/3/4/3/4/3/4/3"
    assert params[attn + "q_proj.weight"]["local_shape"] == [512, 3584]  # rank 0's: 4 heads


@pytest.mark.parametrize(("arch", "tp", "qkv", "placement", "rows"), [
    # 71 q heads over 8 ranks are 9 x 7 + 8, each rank beside them the one k and the one v head whole
    ("falcon-7b", 8, "transformer.h.0.self_attention.query_key_value.weight", "S(0|4544:71h+64r+64r)",
     [(9 + 2) * 64] * 7 + [(8 + 2) * 64]),
    # 25 heads in each of q | k | v over 8 ranks are 4 + 3 x 7, the same heads of each segment
    ("gpt2-xl", 8, "transformer.h.0.attn.c_attn.weight", "S(1|1600:25h+1600:25h+1600:25h)",
     [4 * 64 * 3] + [3 * 64 * 3] * 7),
    # GPT-2's 12 heads over 8 ranks are 2 x 4 + 1 x 4
    ("gpt2", 8, "transformer.h.0.attn.c_attn.weight", "S(1|768:12h+768:12h+768:12h)",
     [2 * 64 * 3] * 4 + [1 * 64 * 3] * 4),
    # 4 kv heads of 96 over 8 ranks: q split evenly, each kv head held by its group of 2 ranks
    ("phi3-4kv", 8, "model.layers.0.self_attn.qkv_proj.weight", "S(0|3072+384/4+384/4)", [(4 + 1 + 1) * 96] * 8),
], ids=["falcon-7b-tp8", "gpt2-xl-tp8", "gpt2-tp8", "phi3-4-kv-heads-tp8"])
def test_a_fused_qkv_whose_heads_no_tp_divides_is_split_in_whole_heads_of_each_segment(
        arch: str, tp: int, qkv: str, placement: str, rows: list[int]) -> None:
    """The fused projection's output is stored with each segment split in whole heads, so every
    rank's q, k and v hold the same heads (q's only, beside the one k and v head of multi-query
    attention, or the kv head its group of ranks holds), and prefill and decode step communicate as
    Megatron's: no all-gather but the logits."""
    from autotp.placement import local_shape, parse

    report = plan_model(_config(arch), tp)

    for step in (report.forward, report.decode):
        blocks = (REAL_WIDTHS.get(arch) or KV_PAST_RANKS[arch])[3]
        assert list(step.block_collectives().values()) == [{layer: {"all_reduce": blocks} for layer in range(2)}]
        assert [s["origin"] for s in step.sites if s["kind"] == "all_gather"] == ["lm_head"]
    entry = report.parameters[qkv]
    assert entry["placement"] == placement
    shape, stored = tuple(entry["global_shape"]), parse(placement)
    assert [local_shape(shape, stored, tp, rank)[stored.dim] for rank in range(tp)] == rows


@pytest.mark.parametrize(("cls", "fields", "tp", "named", "valid"), [
    # Qwen2.5-7B at tp=32: 7 query heads per kv head over 8 ranks would leave a rank without one
    ("Qwen2Config", REAL_WIDTHS["qwen2"][2], 32, "num_attention_heads=28", "[1, 2, 4, 8, 16]"),
    # GPT-2's 12 heads at tp=16: fewer heads than ranks
    ("GPT2Config", REAL_WIDTHS["gpt2"][2], 16, "num_attention_heads=12", "[1, 2, 3, 4, 6, 8, 12]"),
], ids=["qwen2.5-7b-tp32", "gpt2-tp16"])
def test_a_head_count_no_split_serves_is_refused_with_the_valid_tps(cls: str, fields: dict, tp: int, named: str,
                                                                    valid: str) -> None:
    """Heads split in whole heads, at least one per rank: the refusal names the count and lists the
    tps that work."""
    from autotp.errors import AutoTPError

    config = getattr(transformers, cls)(**fields, num_hidden_layers=2)
    with pytest.raises(AutoTPError, match=re.escape(named)) as refused:
        plan_model(config, tp, decode=False)
    assert f"Valid tp sizes for this model: {valid}" in str(refused.value)
