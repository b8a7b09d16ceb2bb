"""Mixture-of-experts layers through each experts implementation transformers runs.

transformers' MoE experts have several forwards (``integrations/moe.py``). ``grouped_mm`` is the
default; ``generate`` switches to ``batched_mm`` for its decode steps on any device but the CPU
(``_optimize_model_for_decode``), which reads each token's experts as ``gate_up_proj[expert_ids]``.
On a GPU that graph once had no plan (the index op refused the fused gate | up shard; seen on an
H200). Here the switch is made by hand on the CPU, after the warm-up planned and pinned the
experts through ``grouped_mm``.

Tolerance: logits at atol 1e-5 / rtol 1e-4 against one plain transformers process (the row-parallel
partial sums reorder fp32 additions); greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import one_process_reference, save_tiny

pytestmark = pytest.mark.dist

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
PAD_ID = 120


def _rank_batched_mm(rank: int, world: int, folder: str) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    model.set_experts_implementation("batched_mm")
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID)
    return {"logits": logits, "tokens": tokens[0].tolist(),
            "collectives": [plan["collectives"] for plan in model.autotp.plans]}


def test_batched_mm_experts_keep_their_shards_and_match_one_process(tmp_path: Path) -> None:
    folder = save_tiny("mixtral", tmp_path / "mixtral")
    logits, tokens = one_process_reference(folder, PROMPT, 6, PAD_ID)
    ranks = run_ranks(_rank_batched_mm, 2, str(folder))
    for got in ranks:
        torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-4)
        assert got["tokens"] == tokens
        # every graph (the grouped_mm warm-up, the batched_mm forward and decode) reduces once per
        # attention and once per MoE block plus the vocab-parallel embedding, and gathers nothing
        assert len(got["collectives"]) >= 2
        assert all(c == {"all_reduce": 5} for c in got["collectives"]), got["collectives"]
