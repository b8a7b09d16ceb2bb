"""The architecture matrix: any transformers architecture, tensor-parallel with no per-model code.

Each case saves a tiny seeded checkpoint of a real transformers architecture (``tests/_tiny.py``:
2 layers, hidden 64, 8 heads, vocab 128, a pad id at the top of the vocabulary), loads it with
``parallelize_model(folder, tp_size=N)`` on N gloo ranks, and compares with one process running
plain transformers:

* decoders: logits of one forward, and the tokens of a greedy ``generate`` (must be identical)
  with the logits of each of its steps;
* encoders: ``last_hidden_state`` (BERT) or the masked-LM logits (RoBERTa);
* encoder-decoder (T5): logits with decoder inputs, and the tokens and step logits of a greedy ``generate``
  (which runs the encoder through ``model.get_encoder()``, outside ``forward``);
* the load cases run with ``layer_regions=True``: each decoder layer goes through its layer region
  (``autotp/regions.py``: traced once, reused for the next layer, inlined before planning), the
  path every model of ``regions.MIN_LAYERS`` (4) layers or more takes; at 2 layers only where asked.
  The ``-compile`` cases (the ``backend="autotp"`` entry installs no regions) and the other
  multi-rank files plan the layers as Dynamo inlines them;
* ``torch.compile(model.forward, backend="autotp")`` (the ``-compile`` cases) also: the logits of
  every step of that ``generate``, the collectives it issued (one all-gather per call, the
  logits', at the call's return: none inside any graph, the KV cache staying sharded across
  steps), and a cache reordered eagerly, as beam search does, refused (:func:`_compiled_decoding`).

Plans are asserted too, in one process with ``autotp.planner.plan_model`` (the same solver on the
same warm-up call as ``parallelize_model``, with counted, simulated collectives): every decoder's
forward has exactly :data:`ALL_REDUCES_PER_BLOCK` all-reduces per block and no other collective in
a block, and Mixtral's MoE is tensor-parallel (router replicated, experts sharded on their
intermediate dim, one all-reduce after the experts).

Tolerance: atol 1e-5, rtol 1e-4 (fp32), as in tests/distributed/test_parallelize.py: row-parallel
matmuls, vocab-parallel lookups and ``replicated_share`` (a Replicate summand divided by N, exact
for N = 2 and 4) sum partial results across ranks, which reorders fp32 additions.

:func:`run_case` is shared with ``benchmarks/coverage.py``, which writes the README coverage table.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from autotp import session_of
from autotp.plan_report import STATISTIC
from tests._dist import run_ranks
from tests._tiny import ARCHS, save_tiny, through_regions, tiny_config, tiny_plan

pytestmark = pytest.mark.dist

PAD_ID = 120  # upper part of the 128-token vocabulary: lives on the last rank's shard
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
DECODER_PROMPT = [[PAD_ID, 4, 9]]  # T5 starts decoding from the pad id
NEW_TOKENS = 8
ATOL, RTOL = 1e-5, 1e-4


@dataclass(frozen=True)
class Case:
    """One architecture of the matrix and what is compared."""

    arch: str
    kind: str  # "decoder" | "encoder" | "seq2seq"
    worlds: tuple[int, ...] = (2,)
    overrides: dict[str, Any] = field(default_factory=dict)
    #: "load": ``parallelize_model(folder)``; "compile": the in-memory model's ``forward`` compiled
    #: with ``backend="autotp"`` (same weights on every rank), then ``generate`` through it
    path: str = "load"

    @property
    def id(self) -> str:
        return self.arch if self.path == "load" else f"{self.arch}-compile"


CASES = [
    Case("gpt2", "decoder", (2, 4)),
    Case("opt", "decoder", (2,)),
    Case("bert", "encoder", (2,)),
    Case("roberta", "encoder", (2,)),
    Case("gpt_neox", "decoder", (2,)),
    Case("gpt_neox", "decoder", (2,), path="compile"),
    Case("phi3", "decoder", (2, 4)),
    Case("falcon", "decoder", (2,)),
    Case("gemma2", "decoder", (2,)),
    Case("bloom", "decoder", (2,)),
    Case("t5", "seq2seq", (2,), {"decoder_start_token_id": PAD_ID}),
    Case("mixtral", "decoder", (2,)),
    Case("mixtral", "decoder", (2,), path="compile"),
    Case("olmo2", "decoder", (2,)),
]
BY_ID = {c.id: c for c in CASES}

#: decoders whose per-block collectives are asserted (the core issue's Llama family too)
BLOCK_ARCHS = sorted({c.arch for c in CASES if c.kind == "decoder"} | {"llama", "mistral", "qwen2"})
#: all-reduces per block in forward. 2 is the Megatron minimum for a block whose attention and MLP
#: run one after the other: each ends in a row-parallel matmul whose partial sums must be reduced
#: before the next norm reads them. A parallel residual (``x + attn(ln1(x)) + mlp(ln2(x))``:
#: GPT-NeoX, Falcon-7B's ``parallel_attn``) adds both partial sums before one all-reduce, so its
#: minimum is 1.
ALL_REDUCES_PER_BLOCK: dict[str, int] = {arch: 2 for arch in BLOCK_ARCHS} | {"gpt_neox": 1, "falcon": 1}
#: all-reduces of a per-token statistic per block: a norm over a sharded dim (OLMo-2's q_norm and
#: k_norm over all heads) reduces its mean square (one value per token) instead of gathering its input
STATISTICS_PER_BLOCK: dict[str, int] = {"olmo2": 2}
#: arch -> why its per-block count cannot be asserted yet (strict xfail)
BLOCK_COUNT_XFAIL: dict[str, str] = {}

#: case id -> why it does not work yet (the test is a strict xfail: it must fail, for that reason)
KNOWN_FAILURES: dict[str, str] = {}


def _model_class(arch: str) -> Any:
    import transformers

    return getattr(transformers, ARCHS[arch][1])


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": torch.tensor(PROMPT)}
    if case.kind == "seq2seq":
        inputs["decoder_input_ids"] = torch.tensor(DECODER_PROMPT)
    return inputs


def _main_output(out: Any) -> torch.Tensor:
    """The tensor a case compares: logits where the model has a head, else the last hidden state."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _generates(case: Case) -> bool:
    """Decoders and T5 (whose ``generate`` runs the encoder outside ``forward``) generate; encoders do not."""
    return case.kind in ("decoder", "seq2seq")


