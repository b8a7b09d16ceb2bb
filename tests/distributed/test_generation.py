"""Generation at tp=2 (gloo, CPU): a sharded KV cache, a constant number of compiled graphs, greedy
and sampled tokens equal to one process.

Tolerance: tokens are compared exactly (greedy argmax and seeded multinomial sampling over logits
that agree to ~1e-6 relative). Cache bytes are exact: each rank's cache holds its kv heads only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PAD_ID = 120
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _cache_bytes(cache: object) -> tuple[int, int]:
    """(bytes this rank stores for the cache, bytes of the logical cache), from the tensors themselves."""
    from autotp.context import shard_of

    stored = logical = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            shard = shard_of(t)
            held = shard[0] if shard is not None else t
            stored += held.untyped_storage().nbytes() + (t.untyped_storage().nbytes() if shard is not None else 0)
            logical += t.numel() * t.element_size()
    return stored, logical


def _rank_decode(rank: int, world: int, folder: str, new_tokens: int) -> dict:
    from transformers import DynamicCache

    from autotp import parallelize_model
    from autotp.kv_cache import cache_keyword, returned_cache

    model = parallelize_model(folder, tp_size=world)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, use_cache=True, **{cache_keyword(type(model).forward): cache})
        stored, logical = _cache_bytes(returned_cache(out))
        graphs_before = model.autotp.context.graphs_compiled
        greedy = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
        graphs_for_generate = model.autotp.context.graphs_compiled - graphs_before
        regional = all(type(layer).__name__.startswith("Regional") for layer in model.model.layers)
        torch.manual_seed(1234)
        sampled = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9,
                                 pad_token_id=PAD_ID)
    return {"stored": stored, "logical": logical, "greedy": greedy[0].tolist(), "sampled": sampled[0].tolist(),
            "graphs_for_generate": graphs_for_generate, "logits": out.logits, "regional": regional}


def _reference(folder: Path, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        greedy = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
        torch.manual_seed(1234)
        sampled = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9,
                                 pad_token_id=PAD_ID)
    return {"greedy": greedy[0].tolist(), "sampled": sampled[0].tolist(), "logits": logits}


def test_each_rank_caches_only_its_kv_heads_and_64_tokens_compile_a_constant_number_of_graphs(
        tmp_path: Path) -> None:
    # 4 layers: deep enough for layer regions (autotp/regions.py: MIN_LAYERS), so the prefill and
    # decode graphs trace one layer body each and stamp out the others
    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=4, max_position_embeddings=128)
    ref = _reference(folder, 64)
    results = run_ranks(_rank_decode, 2, str(folder), 64)
    for r in results:
        assert r["regional"]
        # 4 layers x (k, v) x (1, 4 kv heads, 7 tokens, 8 dims) x fp32, half of the heads per rank,
        # plus a 4-byte stand-in per tensor
        assert r["logical"] == 4 * 2 * 1 * 4 * 7 * 8 * 4
        assert r["stored"] == r["logical"] // 2 + 4 * 2 * 4
        torch.testing.assert_close(r["logits"], ref["logits"], atol=1e-5, rtol=1e-4)
        assert r["greedy"] == ref["greedy"]
        assert r["sampled"] == ref["sampled"]
        # at most the prefill and one decode graph, dynamic in the cache length from the first step
        # (the prefill's symbolic length stays symbolic in the cache it hands on): not one per token
        assert r["graphs_for_generate"] <= 2


def _rank_regional(rank: int, world: int, folders: dict[str, str], new_tokens: int) -> dict:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from autotp import parallelize_model
    from autotp.depth import layer_stack

    results = {}
    for arch, folder in folders.items():
        model = parallelize_model(folder, tp_size=world)
        ids = torch.tensor(PROMPT)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID,
                                 output_logits=True, return_dict_in_generate=True)
        stack = model.get_submodule(layer_stack(model, 4))
        results[arch] = {
            "logits": logits, "greedy": out.sequences[0].tolist(), "step_logits": list(out.logits),
            "regional": all(type(layer).__name__.startswith("Regional") for layer in stack),
            "sliding": sum(isinstance(layer, DynamicSlidingWindowLayer) for layer in out.past_key_values.layers)}
        model.autotp.close()
    return results


#: arch -> (config overrides, sliding-window layers of its 4), one of each way a layer meets its
#: region at tp=2 (tests/unit/test_layer_regions.py checks more architectures in one process): Gemma-2
#: alternates sliding-window layers (a window of 4 positions, which the 7-token prompt overfills,
#: sliced outside the region) and global ones; GPT-2's blocks take the cache by position; BLOOM's
#: take it as ``layer_past`` and return (hidden states, attention weights)
REGIONAL = {"gemma2": ({"sliding_window": 4}, 2), "gpt2": ({}, 0), "bloom": ({}, 0)}


def test_decoders_generate_through_layer_regions_like_one_process(tmp_path: Path) -> None:
    # 4 layers: deep enough for layer regions (autotp/regions.py); every model in one launch
    from transformers import AutoModelForCausalLM

    folders, references = {}, {}
    for arch, (overrides, _) in REGIONAL.items():
        folder = save_tiny(arch, tmp_path / arch, seed=0, num_hidden_layers=4, **overrides)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            references[arch] = (model(input_ids=torch.tensor(PROMPT)).logits,
                                model.generate(torch.tensor(PROMPT), max_new_tokens=10, do_sample=False,
                                               pad_token_id=PAD_ID, output_logits=True, return_dict_in_generate=True))
        folders[arch] = str(folder)
    for results in run_ranks(_rank_regional, 2, folders, 10):
        for arch, r in results.items():
            logits, ref = references[arch]
            assert r["regional"] and r["sliding"] == REGIONAL[arch][1], arch
            torch.testing.assert_close(r["logits"], logits, atol=1e-5, rtol=1e-4, msg=arch)
            assert r["greedy"] == ref.sequences[0].tolist(), arch
            for step, (a, b) in enumerate(zip(r["step_logits"], ref.logits, strict=True)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"{arch}: decode step {step}")


def _rank_first_generate(rank: int, world: int, folder: str, new_tokens: int) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    graphs_loaded = model.autotp.context.graphs_compiled
    with torch.no_grad():
        greedy = model.generate(torch.tensor(PROMPT), max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    return {"graphs_loaded": graphs_loaded, "graphs_for_generate": model.autotp.context.graphs_compiled - graphs_loaded,
            "greedy": greedy[0].tolist()}


@pytest.mark.parametrize(("world", "kv_heads"), [
    (2, 4),  # each rank caches its kv heads (sharded stand-ins)
    (2, 1),  # one kv head: every rank caches it whole
    (1, 4),  # one rank: the cache is plain tensors
])
def test_a_greedy_generate_right_after_loading_reuses_the_warm_up_as_its_prefill_and_compiles_one_decode_graph(
        tmp_path: Path, world: int, kv_heads: int) -> None:
    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=2, max_position_embeddings=128,
                       num_key_value_heads=kv_heads)
    ref = _reference(folder, 8)
    for r in run_ranks(_rank_first_generate, world, str(folder), 8):
        assert r["greedy"] == ref["greedy"]
        assert r["graphs_loaded"] == 1  # the warm-up: generate's prefill at a dynamic length
        assert r["graphs_for_generate"] == 1  # the decode graph only


def _rank_plain_calls(rank: int, world: int, folder: str) -> dict:
    from autotp import parallelize_model
    from autotp.kv_cache import returned_cache

    model = parallelize_model(folder, tp_size=world)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        keyword = model(input_ids=ids)
        graphs_after_keyword = model.autotp.context.graphs_compiled
        positional = model(torch.tensor([PROMPT[0][:5]]))  # another length: the warm-up's token dim is dynamic
        graphs_after_positional = model.autotp.context.graphs_compiled
        no_cache = model(input_ids=ids, use_cache=False)  # another computation: a graph of its own
        graphs_after_no_cache = model.autotp.context.graphs_compiled
        greedy = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
    return {"greedy": greedy[0].tolist(), "graphs_after_generate": model.autotp.context.graphs_compiled,
            "keyword": keyword.logits, "positional": positional.logits, "no_cache": no_cache.logits,
            "cache_length": returned_cache(keyword).get_seq_length(),
            "no_cache_returned": returned_cache(no_cache) is not None,
            "graphs": [graphs_after_keyword, graphs_after_positional, graphs_after_no_cache]}


def test_a_plain_call_right_after_loading_reuses_the_warm_up_graph(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "ckpt", seed=0, num_hidden_layers=2, max_position_embeddings=128)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        full, short = reference(input_ids=ids).logits, reference(torch.tensor([PROMPT[0][:5]])).logits
        greedy = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)[0].tolist()
    for r in run_ranks(_rank_plain_calls, 2, str(folder)):
        # the plain calls are completed into the warm-up's prefill keywords (a fresh empty cache,
        # use_cache and return_dict at the config's defaults): no graph beyond the warm-up's
        assert r["graphs"][:2] == [1, 1]
        assert r["graphs"][2] == 2  # use_cache=False is not the prefill: its own graph, as before
        torch.testing.assert_close(r["keyword"], full, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r["positional"], short, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r["no_cache"], full, atol=1e-5, rtol=1e-4)
        assert r["cache_length"] == len(PROMPT[0])  # the cache the plain call would have made, filled
        assert not r["no_cache_returned"]
        assert r["greedy"] == greedy
        assert r["graphs_after_generate"] == 3  # its prefill is the warm-up's graph; its decode graph
