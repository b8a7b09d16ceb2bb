"""Overrides on real ranks: ``parallelize_model(..., overrides={...})`` at tp=2 pins the named
parameters to the style asked for, and the model still computes what one process computes.

Tolerance: logits at ``atol=1e-5, rtol=1e-4`` against one transformers process (row-parallel sums
reorder fp32 additions).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _rank(rank: int, world: int, folder: str) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False,
                              overrides={"lm_head": "replicate", "model.layers.*.mlp.down_proj": "replicate"})
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    styles = {fqn: e["style"] for fqn, e in model.autotp.plan["parameters"].items()}
    return {"logits": logits, "styles": styles,
            "lm_head_local": tuple(model.lm_head.weight.shape)}


def test_overrides_pin_styles_on_two_ranks_and_keep_one_process_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama")
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=torch.tensor(PROMPT)).logits
    for r in run_ranks(_rank, 2, str(folder), timeout=900):
        assert r["styles"]["lm_head.weight"] == "replicate"  # by default it is vocabulary-sharded (colwise)
        assert r["lm_head_local"] == (128, 64)  # the whole head on each rank
        assert r["styles"]["model.layers.0.mlp.down_proj.weight"] == "replicate"
        assert r["styles"]["model.layers.1.mlp.down_proj.weight"] == "replicate"
        assert r["styles"]["model.layers.0.mlp.up_proj.weight"] != "replicate"  # others still sharded
        torch.testing.assert_close(r["logits"], expected, atol=1e-5, rtol=1e-4)


def _rank_refused(rank: int, world: int, folder: str) -> str:
    from autotp import AutoTPError, parallelize_model

    try:
        parallelize_model(folder, tp_size=world, progress=False, overrides={"lm_head": "vocab"})
    except AutoTPError as e:
        return str(e)
    return "loaded"


def test_an_override_no_plan_can_honour_is_refused_on_every_rank(tmp_path: Path) -> None:
    # rank 0 plans the group's graphs (autotp/backend.py: _plans_once): its refusal reaches the
    # other rank as the same error, instead of leaving it waiting for a plan
    folder = save_tiny("llama", tmp_path / "llama")
    messages = run_ranks(_rank_refused, 2, str(folder), timeout=900)
    assert messages[0] == messages[1]
    assert "override 'lm_head': 'vocab' cannot be honoured for lm_head.weight" in messages[0]
