"""Attention heads no tp divides are split in whole heads, unevenly, and match one process.

Tiny seeded checkpoints (``tests/_tiny.py``, hidden 48, 2 layers) loaded with ``parallelize_model``
on gloo ranks and compared with one plain transformers process:

* Qwen2 (q/k/v biases) with 6 query heads over 2 kv heads at tp=4: the ranks form 2 groups of 2,
  each group holds its kv head (``S(0/2)``) and shares the kv head's 3 query heads as 2 + 1
  (``S(0:6h/2)``), so attention stays on each rank;
* Llama with 3 heads (multi-head attention) at tp=2: q, k and v split 2 + 1 alike (``S(0:3h)``).

Logits of one forward and the tokens of a greedy ``generate`` must equal one process; the plan must
be Megatron's (2 all-reduces per block and the embedding's one, no all-gather in the graph: the
logits leave it sharded), each rank's weights and KV cache hold only its own heads, and the plan
says where ranks carry unequal work. One training step through each split (loss, gradients, global
norm, logits after SGD) equals one process's.

Each model is launched once per module (:func:`launched`): one rank run checks, in order, the
inference claims (a forward, greedy tokens, the plan, the local heads), a left-padded batch's
greedy tokens, then one training step, and every test asserts its own claims on that run. A rank
that raises names the claim it was checking (``_rank``), so a failure says which claim broke.

Tolerance: atol 1e-5, rtol 1e-4 (fp32), as in tests/distributed/test_parallelize.py (row-parallel
partial sums reorder fp32 additions).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import RankError, run_ranks
from tests._tiny import one_process_reference, save_tiny
from tests.distributed.test_kv_head_groups import TRAIN_IDS, _train_step, assert_trains_like

pytestmark = pytest.mark.dist

PAD_ID = 120
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
NEW_TOKENS = 6
ATOL, RTOL = 1e-5, 1e-4
LAYERS = 2


#: a left-padded batch of 2 and its mask
BATCH_IDS = torch.tensor([[0, 0, 5, 17, 99, 3], [4, 8, 15, 16, 23, 42]])
BATCH_MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])

#: GPT-2's dropouts (0.1 by default) off
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

#: arch -> (config sizes, the fused q|k|v module of block 0, its weight's fused dim, its placement
#: with 3 heads at tp=2, with 6 heads at tp=4)
_FUSED = {
    # GPT-2's c_attn (a Conv1D: (in, 3 * hidden)), split(hidden) into q | k | v of 3 heads of 16 each
    # (dropout 0, so that a training step can equal one process's: see the dropout test below)
    "gpt2": (dict(n_embd=48, **NO_DROPOUT), "transformer.h.0.attn.c_attn", 1, "n_head",
             {2: "S(1|48:3h+48:3h+48:3h)", 4: "S(1|48:6h+48:6h+48:6h)"}),
    # Phi-3's qkv_proj with 8 query heads over 2 kv heads of 8 at tp=4: q split evenly, each kv head
    # held by its group of 2 ranks (the cases below give it 8 heads)
    "phi3": (dict(hidden_size=64, num_key_value_heads=2), "model.layers.0.self_attn.qkv_proj", 0,
             "num_attention_heads", {4: "S(0|64+16/2+16/2)"}),
    # Falcon's multi-query query_key_value: q heads | its one k head | its one v head, k and v whole
    "falcon": (dict(hidden_size=48), "transformer.h.0.self_attention.query_key_value", 0, "num_attention_heads",
               {2: "S(0|48:3h+16r+16r)", 4: "S(0|48:6h+8r+8r)"}),
}

#: fused q|k|v cases: id -> (arch, heads, world, query heads per rank)
FUSED_CASES: dict[str, tuple[str, int, int, list[int]]] = {
    "gpt2-3-heads-tp2": ("gpt2", 3, 2, [2, 1]), "falcon-3-heads-one-kv-tp2": ("falcon", 3, 2, [2, 1]),
    "gpt2-6-heads-tp4": ("gpt2", 6, 4, [2, 2, 1, 1]), "falcon-6-heads-one-kv-tp4": ("falcon", 6, 4, [2, 2, 1, 1]),
    "phi3-8-heads-over-2-kv-tp4": ("phi3", 8, 4, [2, 2, 2, 2]),
}

#: model -> (arch, its config fields, world size, the fused q|k|v module of block 0 or None, the claims
#: its one rank run checks, in this order: "infer" (forward, greedy tokens, plan, local heads),
#: "batch" (a left-padded batch's greedy tokens), "train" (one training step; last, as it changes
#: the weights))
MODELS: dict[str, tuple[str, dict[str, Any], int, str | None, tuple[str, ...]]] = {
    "qwen2-6-heads-2-kv-tp4": ("qwen2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2), 4,
                               None, ("infer", "batch", "train")),
    "llama-mha-3-heads-tp2": ("llama", dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), 2,
                              None, ("infer", "train")),
    **{name: (arch, {**_FUSED[arch][0], _FUSED[arch][3]: heads}, world, _FUSED[arch][1],
              ("infer", "batch", "train") if name == "gpt2-3-heads-tp2" else ("infer", "train"))
       for name, (arch, heads, world, _) in FUSED_CASES.items()},
}


def _infer(model: Any, qkv: str | None) -> dict[str, Any]:
    """One forward (logits, the KV cache's heads on this rank) and greedy tokens of PROMPT."""
    from autotp.context import shard_of

    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    result = {"logits": out.logits, "tokens": tokens[0].tolist(), "plan": model.autotp.plan}
    if qkv is not None:  # this rank's rows of the fused projection
        return {**result, "qkv_shape": tuple(model.get_submodule(qkv).weight.shape)}
    local_kv_heads = []
    for layer in out.past_key_values.layers:
        for entry in (layer.keys, layer.values):
            shard = shard_of(entry)
            local_kv_heads.append(shard[0].shape[1] if shard is not None else entry.shape[1])
    return {**result, "local_kv_heads": local_kv_heads, "q_rows": model.model.layers[0].self_attn.q_proj.weight.shape[0]}


def _batch(model: Any, qkv: str | None) -> torch.Tensor:
    """Greedy tokens of the left-padded batch."""
    with torch.no_grad():
        return model.generate(BATCH_IDS, attention_mask=BATCH_MASK, max_new_tokens=5, do_sample=False, pad_token_id=0)


def _train(model: Any, qkv: str | None) -> dict[str, Any]:
    """One training step through the layout the warm-up placed (and the attention weights' placements)."""
    placements = {n: str(e["placement"]) for n, e in model.autotp.plans[0]["parameters"].items() if "self_attn" in n}
    return {**_train_step(model, model.autotp.context.comm), "placements": placements}


_CLAIMS: dict[str, Callable[[Any, str | None], Any]] = {"infer": _infer, "batch": _batch, "train": _train}


def _rank(rank: int, world: int, folder: str, claims: tuple[str, ...], qkv: str | None) -> dict[str, Any]:
    """Parallelize the checkpoint, then check ``claims`` on it in order; an exception carries the
    name of the claim it broke."""
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    out: dict[str, Any] = {}
    for claim in claims:
        try:
            out[claim] = _CLAIMS[claim](model, qkv)
        except BaseException as e:
            e.add_note(f"(while checking the claim {claim!r}: every test reading this rank run fails with this)")
            raise
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, list[dict[str, Any]]]]:
    """``launched(model)`` -> (its checkpoint, the ranks' results of its claims): each model of
    :data:`MODELS` is saved and run on its ranks once per module, whichever test asks first; the
    others read the same run. (Parallelizing it again for each claim traced and compiled the same
    warm-up and decode graphs again on every rank.)"""
    runs: dict[str, tuple[Path, list[dict[str, Any]]] | RankError] = {}

    def run(name: str) -> tuple[Path, list[dict[str, Any]]]:
        if name not in runs:
            arch, sizes, world, qkv, claims = MODELS[name]
            folder = save_tiny(arch, tmp_path_factory.mktemp(name) / arch, pad_token_id=PAD_ID, **sizes)
            try:
                runs[name] = folder, run_ranks(_rank, world, str(folder), claims, qkv)
            except RankError as e:  # every test of this run fails with it, without launching it again
                runs[name] = e
        if isinstance(runs[name], RankError):
            raise runs[name]
        return runs[name]

    return run