def _generate(model: Any) -> Any:
    """The matrix's greedy ``generate`` of :data:`PROMPT`, with each step's logits."""
    return model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID,
                          return_dict_in_generate=True, output_logits=True)


def reference(case: Case, folder: Path) -> tuple[torch.Tensor, list[int] | None, list[torch.Tensor] | None]:
    """One process, plain transformers: the compared output, the greedy tokens and each of their
    steps' logits."""
    model = _model_class(case.arch).from_pretrained(folder).eval()
    with torch.no_grad():
        out = _main_output(model(**_inputs(case)))
        generated = _generate(model) if _generates(case) else None
    return out, (generated.sequences[0].tolist() if generated else None), (list(generated.logits) if generated else None)


def _rank(rank: int, world: int, case_id: str, folder: str) -> dict[str, Any]:
    case = BY_ID[case_id]
    if case.path == "load":
        from autotp import parallelize_model

        model = parallelize_model(folder, tp_size=world, layer_regions=True)
    else:
        model = _model_class(case.arch).from_pretrained(folder).eval()
        model.forward = torch.compile(model.forward, backend="autotp")
    with torch.no_grad():
        out = _main_output(model(**_inputs(case)))
        if case.path == "compile":
            decoding = _compiled_decoding(model)
        elif _generates(case):
            generated = _generate(model)
            decoding = {"tokens": generated.sequences[0].tolist(), "step_logits": list(generated.logits)}
        else:
            decoding = {"tokens": None}
    return {"output": out, "plan": session_of(model).plans[0], "regional": through_regions(model),
            **decoding}  # the model's first graph


