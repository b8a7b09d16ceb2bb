"""bf16 at tp=2: ``parallelize_model(dtype="bf16")`` against one transformers process loading the
same fp32 checkpoint in bf16.

Tolerance: bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.0039); the row-parallel matmuls
and the vocab-parallel embedding add partial results across ranks in a different order than one
process, and each such bf16 rounding can move a logit by a step of its magnitude. Logits are
compared at ``atol=2e-2, rtol=2e-2`` (a few bf16 steps at these logit sizes), the same bound
``autotp/verify.py`` uses for bf16; the greedy argmax of the prompt's positions must agree
wherever one process's top-2 gap exceeds that tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PROMPT = [[5, 17, 99, 3, 64, 12, 7, 44, 90, 2]]


def _rank(rank: int, world: int, folder: str) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, dtype="bf16", progress=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT)).logits
    return {"logits": logits, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def test_bf16_logits_at_tp2_equal_one_bf16_process_within_bf16_rounding(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama")  # stored fp32, converted per slice on load
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(PROMPT)).logits
    top2 = expected.float().topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 4e-2  # positions whose argmax bf16 rounding cannot flip
    for r in run_ranks(_rank, 2, str(folder), timeout=900):
        assert r["param_dtypes"] == ["torch.bfloat16"]
        assert r["logits"].dtype == torch.bfloat16
        torch.testing.assert_close(r["logits"].float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(r["logits"].argmax(-1)[clear], expected.argmax(-1)[clear])