@pytest.mark.parametrize(
    ("arch", "heads", "kv_heads", "world", "q_placement", "kv_placement", "q_heads", "kv_local"),
    [
        # 2 groups of 2 ranks, 3 query heads per kv head: 2 + 1; each rank holds its group's kv head
        ("qwen2", 6, 2, 4, "S(0:6h/2)", "S(0/2)", [2, 1, 2, 1], [1, 1, 1, 1]),
        # multi-head attention, 3 heads over 2 ranks: 2 + 1 of q, k and v
        ("llama", 3, 3, 2, "S(0:3h)", "S(0:3h)", [2, 1], [2, 1]),
    ],
    ids=["qwen2-6-heads-2-kv-tp4", "llama-mha-3-heads-tp2"],
)
def test_heads_no_tp_divides_match_one_process_with_megatrons_plan(
    launched, arch: str, heads: int, kv_heads: int, world: int, q_placement: str, kv_placement: str,
    q_heads: list[int], kv_local: list[int]
) -> None:
    folder, results = launched(f"{arch}-6-heads-2-kv-tp4" if arch == "qwen2" else f"{arch}-mha-3-heads-tp2")
    head_dim = 48 // heads
    ref_logits, ref_tokens = one_process_reference(folder, PROMPT, NEW_TOKENS, PAD_ID)
    for rank, r in enumerate(r["infer"] for r in results):
        torch.testing.assert_close(r["logits"], ref_logits, atol=ATOL, rtol=RTOL)
        assert r["tokens"] == ref_tokens
        assert r["q_rows"] == q_heads[rank] * head_dim  # this rank's query heads only
        assert r["local_kv_heads"] == [kv_local[rank]] * (2 * LAYERS)  # the cache holds its kv heads only
        params = r["plan"]["parameters"]
        for i in range(LAYERS):
            attn = f"model.layers.{i}.self_attn."
            assert params[attn + "q_proj.weight"]["placement"] == q_placement
            assert params[attn + "q_proj.weight"]["style"] == "colwise"
            assert params[attn + "o_proj.weight"]["placement"] == q_placement.replace("S(0", "S(1")
            assert params[attn + "o_proj.weight"]["style"] == "rowwise"
            assert params[attn + "o_proj.weight"]["rows_per_rank"] == [n * head_dim for n in q_heads]
            for name in ("k_proj.weight", "v_proj.weight"):
                assert params[attn + name]["placement"] == kv_placement
        assert r["plan"]["uneven"]["model.layers.0.self_attn.q_proj.weight"].endswith(
            f"over tp={world}: heads {'/'.join(map(str, q_heads))}")
        # 2 all-reduces per block + the vocab-parallel embedding's; no all-gather in the graph
        assert r["plan"]["collectives"] == {"all_reduce": 2 * LAYERS + 1}


