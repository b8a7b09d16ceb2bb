"""Eager attention on 2 ranks at batch sizes after the warm-up: equal to one process, heads local.

``parallelize_model`` warms up at batch 1; a batch-2 call then compiles a second graph in which
Dynamo makes the batch symbolic, and eager attention merges (batch, heads) into one dim (Gemma-2's
``matmul`` of 4-D q and k decomposes into ``view(B*H, S, D)`` and ``bmm``; BLOOM reshapes q, k, v
to ``(B*H, S, D)`` itself and adds its alibi ``(H, 1, S).repeat(B, 1, 1)``). Heads stay sharded as
a strided shard of that dim (``autotp/ops/shape.py``), so the batch-2 graph issues only the
warm-up's all-reduces, and a batch-3 call reuses it. Compared with one process of plain
transformers on the same tiny seeded checkpoint (``attn_implementation="eager"`` in its config),
and so are the tokens of a greedy ``generate`` of a left-padded batch of 2 (prefill and decode
graphs; BLOOM then builds its alibi from the mask: ``(B, H, S) -> (B*H, 1, S)``).

Tolerance: atol 1e-5, rtol 1e-4 (fp32): row-parallel matmuls and the vocab-parallel embedding sum
partial results across ranks, which reorders fp32 additions (as in test_architectures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import ARCHS, save_tiny

pytestmark = pytest.mark.dist

ATOL, RTOL = 1e-5, 1e-4
PAD_ID = 120
BATCHES = [
    torch.tensor([[5, 17, 99, 3, 64, 12, 7], [8, 1, 2, 3, 4, 77, 31]]),
    torch.tensor([[5, 17, 99, 3, 64, 12], [8, 1, 2, 3, 4, 77], [9, 9, 1, 100, 2, 3]]),
]
#: a left-padded batch of 2 for greedy generation (BLOOM then builds its alibi from the mask)
PADDED = torch.tensor([[PAD_ID, PAD_ID, 99, 3, 64, 12, 7], [8, 1, 2, 3, 4, 77, 31]])
PADDED_MASK = (PADDED != PAD_ID).long()
NEW_TOKENS = 5


def _generate(model: Any) -> list[list[int]]:
    return model.generate(PADDED, attention_mask=PADDED_MASK, max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=PAD_ID).tolist()


def _save_eager(arch: str, folder: Path) -> Path:
    path = save_tiny(arch, folder, pad_token_id=PAD_ID)
    config = json.loads((path / "config.json").read_text())
    config["attn_implementation"] = "eager"
    (path / "config.json").write_text(json.dumps(config))
    return path


def _rank(rank: int, world: int, folder: str) -> dict[str, Any]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False)
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for ids in BATCHES]
        tokens = _generate(model)
    return {"logits": logits, "tokens": tokens,
            "collectives": [plan["collectives"] for plan in model.autotp.plans]}


@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_batched_eager_attention_matches_one_process_with_only_the_warmup_all_reduces(
        tmp_path: Path, arch: str) -> None:
    import transformers

    folder = _save_eager(arch, tmp_path / arch)
    reference = getattr(transformers, ARCHS[arch][1]).from_pretrained(folder).eval()
    assert reference.config._attn_implementation == "eager"
    with torch.no_grad():
        expected = [reference(input_ids=ids).logits for ids in BATCHES]
        tokens = _generate(reference)
    for result in run_ranks(_rank, 2, str(folder)):
        for got, want in zip(result["logits"], expected, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        assert result["tokens"] == tokens
        warmup, *batched = result["collectives"]
        assert batched, "the batch-2 call compiled no graph of its own"
        # no all-gather or all-to-all of q, k, v in any batched graph (forwards, padded prefill and
        # decode steps): each reduces like the warm-up
        assert all(graph == warmup for graph in batched), result["collectives"]
        assert set(warmup) == {"all_reduce"}
