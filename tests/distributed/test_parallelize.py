"""parallelize_model on tiny Llama-family checkpoints at tp=1, 2 and 4 (gloo, CPU).

Tolerance: logits are compared with a one-process transformers run at atol=1e-5, rtol=1e-4:
row-parallel matmuls and the vocab-parallel embedding sum partial results across ranks, which
reorders fp32 additions (~1e-6 relative on these sizes). Greedy tokens must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PAD_ID = 120  # upper part of the 128-token vocabulary: lives on the last rank's shard
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _reference(folder: Path, new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    return logits, tokens[0].tolist()


def _rank_run(rank: int, world: int, folder: str, new_tokens: int, trace_dir: str | None) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, trace_dir=trace_dir)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = model(input_ids=ids)
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    params = list(model.parameters())
    return {
        "type": type(out).__name__,
        "logits": out.logits,
        "tokens": tokens[0].tolist(),
        "param_elements": sum(p.numel() for p in params),
        "any_meta": any(p.is_meta for p in params),
        "any_standin": any(p.numel() > 1 and all(s == 0 for s in p.stride()) for p in params),
        "has_config": model.config is not None,
        "plan": model.autotp.plan,
        "bytes_read": _bytes_read(model),
    }


def _bytes_read(model: torch.nn.Module) -> int:
    from autotp.context import meta_of

    for stand in (s for _, _, s in model.forward.slots):
        ckpt = meta_of(stand).checkpoint
        if ckpt is not None:
            return ckpt.bytes_read
    return -1


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_logits_and_greedy_tokens_equal_one_process(tmp_path: Path, arch: str, world: int) -> None:
    folder = save_tiny(arch, tmp_path / arch, pad_token_id=PAD_ID)
    ref_logits, ref_tokens = _reference(folder, 16)
    results = run_ranks(_rank_run, world, str(folder), 16, None)
    for r in results:
        assert r["type"] == "CausalLMOutputWithPast"
        assert r["logits"].shape == ref_logits.shape
        torch.testing.assert_close(r["logits"], ref_logits, atol=1e-5, rtol=1e-4)
        assert r["tokens"] == ref_tokens
        assert not r["any_meta"] and not r["any_standin"] and r["has_config"]


def test_llama_plan_is_megatron_with_two_all_reduces_per_block(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path / "plans"))  # empty: the trace shows the solve
    folder = save_tiny("llama", tmp_path / "llama", pad_token_id=PAD_ID, num_hidden_layers=3)
    trace = tmp_path / "trace"
    results = run_ranks(_rank_run, 2, str(folder), 2, str(trace))
    plan = results[0]["plan"]
    styles = {fqn: e["style"] for fqn, e in plan["parameters"].items()}
    for i in range(3):
        block = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert styles[block + name + ".weight"] == "colwise", name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert styles[block + name + ".weight"] == "rowwise", name
        assert styles[block + "input_layernorm.weight"] == "replicate"
    assert styles["model.embed_tokens.weight"] == "vocab"
    assert styles["lm_head.weight"] == "colwise"
    # 2 all-reduces per decoder block + 1 for the vocab-parallel embedding; the logits leave the
    # graph sharded and are gathered once at the model boundary, and each block's key and value
    # cache (the warm-up keeps the model's use_cache default) stays sharded on its heads
    assert plan["collectives"] == {"all_reduce": 2 * 3 + 1}
    assert plan["sharded_outputs"] == 1 + 2 * 3
    on_disk = json.loads((trace / "rank0" / "graph000" / "plan.json").read_text())
    assert on_disk == plan
    for name in ("dynamo_graph.py", "aten_graph.py", "decisions.jsonl", "backtracks.json", "rewritten_graph.py"):
        assert (trace / "rank1" / "graph000" / name).exists(), name


def test_each_rank_holds_and_reads_only_its_shards(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", pad_token_id=PAD_ID)
    one = run_ranks(_rank_run, 1, str(folder), 1, None)[0]
    two = run_ranks(_rank_run, 2, str(folder), 1, None)
    plan = two[0]["plan"]
    sharded = sum(torch.Size(e["global_shape"]).numel() for e in plan["parameters"].values() if e["shard_dim"] is not None)
    replicated = sum(torch.Size(e["global_shape"]).numel() for e in plan["parameters"].values() if e["shard_dim"] is None)
    for r in two:
        assert r["param_elements"] == sharded // 2 + replicated
        assert r["bytes_read"] == (sharded // 2 + replicated) * 4  # fp32: exactly this rank's slices
    assert one["bytes_read"] == one["param_elements"] * 4


def _rank_tied(rank: int, world: int, folder: str) -> dict:
    import sys
    import threading

    from autotp import parallelize_model

    threads, hook = torch.get_num_threads(), sys.excepthook
    model = parallelize_model(folder, tp_size=world)
    installed = {"heartbeat": any(t.name.startswith("autotp-heartbeat") for t in threading.enumerate()),
                 "hook": sys.excepthook is not hook}
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.autotp.close()  # the session undoes what it installed in the process; the model still runs
    with torch.no_grad():
        after_close = model(input_ids=ids).logits
    return {
        "logits": logits,
        "after_close": after_close,
        "installed": installed,
        "undone": {"heartbeat": not any(t.name.startswith("autotp-heartbeat") for t in threading.enumerate()),
                   "hook": sys.excepthook is hook, "threads": torch.get_num_threads() == threads},
        "shared": model.lm_head.weight is model.model.embed_tokens.weight,
        "local_rows": model.lm_head.weight.shape[0],
        "style": model.autotp.plan["parameters"]["model.embed_tokens.weight"]["style"],
    }


def test_tied_embeddings_share_one_shard_object_and_give_correct_logits_and_close_undoes_the_session(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "tied", pad_token_id=PAD_ID, tie_word_embeddings=True)
    ref_logits, _ = _reference(folder, 1)
    for r in run_ranks(_rank_tied, 2, str(folder)):
        assert r["shared"] and r["local_rows"] == 64 and r["style"] == "vocab"
        torch.testing.assert_close(r["logits"], ref_logits, atol=1e-5, rtol=1e-4)
        assert r["installed"] == {"heartbeat": True, "hook": True}
        assert r["undone"] == {"heartbeat": True, "hook": True, "threads": True}
        torch.testing.assert_close(r["after_close"], ref_logits, atol=1e-5, rtol=1e-4)


def _rank_hub(rank: int, world: int, repo: str, cache: str) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(repo, tp_size=world, cache_dir=cache, local_files_only=True)
    with torch.no_grad():
        return {"logits": model(input_ids=torch.tensor(PROMPT)).logits}


def test_a_hub_id_resolves_offline_from_a_laid_out_cache_with_a_sharded_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests._tiny import make_hf_cache

    folder = save_tiny("qwen2", tmp_path / "src", pad_token_id=PAD_ID, shards=3)
    assert (folder / "model.safetensors.index.json").exists()
    make_hf_cache(tmp_path / "cache", "tiny-org/tiny-qwen2", folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # inherited by the spawned ranks
    ref_logits, _ = _reference(folder, 1)
    for r in run_ranks(_rank_hub, 2, "tiny-org/tiny-qwen2", str(tmp_path / "cache")):
        torch.testing.assert_close(r["logits"], ref_logits, atol=1e-5, rtol=1e-4)


def _rank_masked(rank: int, world: int, folder: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)


def test_batched_generation_with_left_padding_and_a_mask_matches_one_process(tmp_path: Path) -> None:
    # sizes read from batch-sharded activations (x.size() in a dynamic graph) must be rescaled
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama", pad_token_id=PAD_ID)
    ids = torch.tensor([[0, 0, 5, 17, 99, 3], [4, 8, 15, 16, 23, 42]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for tokens in run_ranks(_rank_masked, 2, str(folder), ids, mask):
        assert torch.equal(tokens, expected)