def _rank_redistribute(rank: int, world: int) -> dict[str, bool]:
    from autotp.collectives import Comm, redistribute
    from autotp.placement import HeadShard, R

    comm = Comm.from_default_group()
    full = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # (B, heads, D)
    split = HeadShard(1, 6, 2)  # 2 groups of 3 heads, each shared by 2 ranks as 2 + 1
    start, stop = [(0, 2), (2, 3), (3, 5), (5, 6)][rank]
    mine = full[:, start:stop]
    grad = full * 10 + 1  # a whole gradient every rank holds alike
    x = full.clone().requires_grad_()
    redistribute(x, R, split, comm).backward(grad[:, start:stop])  # each rank's heads' gradient, gathered
    piece = mine.clone().requires_grad_()
    redistribute(piece, split, R, comm).backward(grad)  # a replicated gradient: this rank's heads of it
    partial = mine.clone().requires_grad_()
    redistribute(partial, split, R, comm, grad_partial=True).backward(grad * (rank + 1))  # summed first
    return {
        "narrowed from R": torch.equal(redistribute(full, R, split, comm), mine),
        "gathered": torch.equal(redistribute(mine.contiguous(), split, R, comm), full),
        "narrow's gradient gathered": torch.equal(x.grad, grad),
        "gather's gradient narrowed": torch.equal(piece.grad, grad[:, start:stop]),
        "partial gradient summed, then narrowed": torch.equal(partial.grad, grad[:, start:stop] * (1 + 2 + 3 + 4)),
    }


