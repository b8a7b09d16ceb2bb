"""``autotp plan``: a model planned from its config alone, in one process, on the meta device.

Counts are exact: the planner runs the real backend over a simulated group whose collectives are
counted, so every number below is what ``tp`` real ranks would issue. Tiny configs keep this file
at a handful of plans (each compiles a 2-layer model once or twice).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from autotp.cli import main
from autotp.plan_report import FIRST_DECODE
from autotp.planner import PlanReport, explain, plan_model
from autotp.render import render_html, render_text
from tests._tiny import tiny_config, tiny_plan
from tests.distributed.test_architectures import PAD_ID

#: the tiny Llama at tp=2: one all-reduce after the vocab-parallel embedding, two per block
#: (after o_proj and after down_proj), one all-gather of the column-parallel logits
FORWARD = {"all_gather": 1, "all_reduce": 5}
#: a decode step: the same reductions, and only the new token's logits gathered; the KV cache stays
#: sharded on kv heads, so no key/value is gathered
DECODE = {"all_gather": 1, "all_reduce": 5}


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("config-only")
    tiny_config("llama").save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    return folder


@pytest.fixture(scope="module")
def report(config_only: Path) -> PlanReport:
    return plan_model(config_only, 2, batch=1, seq_len=7)


def test_a_folder_with_only_config_json_is_planned_without_weights(report: PlanReport) -> None:
    assert report.architecture == "LlamaForCausalLM" and report.tp == 2 and report.num_layers == 2
    assert report.collectives == FORWARD
    assert report.forward.input_shape == (1, 7)
    q = report.parameters["model.layers.0.self_attn.q_proj.weight"]
    assert q == {
        "style": "colwise",
        "placement": "S(0)",
        "shard_dim": 0,
        "global_shape": [64, 64],
        "global_numel": 4096,
        "local_shape": [32, 64],
        "bytes_per_rank": 32 * 64 * 4,
        "tied_to": None,
        "used": True,
    }
    assert report.parameters["model.layers.1.mlp.down_proj.weight"]["local_shape"] == [64, 64]
    assert report.parameters["model.embed_tokens.weight"]["style"] == "vocab"
    assert report.parameters["model.norm.weight"]["style"] == "replicate"


def test_bytes_per_rank_add_up_from_the_local_shapes(report: PlanReport) -> None:
    params = report.parameters.values()
    assert report.param_bytes_per_rank == sum(e["bytes_per_rank"] for e in params)
    assert report.param_bytes_total == sum(e["global_numel"] * 4 for e in params)
    replicated = sum(e["global_numel"] * 4 for e in params if e["placement"] == "R")
    assert report.param_bytes_per_rank == replicated + (report.param_bytes_total - replicated) // 2
    # forward payloads per rank: 5 all-reduces of (1, 7, 64) fp32, one all-gather of a (1, 7, 64) half
    assert report.forward.collective_bytes == {"all_reduce": 5 * 7 * 64 * 4, "all_gather": 7 * 64 * 4}


def test_every_block_has_the_megatron_two_all_reduces(report: PlanReport) -> None:
    assert report.block_collectives() == {"model.layers": {0: {"all_reduce": 2}, 1: {"all_reduce": 2}}}
    outside = sorted((s["kind"], s["after"]) for s in report.forward.outside_blocks())
    assert outside == [("all_gather", "lm_head"), ("all_reduce", "model.embed_tokens")]


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_other_dense_decoders_also_get_two_all_reduces_per_block(arch: str) -> None:
    r = tiny_plan(arch, pad_token_id=PAD_ID)  # the matrix's plan (tests/distributed/test_architectures.py)
    assert r.block_collectives() == {"model.layers": {0: {"all_reduce": 2}, 1: {"all_reduce": 2}}}
    assert r.collectives == FORWARD


def test_a_decode_step_gives_collectives_per_token_and_the_kv_cache_per_rank(report: PlanReport) -> None:
    assert report.decode is not None, report.decode_note
    assert report.decode.input_shape == (1, 1)
    assert report.decode.collectives == DECODE
    # 2 layers x (keys, values) x (B=1, 4 kv heads, 7 positions, head_dim 8) fp32, half the heads per rank
    assert report.kv_cache_bytes_total == 2 * 2 * 4 * 7 * 8 * 4
    assert report.kv_cache_bytes_per_rank == report.kv_cache_bytes_total // 2


@pytest.fixture(scope="module")
def t5_command(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, PlanReport, list[Any]]:
    """Tiny T5 (a config-only folder) planned at tp=2 once per module by ``autotp plan``, into an
    empty report cache: the folder, the cache, what the command printed, the report the planner
    made for it and the planner's traced runs (``planner._trace``). Two tests read it: the report's
    graphs, and the command's text served again from the cache (planning it twice, once from the
    config and once by the command, cost the same plan twice). Read it, never change it."""
    import contextlib
    import io

    from autotp import planner

    folder = tmp_path_factory.mktemp("t5") / "t5"
    tiny_config("t5", pad_token_id=PAD_ID).save_pretrained(folder)
    cache = tmp_path_factory.mktemp("t5-report-cache")
    runs, reports, trace, plan = [], [], planner._trace, planner.plan_model
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("AUTOTP_CACHE_DIR", str(cache))
        patch.setattr(planner, "_trace", lambda *a, **k: runs.append(trace(*a, **k)) or runs[-1])
        patch.setattr(planner, "plan_model", lambda *a, **k: reports.append(plan(*a, **k)) or reports[-1])
        assert main(["plan", str(folder), "--tp", "2"]) == 0
    (report,) = reports
    return folder, cache, printed.getvalue(), report, runs


def test_an_encoder_decoder_reports_each_stacks_blocks_in_its_forward_and_its_decode_steps(t5_command) -> None:
    """T5 at tp=2: the forward runs both stacks, the decode steps the decoder alone: the first
    (``generate``'s first decoder call: an empty cache, the cross-attention's keys and values
    projected from the encoder's output and stored) and every later one (reading them from the
    cache) are two graphs, each with Megatron's 3 all-reduces per decoder block and no gather inside
    a block; the text and the JSON give each graph's collectives per block of each stack, as
    :meth:`PlanReport.block_collectives` counts them. Block 0 of each stack also looks up its
    relative-position bias, split by heads with no collective of its own
    (tests/distributed/test_architectures.py)."""
    *_, report, runs = t5_command

    assert report.decode is not None and report.first_decode is not None, report.decode_note
    decoder = {0: {"all_reduce": 3}, 1: {"all_reduce": 3}}
    outside = [("all_reduce", "decoder.embed_tokens"), ("all_gather", "lm_head")]
    for graph in (FIRST_DECODE, "decode"):
        step = report.graph(graph)
        assert step.input_shape == (1, 1), graph
        assert report.block_collectives(graph) == {"decoder.block": decoder}, graph
        assert [(s["kind"], s["origin"]) for s in step.outside_blocks()] == outside, graph
    assert report.timings["first_decode_s"] > 0.0
    # two graphs: only the first step projects the cross-attention's keys and values (the later reads them)
    (run,) = runs
    cross_kv = {key: sorted({module for c in run.compiled[key] for *_, module in c.traced
                             if module.endswith(("EncDecAttention.k", "EncDecAttention.v"))})
                for key in (FIRST_DECODE, "decode")}
    assert cross_kv == {FIRST_DECODE: [f"decoder.block.{i}.layer.1.EncDecAttention.{p}" for i in (0, 1) for p in "kv"],
                        "decode": []}
    assert report.block_collectives() == {"encoder.block": {0: {"all_reduce": 2}, 1: {"all_reduce": 2}},
                                          "decoder.block": decoder}
    text = render_text(report).splitlines()
    for title in ("collectives of the first decode step", "collectives per generated token"):
        at = text.index(next(line for line in text if line.startswith(title)))
        assert text[at + 1:at + 3] == [
            "  per block of decoder.block: {'all_reduce': 3}",
            "  outside blocks: all_reduce after decoder.embed_tokens, all_gather after lm_head"], title
    data = json.loads(json.dumps(report.to_json()))  # what autotp plan --json prints
    for key, graph in (("collectives_per_block", "forward"), ("collectives_per_block_per_token", "decode")):
        assert data[key] == {stack: {str(i): kinds for i, kinds in blocks.items()}
                             for stack, blocks in report.block_collectives(graph).items()}
    assert data["first_decode_step"]["collectives_per_block"] == {"decoder.block": {"0": {"all_reduce": 3},
                                                                                    "1": {"all_reduce": 3}}}
    assert data["first_decode_step"]["collectives"] == report.first_decode.collectives
    assert [g["name"] for g in data["graphs"]] == ["forward", FIRST_DECODE, "decode"]
    kept = PlanReport.from_state(json.loads(json.dumps(report.to_state())))  # a report cache entry, read back
    assert kept.first_decode == report.first_decode


def test_a_decoder_only_model_has_no_first_decode_step_of_its_own(report: PlanReport) -> None:
    """A decoder-only model's first decode step is its prefill (the forward)."""
    assert report.first_decode is None and report.decode is not None
    assert report.to_json()["first_decode_step"] is None
    assert not any(line.startswith("collectives of the first decode step") for line in render_text(report).splitlines())