def _compiled_decoding(model: Any) -> dict[str, Any]:
    """The matrix's ``generate`` through ``forward`` compiled with ``backend="autotp"``: its tokens,
    each step's logits, the collectives it issued, the calls it made, whether the cache it returned
    still holds this rank's heads only, and the all-gathers inside the compiled graphs; then one
    decode step on that cache reordered eagerly, as beam search reorders it (``reorder_cache``:
    ``index_select`` on every entry), whose error it returns."""
    from autotp.context import shard_of
    from autotp.kv_cache import cache_keyword, cache_layers, returned_cache

    comm = session_of(model).comm
    comm.reset_counts()
    generated = _generate(model)
    counts = dict(comm.counts)
    cache = returned_cache(generated)
    sharded = all(shard_of(t) is not None for layer in cache_layers(cache) for t in (layer.keys, layer.values))
    cache.reorder_cache(torch.tensor([0]))
    try:  # Dynamo wraps a backend's error (BackendCompilerFailed)
        step = model(input_ids=generated.sequences[:, -1:], use_cache=True, **{cache_keyword(type(model).forward): cache})
        reordered_error = f"no error; logits finite: {bool(torch.isfinite(step.logits).all())}"
    except Exception as e:  # noqa: BLE001 - the text is what is compared
        reordered_error = f"{type(e).__name__}: {e}"
    return {"tokens": generated.sequences[0].tolist(), "step_logits": list(generated.logits), "counts": counts,
            "calls": len(generated.logits), "cache_sharded": sharded, "reordered_error": reordered_error,
            "gathers_in_graphs": [g.plan["collectives"].get("all_gather", 0) for g in session_of(model).graphs]}


def save_case(case: Case, folder: Path, **overrides: Any) -> Path:
    return save_tiny(case.arch, folder, pad_token_id=PAD_ID, **{**case.overrides, **overrides})


def run_case(case: Case, world: int, folder: Path) -> dict[str, Any]:
    """Run ``case`` on ``world`` ranks from the checkpoint in ``folder`` and compare with one process.

    Returns rank 0's plan and the wall time; raises AssertionError on a mismatch."""
    ref_out, ref_tokens, ref_steps = reference(case, folder)
    start = time.perf_counter()
    results = run_ranks(_rank, world, case.id, str(folder))
    seconds = time.perf_counter() - start
    for r in results:
        if case.path == "load" and case.kind == "decoder":  # every layer went through its region
            assert r["regional"] and all(r["regional"]), r["regional"]
        assert r["output"].shape == ref_out.shape
        torch.testing.assert_close(r["output"], ref_out, atol=ATOL, rtol=RTOL)
        assert r["tokens"] == ref_tokens, f"greedy tokens differ: {r['tokens']} != {ref_tokens}"
        if case.path == "compile":
            assert_compiled_decoding(r, ref_steps)
        elif ref_steps is not None:
            assert_step_logits(r["step_logits"], ref_steps)
    return {"plan": results[0]["plan"], "seconds": seconds}


def assert_compiled_decoding(r: dict[str, Any], ref_steps: list[torch.Tensor]) -> None:
    """What :func:`_compiled_decoding` saw on one rank. Before: the backend returned every graph
    output whole, so each layer's keys and values were all-gathered inside the graph on every
    decode step; and a cache beam search had reordered (its entries plain NaN tensors once the
    shard they stood in for was lost) generated wrong tokens without an error."""
    assert len(r["step_logits"]) == r["calls"]
    assert_step_logits(r["step_logits"], ref_steps)
    assert r["cache_sharded"]  # every layer's keys and values are stand-ins holding this rank's heads
    assert r["counts"].get("all_gather", 0) == r["calls"]  # the logits', when each call returns
    assert r["counts"].get("all_reduce", 0) > 0  # the steps did run tensor-parallel
    assert r["gathers_in_graphs"] and not any(r["gathers_in_graphs"])  # none inside any graph
    assert "AutoTPError: graph input" in r["reordered_error"], r["reordered_error"]
    assert "changed outside the model" in r["reordered_error"], r["reordered_error"]


