"""The plan cache across jobs at tp=2 (gloo, CPU): a second job of the same model finds every
graph's plan in the cache and runs exactly as the first.

Tolerance: logits are compared with a one-process transformers run at atol=1e-5, rtol=1e-4 (the
row-parallel reductions reorder fp32 additions); the second job's logits must equal the first's
bit for bit, since it runs the same program.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import one_process_reference, save_tiny
from tests.distributed.test_parallelize import PAD_ID, PROMPT

pytestmark = pytest.mark.dist


def _job(rank: int, world: int, folder: str, cache_dir: str, trace_dir: str, new_tokens: int) -> dict:
    import os

    os.environ["AUTOTP_CACHE_DIR"] = cache_dir
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, trace_dir=trace_dir)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    return {"logits": logits, "tokens": tokens[0].tolist(), "plans": model.autotp.plans,
            "cache": [o.as_dict() for o in model.autotp.context.plan_cache.outcomes]}


def test_a_second_job_hits_every_graph_and_matches_the_first_and_one_process(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", pad_token_id=PAD_ID)
    ref_logits, ref_tokens = one_process_reference(folder, PROMPT, 8, PAD_ID)
    cache = tmp_path / "cache"
    first = run_ranks(_job, 2, str(folder), str(cache), str(tmp_path / "trace1"), 8)
    second = run_ranks(_job, 2, str(folder), str(cache), str(tmp_path / "trace2"), 8)

    for rank in range(2):
        a, b = first[rank], second[rank]
        assert len(a["cache"]) >= 2  # the warm-up (prefill) graph and at least one decode graph
        assert all(o["status"] == "miss" and o["reason"] == "no entry" for o in a["cache"])
        assert all(o["stored"] for o in a["cache"])
        assert [o["status"] for o in b["cache"]] == ["hit"] * len(a["cache"])
        assert [o["entry"] for o in b["cache"]] == [o["entry"] for o in a["cache"]]
        assert b["plans"] == a["plans"]
        assert torch.equal(b["logits"], a["logits"])
        torch.testing.assert_close(b["logits"], ref_logits, atol=1e-5, rtol=1e-4)
        assert a["tokens"] == b["tokens"] == ref_tokens
        # the trace says hit or miss per graph
        notes = [json.loads(p.read_text())["status"]
                 for p in sorted((tmp_path / "trace2" / f"rank{rank}").glob("graph*/plan_cache.json"))]
        assert notes == ["hit"] * len(a["cache"])
    assert len(list((cache / "plans").glob("*.json"))) == len(first[0]["cache"])  # both ranks wrote the same
    assert not list((cache / "plans").glob(".*.tmp"))
