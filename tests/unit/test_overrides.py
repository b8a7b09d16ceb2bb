"""Overrides: user-pinned placements the solver honours as constraints (``AutoTPConfig.overrides``,
``parallelize_model(..., overrides=...)``, ``autotp plan --override``).

The style of a placement is read off the parameter's consumer op, as the plan reads it; an
override that names nothing, or that no valid plan can honour, is refused with its name. The
end-to-end cases plan a tiny Llama at tp=2 on the meta device (exact collective counts).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.nn.functional as F

from autotp.backend import _apply_overrides, check_overrides, matching_overrides, override_placements
from autotp.errors import AutoTPError
from autotp.passes.solve import ParamChoice
from autotp.placement import R, Shard
from autotp.planner import plan_model
from tests._tiny import tiny_config, tiny_model

OPTIONS = [(R, 100.0), (Shard(0), 0.0), (Shard(1), 0.0)]


def _Linear() -> SimpleNamespace:
    """Stands in for a Dynamo node calling ``F.linear`` (its target is all ``style_of`` reads)."""
    return SimpleNamespace(target=F.linear)


def test_styles_map_to_placements_through_the_consumer_op() -> None:
    linear = _Linear()
    assert override_placements("replicate", OPTIONS, linear, 2) == [(R, 100.0)]
    assert override_placements("colwise", OPTIONS, linear, 2) == [(Shard(0), 0.0)]
    assert override_placements("rowwise", OPTIONS, linear, 2) == [(Shard(1), 0.0)]
    assert override_placements("shard(1)", OPTIONS, linear, 2) == [(Shard(1), 0.0)]
    assert override_placements("shard(-1)", OPTIONS, linear, 2) == [(Shard(1), 0.0)]
    assert override_placements("vocab", OPTIONS, linear, 2) == []  # a linear weight is never vocab-parallel


def test_transformers_spellings_are_accepted() -> None:
    linear = _Linear()
    assert override_placements("colwise_gather_output", OPTIONS, linear, 2) == [(Shard(0), 0.0)]
    assert override_placements("rowwise_rep", OPTIONS, linear, 2) == [(Shard(1), 0.0)]
    embedding = SimpleNamespace(target=F.embedding)  # a Dynamo node calling F.embedding
    assert override_placements("embedding_rowwise", OPTIONS, embedding, 2) == [(Shard(0), 0.0)]


def test_a_bias_follows_its_weights_style() -> None:
    bias_options = [(R, 10.0), (Shard(0), 0.0)]
    assert override_placements("colwise", bias_options, _Linear(), 1) == [(Shard(0), 0.0)]
    assert override_placements("rowwise", bias_options, _Linear(), 1) == [(R, 10.0)]


def test_patterns_match_parameter_or_module_names_and_every_tied_name() -> None:
    overrides = {"lm_head": "replicate", "model.layers.*.mlp.*": "colwise", "model.norm.weight": "replicate"}
    assert matching_overrides(("lm_head.weight",), overrides) == ["lm_head"]
    assert matching_overrides(("model.layers.3.mlp.down_proj.weight",), overrides) == ["model.layers.*.mlp.*"]
    assert matching_overrides(("model.norm.weight",), overrides) == ["model.norm.weight"]
    assert matching_overrides(("model.embed_tokens.weight", "lm_head.weight"), overrides) == ["lm_head"]
    assert matching_overrides(("model.layers.0.self_attn.q_proj.weight",), overrides) == []


def test_apply_narrows_free_parameters_and_refuses_what_it_cannot_honour() -> None:
    params = {"n1": (("lm_head.weight",), _Linear(), (8, 4)), "n2": (("model.norm.weight",), None, (4,))}
    free = {"n1": ParamChoice(list(OPTIONS)), "n2": ParamChoice([(R, 1.0), (Shard(0), 0.0)])}
    used = _apply_overrides(free, params, {"lm_head": "rowwise"})
    assert used == {"lm_head": ["lm_head.weight"]}
    assert free["n1"].options == [(Shard(1), 0.0)] and len(free["n2"].options) == 2
    with pytest.raises(AutoTPError, match=r"override 'lm_head': 'vocab' cannot be honoured for lm_head.weight"):
        _apply_overrides({"n1": ParamChoice(list(OPTIONS))}, params, {"lm_head": "vocab"})
    with pytest.raises(AutoTPError, match=r"override 'lm_head': unknown style 'colwize'"):
        _apply_overrides(dict(free), params, {"lm_head": "colwize"})
    # a graph (a decode step, a graph after a break) may hold a subset of the parameters: no complaint there
    assert _apply_overrides(dict(free), params, {"model.layers.*.nope": "colwise"}) == {}


def test_a_pattern_naming_nothing_in_the_model_is_refused_before_tracing_with_close_names() -> None:
    model = tiny_model("llama")
    with pytest.raises(AutoTPError, match=r"\['model.layers.\*.mlp.down_prj'\] match no parameter .*Close names"):
        check_overrides(model, {"model.layers.*.mlp.down_prj": "rowwise"})
    with pytest.raises(AutoTPError, match=r"override 'lm_head': unknown style 'colwize'"):
        check_overrides(model, {"lm_head": "colwize"})
    check_overrides(model, {"model.layers.*.mlp.down_proj": "rowwise", "lm_head": "replicate"})


def test_a_replicated_lm_head_is_honoured_and_costed() -> None:
    r = plan_model(tiny_config("llama"), 2, decode=False, overrides={"lm_head": "replicate"})
    assert r.parameters["lm_head.weight"]["style"] == "replicate"
    assert r.parameters["lm_head.weight"]["local_shape"] == [128, 64]
    assert r.collectives == {"all_reduce": 5}  # the logits come out replicated: no all-gather
    assert r.forward.extra_cost_of_overrides > 0  # it costs memory the free plan saves
    assert r.block_collectives() == {"model.layers": {0: {"all_reduce": 2}, 1: {"all_reduce": 2}}}


def test_feeding_back_the_exported_tp_plan_reproduces_the_plan_at_no_extra_cost() -> None:
    from tests._tiny import tiny_plan
    from tests.distributed.test_architectures import PAD_ID

    free = tiny_plan("qwen2", pad_token_id=PAD_ID)  # the matrix's plan
    pinned = plan_model(tiny_config("qwen2", pad_token_id=PAD_ID), 2, decode=False, overrides=free.tp_plan)
    assert {k: v["placement"] for k, v in pinned.parameters.items()} == \
        {k: v["placement"] for k, v in free.parameters.items()}
    assert pinned.forward.extra_cost_of_overrides == pytest.approx(0.0, abs=1e-6)
    assert pinned.record.overrides["model.layers.*.self_attn.q_proj"] == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.bias"]


def test_feeding_back_an_exported_packed_plan_reproduces_the_plan() -> None:
    """Phi-3 with q | k | v kept whole exports gate | up as transformers' packed_colwise and its
    own qkv_proj rule as replicate; both read back as overrides."""
    from tests._tiny import tiny_plan
    from tests.distributed.test_architectures import PAD_ID

    free = tiny_plan("phi3", overrides={"model.layers.*.self_attn.qkv_proj": "replicate"}, pad_token_id=PAD_ID)
    assert free.tp_plan["model.layers.*.mlp.gate_up_proj"] == "packed_colwise"
    pinned = plan_model(tiny_config("phi3", pad_token_id=PAD_ID), 2, decode=False, overrides=free.tp_plan)
    assert {k: v["placement"] for k, v in pinned.parameters.items()} == \
        {k: v["placement"] for k, v in free.parameters.items()}
    assert pinned.tp_plan == free.tp_plan


def test_an_override_with_no_valid_plan_is_refused_by_name() -> None:
    # a LayerNorm over a sharded dim is infeasible (docs/architecture.md): its weight split leaves no plan
    with pytest.raises(AutoTPError, match=r"overrides 'transformer.ln_f': 'shard\(0\)' leave no valid placement plan"):
        plan_model(tiny_config("gpt2"), 2, decode=False, overrides={"transformer.ln_f": "shard(0)"})


def test_an_override_splitting_a_vocabulary_by_columns_is_refused_by_name() -> None:
    # a token embedding is offered row splits only (autotp/ops/embedding.py: which tables are split by columns)
    with pytest.raises(AutoTPError, match=r"override 'model.embed_tokens': 'shard\(1\)' cannot be honoured .* "
                                          r"it may be replicate \(R\), vocab \(S\(0\)\), no other\. Use one of those"):
        plan_model(tiny_config("llama"), 2, decode=False, overrides={"model.embed_tokens": "shard(1)"})


def test_an_override_naming_no_parameter_is_refused_before_compiling() -> None:
    with pytest.raises(AutoTPError, match=r"\['model.layers.\*.mlp.gate'\] match no parameter or module"):
        plan_model(tiny_config("llama"), 2, overrides={"model.layers.*.mlp.gate": "colwise"})


def test_the_config_default_is_no_overrides() -> None:
    from autotp.config import AutoTPConfig

    assert dict(AutoTPConfig().overrides) == {}