def assert_step_logits(steps: list[torch.Tensor], ref_steps: list[torch.Tensor]) -> None:
    """Every step of the greedy ``generate`` scored the vocabulary as one process did (not only
    picked the same token)."""
    assert len(steps) == len(ref_steps)
    for step, ref in zip(steps, ref_steps, strict=True):
        torch.testing.assert_close(step, ref, atol=ATOL, rtol=RTOL)


def _params(case: Case) -> list[Any]:
    out = []
    for world in case.worlds:
        marks = []
        if case.id in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[case.id]))
        out.append(pytest.param(case, world, id=f"{case.id}-tp{world}", marks=marks))
    return out


@pytest.mark.parametrize(("case", "world"), [p for c in CASES for p in _params(c)])
def test_architecture_matches_one_process(tmp_path: Path, case: Case, world: int) -> None:
    folder = save_case(case, tmp_path / case.arch)
    result = run_case(case, world, folder)
    sharded = [fqn for fqn, e in result["plan"]["parameters"].items() if e["shard_dim"] is not None]
    # every architecture here has matmuls worth splitting: a plan of only replicas is a regression
    assert sharded, f"{case.id}: no parameter is sharded"
    if case.arch == "mixtral":
        assert_moe_is_tensor_parallel(result["plan"]["parameters"], num_layers=2)
    if case.arch == "t5":  # block 0's position bias split by heads, its lookup moving nothing (the plan tests)
        bias = {k: e["placement"] for k, e in result["plan"]["parameters"].items() if "relative_attention_bias" in k}
        assert set(bias.values()) == {"S(1)"} and len(bias) == 2, bias
        assert "reduce_scatter" not in result["plan"]["collectives"], result["plan"]["collectives"]
    if case.arch == "falcon":  # q heads split, the one k and v head whole on every rank (8 heads of 8)
        for layer in range(2):
            qkv = result["plan"]["parameters"][f"transformer.h.{layer}.self_attention.query_key_value.weight"]
            assert qkv["placement"] == "S(0|64+8r+8r)"


def assert_moe_is_tensor_parallel(parameters: dict[str, dict[str, Any]], num_layers: int) -> None:
    """Router replicated; every rank holds every expert's slice of the intermediate dim: gate_up
    (E, 2I, H) strided over its gate and up halves, down (E, H, I) on I."""
    intermediate = 128
    for layer in range(num_layers):
        mlp = f"model.layers.{layer}.mlp"
        assert parameters[f"{mlp}.gate.weight"]["placement"] == "R"
        assert parameters[f"{mlp}.experts.gate_up_proj"]["placement"] == f"S(1|{intermediate}+{intermediate})"
        assert parameters[f"{mlp}.experts.down_proj"]["placement"] == "S(2)"


def _plan(arch: str, dtype: str | None = None) -> Any:
    """The matrix's tiny ``arch`` planned at tp=2 (once per session: other files read the same plans)."""
    return tiny_plan(arch, dtype=dtype, pad_token_id=PAD_ID)


@pytest.mark.parametrize("arch", [
    pytest.param(a, marks=[pytest.mark.xfail(strict=True, raises=AssertionError, reason=BLOCK_COUNT_XFAIL[a])]
                 if a in BLOCK_COUNT_XFAIL else [])
    for a in BLOCK_ARCHS])
def test_decoder_forward_has_the_minimum_all_reduces_per_block(arch: str) -> None:
    report = _plan(arch)
    expected = {"all_reduce": ALL_REDUCES_PER_BLOCK[arch]}
    if arch in STATISTICS_PER_BLOCK:
        expected["all_reduce" + STATISTIC] = STATISTICS_PER_BLOCK[arch]
    assert list(report.block_collectives().values()) == [{layer: expected for layer in range(2)}]  # one stack


#: T5's blocks: the encoder's self-attention and MLP, the decoder's self-attention, cross-attention
#: and MLP, each ending in a row-parallel matmul whose partial sums one all-reduce joins
T5_ALL_REDUCES = {"encoder.block": 2, "decoder.block": 3}


