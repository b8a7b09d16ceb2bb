"""Sibling-matmul fusion on a tiny Llama / Qwen2 at tp=2 (gloo, CPU): per block, q/k/v become one
matmul and gate/up another, in the prefill and decode graphs; logits and greedy tokens match the
unfused model; parameter bytes (distinct storages) are unchanged; every group is read into place.

Tolerance: fused vs unfused logits at atol=1e-5, rtol=1e-4 (one GEMM instead of three may block
the fp32 reduction differently; the row-parallel all-reduces are the same). Tokens are identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _storage_bytes(params: list[torch.Tensor]) -> int:
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}.values())


def _run(rank: int, world: int, folder: str, trace: str) -> dict:
    from autotp import parallelize_model

    out: dict = {}
    for fuse in (True, False):
        model = parallelize_model(folder, tp_size=world, fuse=fuse, trace_dir=f"{trace}/{fuse}")
        ids = torch.tensor(PROMPT)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        params = list(model.parameters())
        out[fuse] = {"logits": logits, "tokens": tokens[0].tolist(),
                     "param_bytes": sum(p.numel() * p.element_size() for p in params),
                     "storage_bytes": _storage_bytes(params),
                     "storages": len({p.untyped_storage().data_ptr() for p in params}),
                     "graphs": model.autotp.context.graphs_compiled}
        torch._dynamo.reset()  # both models share LlamaForCausalLM.forward's code object and its cache limit
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_qkv_and_gate_up_fuse_per_block_with_unchanged_results_and_memory(tmp_path: Path, arch: str) -> None:
    folder = save_tiny(arch, tmp_path / arch, pad_token_id=0)
    layers = 2
    results = run_ranks(_run, 2, str(folder), str(tmp_path / "trace"))
    for rank, r in enumerate(results):
        fused, plain = r[True], r[False]
        torch.testing.assert_close(fused["logits"], plain["logits"], atol=1e-5, rtol=1e-4)
        assert fused["tokens"] == plain["tokens"]
        assert fused["param_bytes"] == plain["param_bytes"] == fused["storage_bytes"] == plain["storage_bytes"]
        biases = 2 * layers if arch == "qwen2" else 0  # Qwen2's q|k|v biases share one storage too
        assert fused["storages"] == plain["storages"] - 3 * layers - biases  # q|k|v and gate|up: one each
        assert fused["graphs"] >= 2  # prefill and decode graphs
        for g in range(fused["graphs"]):
            folder_g = tmp_path / "trace" / "True" / f"rank{rank}" / f"graph{g:03d}"
            report = json.loads((folder_g / "fusion.json").read_text())
            groups = sorted(tuple(w.rsplit("_", 3)[-3] for w in grp["weights"]) for grp in report["groups"])
            assert groups == sorted([("q", "k", "v"), ("gate", "up")] * layers), groups
            # materialize read each group's shards into one buffer, so the pass takes views and a
            # rank never holds a group twice (no concatenation), in the first graph too
            assert {grp["storage"] for grp in report["groups"]} == {"view"}, report["groups"]
            code = (folder_g / "rewritten_graph.py").read_text()
            unfused = (tmp_path / "trace" / "False" / f"rank{rank}" / f"graph{g:03d}" / "rewritten_graph.py").read_text()
            # per block: 7 linears -> 4 (qkv, o, gate|up, down); plus the lm_head
            assert code.count("torch._C._nn.linear(") == 4 * layers + 1
            assert unfused.count("torch._C._nn.linear(") == 7 * layers + 1
