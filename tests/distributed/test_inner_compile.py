"""compile_inner="inductor" at tp=2 (gloo, CPU): the rewritten per-rank inference graphs run through
inductor with functional collectives; logits and greedy tokens match compile_inner="eager", the
same collectives are issued, and a training graph falls back to eager with a trace note.

Tolerance: atol=1e-5, rtol=1e-4 (inductor fuses the elementwise ops of a norm or an activation
into one C++ loop, which may round fp32 differently; the matmuls are the same library calls).
Greedy tokens are identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _run(rank: int, world: int, folder: str, trace: str) -> dict:
    from autotp import parallelize_model

    out: dict = {}
    for inner in ("eager", "inductor"):
        model = parallelize_model(folder, tp_size=world, compile_inner=inner, trace_dir=f"{trace}/{inner}")
        comm = model.autotp.context.comm
        ids = torch.tensor(PROMPT)
        with torch.no_grad():
            comm.reset_counts()
            logits = model(input_ids=ids).logits
            counts = dict(comm.counts)
            tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        graphs_inference = model.autotp.context.graphs_compiled
        train_logits = model(input_ids=ids, use_cache=False).logits  # grad enabled: a training graph
        out[inner] = {"logits": logits, "tokens": tokens[0].tolist(), "counts": counts,
                      "train_logits": train_logits.detach(), "graphs_inference": graphs_inference,
                      "graphs": model.autotp.context.graphs_compiled}
        torch._dynamo.reset()  # both models share one forward code object and its recompile limit
    return out


def test_inductor_matches_eager_and_training_graphs_fall_back(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", pad_token_id=0)
    results = run_ranks(_run, 2, str(folder), str(tmp_path / "trace"))
    for rank, r in enumerate(results):
        eager, ind = r["eager"], r["inductor"]
        torch.testing.assert_close(ind["logits"], eager["logits"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ind["train_logits"], eager["logits"], atol=1e-5, rtol=1e-4)
        assert ind["tokens"] == eager["tokens"]
        assert ind["counts"] == eager["counts"] and ind["counts"]["all_reduce"] > 0
        assert ind["graphs"] > ind["graphs_inference"] >= 2
        infos = [json.loads((tmp_path / "trace" / "inductor" / f"rank{rank}" / f"graph{g:03d}" / "inner.json").read_text())
                 for g in range(ind["graphs"])]
        assert all(i["compiler"] == "inductor" for i in infos[: ind["graphs_inference"]]), infos
        assert all(i["compiler"] == "eager" and "training graph" in i["fallback"]
                   for i in infos[ind["graphs_inference"]:]), infos