@pytest.mark.parametrize("tp", [2, 4])  # tiny T5's 8 heads divide by both
def test_t5_encoder_blocks_reduce_twice_and_decoder_blocks_three_times(tp: int) -> None:
    """An encoder-decoder is planned on both stacks in one forward (the decoder reads its own ids),
    and each block issues Megatron's all-reduces, one per row-parallel matmul, nothing gathered or
    scattered.

    Block 0 of each stack also looks up the relative-position bias, a (buckets, heads) table. At
    hidden 64 it is a large parameter (``passes/solve.py``: objective), and it is no vocabulary (the
    graph computes its buckets), so it may be split by columns (``autotp/ops/embedding.py``): each
    rank looks up its own heads' biases, which is what attention wants, and the lookup issues no
    collective. The least-communication plan is proved (certificate gap 0).

    At tp=2 the batch-1 plan is read off :func:`_t5_at_batch_2`: its warm-up is that plan (the
    parameters it fixed and the graph it solved freely), so tiny T5 is planned once for both tests."""
    report, graph = (_t5_at_batch_2(), "warm-up") if tp == 2 else (tiny_plan("t5", tp, pad_token_id=PAD_ID), "forward")

    assert report.graph(graph).input_shape == (1, 2 * tp + 1)
    assert report.block_collectives(graph) == _t5_blocks()
    assert {name: p["placement"] for name, p in report.parameters.items() if "relative_attention_bias" in name} \
        == {f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "S(1)"
            for stack in ("encoder", "decoder")}
    assert report.graph(graph).gap == 0


def test_t5_position_bias_split_by_heads_is_an_override_and_its_row_split_costs_a_reduce_scatter() -> None:
    """``shard(1)`` on the bias table (each rank its heads' columns) is the free plan, and accepted
    as an override; ``shard(0)`` (rows, like a vocabulary) is honoured too, and its partial lookup
    is reduce-scattered onto the heads in block 0 of each stack: the split the solver avoids."""
    from autotp.planner import plan_model

    by_heads = tiny_plan("t5", overrides={"*relative_attention_bias*": "shard(1)"}, pad_token_id=PAD_ID)
    by_rows = plan_model(tiny_config("t5", pad_token_id=PAD_ID), 2, decode=False,
                         overrides={"*relative_attention_bias*": "shard(0)"})

    assert by_heads.block_collectives() == _t5_blocks()
    assert by_heads.forward.collectives == _t5_at_batch_2().warmup.collectives  # the free batch-1 plan's
    bias = {"reduce_scatter": 1}
    assert by_rows.block_collectives() == {stack: {0: blocks[0] | bias, 1: blocks[1]}
                                           for stack, blocks in _t5_blocks().items()}


def _t5_blocks() -> dict[str, dict[int, dict[str, int]]]:
    """Tiny T5's collectives per stack and block (see the tests above)."""
    return {stack: {block: {"all_reduce": n} for block in range(2)} for stack, n in sorted(T5_ALL_REDUCES.items())}


@functools.cache
def _t5_at_batch_2() -> Any:
    """Tiny T5 planned at tp=2 for a batch of 2 (once per session; read it, never change it): the
    warm-up (batch 1, ``2*tp+1`` tokens) whose free solve fixes every placement, kept as
    ``warmup`` (the batch-1 plan: ``tests/unit/test_plans_at_real_widths.py:
    test_a_batch_2_plan_keeps_its_warm_up_which_is_the_batch_1_plan``), then the batch-2 forward
    solved with them pinned."""
    from autotp.planner import plan_model

    return plan_model(tiny_config("t5", pad_token_id=PAD_ID), 2, decode=False, batch=2)


def test_t5_at_batch_2_keeps_its_blocks_plan_where_the_certificate_widens_the_beam() -> None:
    """The batch-2 forward, solved with the batch-1 warm-up's parameters pinned, once ended at a
    beam of 32 in a costlier plan (64,592 against the certificate's 60,496: a reduce-scatter, a
    batch-sharded norm and two all-gathers at the encoder's end). Whatever width the search needs
    (``passes/solve.py``: where the certificate leaves a gap, the search ranks near-equal states by
    the reduction they owe and widens), the plan must be the batch-1 blocks, proved optimal."""
    report = _t5_at_batch_2()

    assert report.forward.input_shape == (2, 5)
    assert report.block_collectives() == _t5_blocks()
    assert report.forward.gap == 0