def test_head_shards_narrow_locally_and_gather_in_rank_order_and_back() -> None:
    for checks in run_ranks(_rank_redistribute, 4):
        assert checks == {name: True for name in checks}


@pytest.mark.parametrize(("model", "q_placement"),
                         [("llama-mha-3-heads-tp2", "S(0:3h)"), ("qwen2-6-heads-2-kv-tp4", "S(0:6h/2)")],
                         ids=["3-heads-tp2", "6-over-2-kv-heads-tp4"])
def test_training_through_heads_no_tp_divides_equals_one_process(launched, model: str, q_placement: str) -> None:
    """The ranks' gradients of their own heads, the input gradients summed over unequal head blocks
    and the global norm over uneven shards: loss, every gradient (gathered), the norm and the logits
    after an SGD step equal one process (gradients and logits atol 1e-5 / rtol 1e-4, the loss and
    the norm 1e-5 relative)."""
    from transformers import AutoModelForCausalLM

    folder, results = launched(model)
    ref = _train_step(AutoModelForCausalLM.from_pretrained(folder))
    for r in (r["train"] for r in results):
        assert {p for n, p in r["placements"].items() if "q_proj.weight" in n} == {q_placement}, r["placements"]
        assert_trains_like(r, ref)


@pytest.mark.parametrize("model", list(FUSED_CASES))
def test_a_fused_qkv_projection_with_heads_no_tp_divides_is_split_in_whole_heads(launched, model: str) -> None:
    """A fused q|k|v output is stored with each segment split in whole heads (``StridedShard.heads``):
    rank r holds the same heads of q, k and v (of q only, beside the whole k and v head, for
    Falcon's multi-query layout), so attention stays on each rank and the block communicates as
    Megatron's (no all-gather in the graph, the logits leave it sharded). Phi-3's with fewer kv heads
    than ranks holds each kv head on its group of ranks. Each rank reads only its heads' rows; logits
    and greedy tokens equal one process. A training step through the layout then gives one process's
    loss, gradients, norm and logits after SGD (tolerances as in the training tests above): GPT-2's
    batch-2 training graph keeps the uneven head split through attention (with dropout too: the
    test below); Phi-3's kv heads held per group of ranks get their rows' gradient summed over the
    group (``layers.ChunkGroupGradient``) and counted once by ``clip_grad_norm_``."""
    from transformers import AutoModelForCausalLM

    arch, heads, world, q_heads = FUSED_CASES[model]
    sizes, qkv, dim, _, placement = _FUSED[arch]
    folder, results = launched(model)
    head_dim = sizes.get("hidden_size", 48) // heads
    ref_logits, ref_tokens = one_process_reference(folder, PROMPT, NEW_TOKENS, PAD_ID)
    ref_train = _train_step(AutoModelForCausalLM.from_pretrained(folder))
    for rank, r in enumerate({**r["infer"], "train": r["train"]} for r in results):
        torch.testing.assert_close(r["logits"], ref_logits, atol=ATOL, rtol=RTOL)
        assert r["tokens"] == ref_tokens
        params = r["plan"]["parameters"]
        assert params[qkv + ".weight"]["placement"] == placement[world]
        # this rank's heads of each segment (of q, beside the whole k and v head of multi-query)
        rows = q_heads[rank] * head_dim * (3 if arch == "gpt2" else 1) + (2 * head_dim if arch != "gpt2" else 0)
        assert r["qkv_shape"][dim] == rows
        assert "all_gather" not in r["plan"]["collectives"], r["plan"]["collectives"]
        assert_trains_like(r["train"], ref_train)