def test_autotp_plan_prints_an_encoder_decoders_first_decode_step_and_its_cache_keeps_it(
    t5_command, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's text names the first decode step; the report cache (autotp/report_cache.py)
    serves the same report again, first decode step included, in text and JSON."""
    folder, cache, planned, _, _ = t5_command  # planned into an empty cache
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(cache))

    assert "timings: read from the report cache" not in planned
    assert main(["plan", str(folder), "--tp", "2"]) == 0
    again = capsys.readouterr().out
    assert main(["plan", str(folder), "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)

    first = [line for line in planned.splitlines() if line.startswith("collectives of the first decode step")]
    assert len(first) == 1 and "cross-attention keys/values computed" in first[0]
    assert "timings: read from the report cache" in again
    assert [line for line in again.splitlines() if not line.startswith("timings")] == \
        [line for line in planned.splitlines() if not line.startswith("timings")]
    assert list(data["timings"]) == ["report_cache_read_s"]  # served from the cache too
    assert data["first_decode_step"]["collectives_per_block"] == {"decoder.block": {"0": {"all_reduce": 3},
                                                                                    "1": {"all_reduce": 3}}}


def test_a_long_prefill_is_planned_with_the_placements_the_warm_up_fixed() -> None:
    """parallelize_model fixes every placement in its (1, 2*tp+1) warm-up and solves a longer
    prefill with them pinned; the planner does the same, so a 16-token prefill reports Megatron's
    collectives. (A free solve at 16 tokens ended in 3 all-gathers + 3 all-reduces + 2
    reduce-scatters: the beam of the larger search lost the cheaper plan.)"""
    r = plan_model(tiny_config("llama"), 2, seq_len=16)
    assert r.forward.input_shape == (1, 16) and r.timings["warmup_s"] > 0.0
    assert r.collectives == FORWARD and r.decode.collectives == DECODE
    assert r.block_collectives() == {"model.layers": {0: {"all_reduce": 2}, 1: {"all_reduce": 2}}}


def test_timings_cover_trace_decompose_and_solve(report: PlanReport) -> None:
    for key in (
        "build_s",
        "trace_s",
        "decompose_s",
        "solve_s",
        "warmup_s",
        "forward_s",
        "decode_s",
        "total_s",
    ):
        assert report.timings[key] >= 0.0, key
    assert report.timings["solve_s"] > 0.0


def test_the_tp_plan_is_what_transformers_spells(report: PlanReport) -> None:
    assert report.tp_plan == {
        "lm_head": "colwise_gather_output",
        "model.embed_tokens": "embedding_rowwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
    }


def test_explain_shows_the_rule_chain_and_costs_the_rejected_alternatives(report: PlanReport) -> None:
    e = explain(report, "model.layers.0.mlp.down_proj.weight")
    assert (e.style, e.placement) == ("rowwise", "S(1)")
    assert any("aten.mm.default" in line and "-> P" in line for line in e.chain), e.chain
    assert any("all_reduce P -> R" in line for line in e.chain), e.chain
    by_placement = {a["placement"]: a for a in e.alternatives}
    assert sorted(by_placement) == ["R", "S(0)", "S(1)"]
    assert by_placement["S(1)"]["chosen"] and by_placement["S(1)"]["extra_cost"] == 0.0
    assert by_placement["S(0)"]["extra_cost"] > 0 and by_placement["R"]["extra_cost"] > 0
    assert "rejected" in e.text()


def test_explain_of_an_unknown_name_says_so(report: PlanReport) -> None:
    from autotp.errors import AutoTPError

    with pytest.raises(
        AutoTPError, match="no parameter 'down_proj.weight'.*model.layers.0.mlp.down_proj.weight"
    ):
        explain(report, "down_proj.weight")


def test_text_and_html_show_the_table_and_the_collectives(report: PlanReport, tmp_path: Path) -> None:
    text = render_text(report)
    assert "model.layers.0.self_attn.o_proj.weight" in text and "rowwise" in text
    assert "layers 1..1: same styles as layer 0" in text
    assert "per block of model.layers: {'all_reduce': 2}" in text
    assert "collectives per generated token" in text and "all_gather 1" in text
    page = render_html(report)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    # the embedding's all-reduce, then both (identical) layers drawn once with their 2 all-reduces
    assert page.count("all_reduce P&rarr;R") == 3 and page.count("all_gather S(2)&rarr;R") == 1
    assert "<h3>model.layers.{0..1} (2 identical blocks, layer 0 shown)</h3>" in page and "<h3>lm_head</h3>" in page


def test_cli_json_from_a_config_only_folder(
    config_only: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "plan.html"
    code = main(
        [
            "plan",
            str(config_only),
            "--tp",
            "2",
            "--json",
            "--no-decode",
            "--html",
            str(page),
            "--explain",
            "lm_head.weight",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["collectives"] == FORWARD
    assert data["parameters"]["lm_head.weight"]["style"] == "colwise"
    assert data["param_bytes_per_rank"] > 0 and data["timings"]["solve_s"] > 0
    assert data["collectives_per_token"] is None and "decode=False" in data["decode_note"]
    assert data["collectives_per_block"] == {"model.layers": {"0": {"all_reduce": 2}, "1": {"all_reduce": 2}}}
    assert data["collectives_per_block_per_token"] is None
    assert data["explanations"]["lm_head.weight"]["alternatives"]
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_cli_override_and_tp_plan(config_only: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["plan", str(config_only), "--tp", "2", "--tp-plan", "--no-decode", "--override", "lm_head=replicate"]
    )
    out = capsys.readouterr().out
    assert code == 0
    plan = json.loads(out)
    # DistributedConfig(tp_plan=...) keeps the model's own rules it does not name, so a module the
    # model's plan shards (Llama's lm_head) and autotp replicates is spelled out
    assert plan["lm_head"] == "replicate"
    assert "model.norm" not in plan  # other replicated modules are left out
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"


def test_cli_bad_input_exits_2_without_a_traceback(
    config_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(config_only), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "autotp: error: tp_size=3 does not divide" in err and "Traceback" not in err
    assert main(["plan", str(config_only), "--tp", "2", "--override", "lm_head"]) == 2
    assert "PATTERN=STYLE" in capsys.readouterr().err


def test_a_hub_id_needs_only_its_config_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from autotp.planner import load_config
    from tests._tiny import make_hf_cache, offline_hub

    source = tmp_path / "src"
    tiny_config("qwen2").save_pretrained(source)  # no weights in the "repo" at all
    make_hf_cache(tmp_path / "cache", "org/tiny-qwen2", source)
    offline_hub(monkeypatch)
    config = load_config("org/tiny-qwen2", cache_dir=tmp_path / "cache", local_files_only=True)
    assert config.model_type == "qwen2" and config.num_hidden_layers == 2


@pytest.mark.parametrize(("arch", "weight", "segments"), [
    ("phi3", "model.layers.0.self_attn.qkv_proj.weight", "(64 | 32 | 32)"),
    ("falcon", "transformer.h.0.self_attention.query_key_value.weight", "(64 | 8 | 8)"),
])
def test_cli_refuses_a_fused_layout_transformers_cannot_spell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, weight: str, segments: str
) -> None:
    """Phi-3's q | k | v (64 | 32 | 32 rows under GQA) is stored strided, Falcon's (64 | 8 | 8, one
    k and one v head) with its q split and its k and v held whole; transformers' packed styles
    know two equal split segments only, and plain colwise would split the fused dim contiguously."""
    tiny_config(arch, pad_token_id=120).save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--tp", "2", "--tp-plan", "--no-decode"]) == 2
    err = capsys.readouterr().err
    assert weight in err and segments in err
    assert "Traceback" not in err


def test_explain_names_are_checked_before_planning_and_read_like_overrides(
    config_only: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import autotp.planner

    real = autotp.planner.compile_graph
    monkeypatch.setattr(
        autotp.planner, "compile_graph", lambda *a, **k: pytest.fail("planned before checking")
    )
    assert main(["plan", str(config_only), "--tp", "2", "--explain", "lm_haed"]) == 2
    err = capsys.readouterr().err
    assert "autotp: error: explain name(s) ['lm_haed'] match no parameter or module" in err
    assert "Traceback" not in err
    monkeypatch.setattr(autotp.planner, "compile_graph", real)
    # a module name, as --override accepts it, explains that module's parameters
    assert main(["plan", str(config_only), "--tp", "2", "--json", "--no-decode", "--explain", "lm_head"]) == 0
    assert list(json.loads(capsys.readouterr().out)["explanations"]) == ["lm_head.weight"]


def test_an_unwritable_html_path_is_refused_before_planning(
    config_only: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", str(config_only), "--tp", "2", "--html", str(tmp_path / "no" / "such" / "plan.html")])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_the_report_carries_the_solvers_certificate(report: PlanReport) -> None:
    """The optimum lies between the lower bound and the plan's cost; the text says which."""
    forward = report.forward
    assert forward.cost is not None and 0 < forward.lower_bound <= forward.cost
    assert forward.gap == pytest.approx(forward.cost - forward.lower_bound)
    assert report.to_json()["solver"] == {
        "cost": forward.cost,
        "lower_bound": forward.lower_bound,
        "gap": forward.gap,
    }
    line = next(x for x in render_text(report).splitlines() if x.strip().startswith("solver: cost"))
    assert ("proved optimal" in line) == (forward.gap == 0)


def test_png_draws_the_plan_as_a_picture(config_only: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="autotp plan --png needs the [plot] extra")
    picture = tmp_path / "plan.png"
    assert main(["plan", str(config_only), "--tp", "2", "--no-decode", "--png", str(picture)]) == 0
    data = picture.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_the_drawings_share_one_list_of_blocks_with_every_collective(report: PlanReport) -> None:
    from autotp.render import CollectiveRow, ParamRow, plan_blocks

    blocks = plan_blocks(report)
    assert blocks[0].title == "model.embed_tokens" and blocks[-1].title == "lm_head"
    assert [b.layers for b in blocks if b.layers] == [(0, 1)]  # identical layers: one block
    drawn: Counter = Counter()
    for b in blocks:  # a block of identical layers stands for each of them
        for r in b.rows:
            if isinstance(r, CollectiveRow):
                drawn[r.site["kind"]] += max(len(b.layers), 1)
    assert drawn == FORWARD  # every collective of the forward, each once
    # each collective sits after the module whose output it moves: a layer's after o_proj and down_proj
    layer0 = next(b for b in blocks if b.layers == (0, 1))
    names = [r.name if isinstance(r, ParamRow) else r.module for r in layer0.rows]
    assert names.index("model.layers.0.self_attn.o_proj") == names.index("self_attn.o_proj.weight") + 1
    assert names.index("model.layers.0.mlp.down_proj") == names.index("mlp.down_proj.weight") + 1


def test_png_without_matplotlib_is_refused_before_planning(
    config_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert main(["plan", str(config_only), "--tp", "2", "--png", str(tmp_path / "plan.png")]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "autotp[plot]" in err and not (tmp_path / "plan.png").exists()


@pytest.mark.parametrize("arch", ["t5", "gpt2", "opt"])
def test_the_drawings_show_every_collective_once_and_each_stack_apart(request: pytest.FixtureRequest, arch: str
                                                                       ) -> None:
    from autotp.render import CollectiveRow, plan_blocks

    # T5's is the plan autotp plan made (t5_command; its forward is the prefill that fills the KV
    # cache): the module plans tiny T5 once
    report = request.getfixturevalue("t5_command")[3] if arch == "t5" else tiny_plan(arch)
    blocks = plan_blocks(report)
    drawn: Counter = Counter()
    for b in blocks:  # tied modules (T5's embed_tokens, GPT-2's lm_head) and sums outside blocks included
        for r in b.rows:
            if isinstance(r, CollectiveRow):
                drawn[r.site["kind"]] += max(len(b.layers), 1)
    assert drawn == Counter(report.forward.collectives)
    titles = [b.title for b in blocks]
    assert len(titles) == len(set(titles))  # a norm's weight and bias share one card
    if arch == "t5":  # block 0 of each stack holds the relative-position bias: drawn on its own
        assert [t for t in titles if ".block." in t] == [
            "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
        assert titles.index("encoder.final_layer_norm") < titles.index("decoder.block.0")