def test_mixtral_moe_is_tensor_parallel_with_one_all_reduce_after_the_experts() -> None:
    report = _plan("mixtral")
    assert_moe_is_tensor_parallel(report.parameters, num_layers=2)
    for layer in range(2):
        after_experts = [s for s in report.forward.sites if s["origin"] == f"model.layers.{layer}.mlp.experts"]
        assert [(s["kind"], s["src"], s["dst"]) for s in after_experts] == [("all_reduce", "P", "R")]


#: bf16 logits against one bf16 process: bf16 keeps 8 significant bits (a spacing of 2^-9 at the
#: tiny model's logits, |x| < 0.6), and each row-parallel matmul's partial sums are rounded to bf16
#: on every rank before the all-reduce adds them, where one process rounds the full sum once: a few
#: units in the last place (measured: 0.0034 at most)
BF16_ATOL, BF16_RTOL = 1e-2, 1.6e-2


#: Mixtral-8x7B's widths with 2 layers (hidden 4096, 32 heads, 8 kv heads, 8 experts of 14336)
MIXTRAL_8X7B_WIDTHS = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                           vocab_size=32000, max_position_embeddings=4096, pad_token_id=None)


def _grouped_mms(report: Any) -> int:
    return sum(n.target is torch.ops.aten._grouped_mm.default for n in report.record.shadow.aten.graph.nodes)


def test_bf16_moe_plans_like_fp32() -> None:
    """Under Dynamo, transformers sends bf16 experts through ``torch._grouped_mm`` (fp32 through
    its ``grouped_mm_fallback`` op); the planner traces parallelize_model's stride-0 stand-ins,
    whose strides ``_grouped_mm``'s meta kernel used to reject. The bf16 plan is the fp32 plan,
    block by block."""
    fp32, bf16 = _plan("mixtral"), _plan("mixtral", dtype="bfloat16")
    assert _grouped_mms(bf16) == 4 and _grouped_mms(fp32) == 0  # gate_up and down of both blocks
    assert bf16.block_collectives() == fp32.block_collectives() \
        == {"model.layers": {layer: {"all_reduce": 2} for layer in range(2)}}
    assert_moe_is_tensor_parallel(bf16.parameters, num_layers=2)
    for layer in range(2):
        after_experts = [s for s in bf16.forward.sites if s["origin"] == f"model.layers.{layer}.mlp.experts"]
        assert [(s["kind"], s["src"], s["dst"]) for s in after_experts] == [("all_reduce", "P", "R")]


def test_bf16_moe_at_real_widths_plans_like_fp32() -> None:
    """Mixtral-8x7B's widths: whatever the plan is, the dtype does not change it, block by block."""
    from autotp.planner import plan_model

    config = tiny_config("mixtral", **MIXTRAL_8X7B_WIDTHS)
    fp32 = plan_model(config, 2, decode=False)
    bf16 = plan_model(config, 2, dtype="bfloat16", decode=False)
    assert _grouped_mms(bf16) == 4
    assert bf16.block_collectives() == fp32.block_collectives()
    assert {k: e["placement"] for k, e in bf16.parameters.items()} == \
        {k: e["placement"] for k, e in fp32.parameters.items()}


def _rank_logits(rank: int, world: int, folder: str) -> dict[str, Any]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    return {"logits": logits, "plan": model.autotp.plans[0],
            "dtypes": {p.dtype for p in model.parameters()}}


def test_bf16_mixtral_loads_and_matches_one_process(tmp_path: Path) -> None:
    folder = save_case(BY_ID["mixtral"], tmp_path / "mixtral_bf16", dtype=torch.bfloat16)
    reference = _model_class("mixtral").from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(PROMPT)).logits
    for r in run_ranks(_rank_logits, 2, str(folder)):
        assert r["dtypes"] == {torch.bfloat16}
        assert r["logits"].dtype == torch.bfloat16
        torch.testing.assert_close(r["logits"], expected, atol=BF16_ATOL, rtol=BF16_RTOL)
        assert_moe_is_tensor_parallel(r["plan"]["parameters"], num_layers=2)