def _rank_dropout(rank: int, world: int, folder: str, trace: str) -> dict[str, Any]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, trace_dir=trace)
    before = len(model.autotp.plans)
    model.train()
    loss = model(input_ids=TRAIN_IDS, labels=TRAIN_IDS).loss
    plans = model.autotp.plans[before:]  # the training call's graphs: the model's, then the loss's
    loss.backward()
    summaries = sorted(Path(trace, f"rank{rank}").glob("graph*/summary.json"))[before:]
    rewrites = [json.loads(s.read_text()).get("local_rewrites", {}) for s in summaries]
    from torch._dynamo.utils import counters

    return {"loss": float(loss.detach()), "collectives": [p["collectives"] for p in plans],
            "traced": counters["stats"]["unique_graphs"], "notes": model.autotp.context.stored_graphs.notes,
            "rank_rng": sum(r.get("rank_rng", 0) for r in rewrites),
            "finite": all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)}


def test_training_gpt2_with_attention_dropout_keeps_megatrons_plan(tmp_path: Path) -> None:
    """With GPT-2's attention dropout (0.1) SDPA's math kernel draws the dropout mask as
    ``empty_like(attn).bernoulli_(1 - p)``: the mask keeps the probabilities' head split (3 heads
    over 2 ranks as 2 + 1), each rank drawing its heads' mask from its own stream (``rank_rng``), so
    the training graph communicates as Megatron's (2 all-reduces per block and the embedding's, no
    all-gather; before, 3 heads found no plan). The replicated regions' dropout draws alike on every
    rank: the ranks' losses are equal. (Values differ from one process's with dropout on; at
    dropout 0 the test above compares the step exactly, and ``tests/distributed/test_dropout.py``
    the loss's distribution, and GPT-2's heads split evenly, 4 + 4, the same way.) The ranks share
    the frames the last one traces, up to the loss function's, which a package cannot name."""
    folder = save_tiny("gpt2", tmp_path / "gpt2", pad_token_id=PAD_ID, n_embd=48, n_head=3, n_layer=LAYERS)
    results = run_ranks(_rank_dropout, 2, str(folder), str(tmp_path / "trace"))
    for r in results:
        # the model's graph; the loss function's own graph then gathers the vocab-sharded logits
        assert r["collectives"][0] == {"all_reduce": 2 * LAYERS + 1}, r["collectives"]
        assert r["rank_rng"] == LAYERS  # one attention per block, on the rank's own stream
        assert r["finite"]
    assert results[1]["loss"] == results[0]["loss"]
    # the ranks share frames (tests/_dist.py): rank 0 installs every frame the last rank traced, the
    # loss function's too, which no later process could install by name (so it is not stored)
    assert results[0]["traced"] == 0 and results[1]["traced"] >= 3
    assert not any("no longer shared" in note for r in results for note in r["notes"]), results[1]["notes"]
    assert any("not stored" in note and "loss_function" in note for note in results[1]["notes"])


def _assert_a_left_padded_batch_generates_as_one_process(folder: Path, results: list[dict[str, Any]]) -> None:
    """The left-padded batch of 2 generated on the ranks exactly the greedy tokens of one process."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = ref.generate(BATCH_IDS, attention_mask=BATCH_MASK, max_new_tokens=5, do_sample=False,
                                pad_token_id=0)
    for r in results:
        assert torch.equal(r["batch"], expected)


def test_a_left_padded_batch_spreads_each_kv_head_over_its_uneven_query_heads(launched) -> None:
    """With a padding mask transformers repeats each kv head over its query heads itself
    (``repeat_kv``): 3 copies per kv head over the group's 2 ranks are 2 + 1, merged into the
    query heads' split. (Qwen2 with 6 heads over 2 kv heads at tp=4.)"""
    _assert_a_left_padded_batch_generates_as_one_process(*launched("qwen2-6-heads-2-kv-tp4"))


def test_a_batch_through_fused_qkv_heads_no_tp_divides_generates_as_one_process(launched) -> None:
    """GPT-2's eager attention merges (batch, heads) into one dim: with 3 heads split 2 + 1 over 2
    ranks that dim holds each batch's heads of this rank (``S(0|3:3h+3:3h)``), also at the symbolic
    batch after the warm-up (and after the batch-1 generate of the same run). A left-padded batch of
    2 generates the tokens one process does."""
    _assert_a_left_padded_batch_generates_as_one_process(*launched("gpt2-3-heads-tp2"))
