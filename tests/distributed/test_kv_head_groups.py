"""More ranks than key/value heads: each rank holds the kv head its query heads use.

Tiny Llama checkpoints (``tests/_tiny.py``: hidden 64, 8 heads, 2 layers) with fewer kv heads than
ranks, loaded with ``parallelize_model`` on gloo ranks and compared with one plain transformers
process: 2 kv heads at tp=4 (each kv head held by 2 ranks: ``GroupedShard`` ``S(0/2)``) and one kv
head at tp=2 (multi-query: k/v replicated). Logits of one forward and the tokens of a greedy
``generate`` must equal one process; the plan must be Megatron's (q and o sharded, 2 all-reduces
per block, no all-gather inside a block), and each rank's KV cache holds only its own kv head.
Training through them (the warm-up placed k/v grouped or replicated; the grouped gradient is summed
over each group; Falcon's fused projection holds its k/v head whole) gives one process's loss,
gradients, global norm and, after an SGD step, logits.

Tolerance: atol 1e-5, rtol 1e-4 (fp32), as in tests/distributed/test_parallelize.py (row-parallel
partial sums reorder fp32 additions).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import one_process_reference, save_tiny

pytestmark = pytest.mark.dist

PAD_ID = 120
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
NEW_TOKENS = 8
ATOL, RTOL = 1e-5, 1e-4
LAYERS = 2


#: the grouped case (2 kv heads at tp=4), whose launch also generates a left-padded batch
GROUPED = (2, 4)
#: a left-padded batch of 2 and its mask
BATCH_IDS = torch.tensor([[0, 0, 5, 17, 99, 3], [4, 8, 15, 16, 23, 42]])
BATCH_MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


def _rank(rank: int, world: int, folder: str, batched: bool) -> dict[str, Any]:
    """Logits, greedy tokens, the plan and the cache's kv heads; with ``batched`` also the tokens of
    a left-padded batch; then one training step (:func:`_trained`; last: it changes the weights).
    One load serves the matrix, the batch and the training test."""
    from autotp import parallelize_model
    from autotp.context import shard_of

    model = parallelize_model(folder, tp_size=world)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    cache = out.past_key_values
    local_kv_heads = []
    for layer in cache.layers:
        for entry in (layer.keys, layer.values):
            shard = shard_of(entry)
            local_kv_heads.append(shard[0].shape[1] if shard is not None else entry.shape[1])
    result = {
        "logits": out.logits,
        "tokens": tokens[0].tolist(),
        "plan": model.autotp.plan,
        "plans": model.autotp.plans,
        "cache": [o.as_dict()["status"] for o in model.autotp.context.plan_cache.outcomes],
        "local_kv_heads": local_kv_heads,
    }
    if batched:
        with torch.no_grad():
            result["batched"] = model.generate(BATCH_IDS, attention_mask=BATCH_MASK, max_new_tokens=6,
                                               do_sample=False, pad_token_id=0)
    return {**result, "train": _trained(model)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], tuple[Path, list[dict[str, Any]]]]:
    """``launched(kv_heads, world)`` -> (the checkpoint, the ranks' :func:`_rank` results), each
    launched once per module: its results serve the matrix and the training test, the grouped case's
    the left-padded batch too. (Loading it again for the training step traced and compiled the same
    warm-up graph again on every rank.) The grouped case plans from an empty plan cache of its own,
    ``<checkpoint>/../cache``: it is the first job of the plan-cache test, which reads it back."""
    runs: dict[tuple[int, int], tuple[Path, list[dict[str, Any]]]] = {}

    def run(kv_heads: int, world: int) -> tuple[Path, list[dict[str, Any]]]:
        if (kv_heads, world) not in runs:
            root = tmp_path_factory.mktemp(f"kv{kv_heads}-tp{world}")
            folder = save_tiny("llama", root / "llama", pad_token_id=PAD_ID, num_key_value_heads=kv_heads)
            with pytest.MonkeyPatch.context() as env:
                if (kv_heads, world) == GROUPED:
                    env.setenv("AUTOTP_CACHE_DIR", str(root / "cache"))
                runs[kv_heads, world] = folder, run_ranks(_rank, world, str(folder), (kv_heads, world) == GROUPED)
        return runs[kv_heads, world]

    return run


@pytest.mark.parametrize(
    ("kv_heads", "world", "kv_placement", "kv_rows"),
    [
        (2, 4, "S(0/2)", 8),  # one kv head of 8 rows per rank, each held by 2 ranks
        (1, 2, "R", 8),  # multi-query: the one kv head on every rank
    ],
)
def test_fewer_kv_heads_than_ranks_match_one_process_with_megatrons_plan(
    launched, kv_heads: int, world: int, kv_placement: str, kv_rows: int
) -> None:
    folder, results = launched(kv_heads, world)
    ref_logits, ref_tokens = one_process_reference(folder, PROMPT, NEW_TOKENS, PAD_ID)
    for r in results:
        torch.testing.assert_close(r["logits"], ref_logits, atol=ATOL, rtol=RTOL)
        assert r["tokens"] == ref_tokens
        assert r["local_kv_heads"] == [1] * (2 * LAYERS)  # the cache holds this rank's kv head only
        params = r["plan"]["parameters"]
        for i in range(LAYERS):
            attn = f"model.layers.{i}.self_attn."
            assert params[attn + "q_proj.weight"]["style"] == "colwise"
            assert params[attn + "o_proj.weight"]["style"] == "rowwise"
            for name in ("k_proj.weight", "v_proj.weight"):
                assert params[attn + name]["placement"] == kv_placement
                assert params[attn + name]["local_shape"] == [kv_rows, 64]
        # 2 all-reduces per block + the vocab-parallel embedding's; no all-gather in the graph
        # (the logits leave it sharded and are gathered at the model boundary)
        assert r["plan"]["collectives"] == {"all_reduce": 2 * LAYERS + 1}


def _rank_redistribute(rank: int, world: int) -> dict[str, bool]:
    from autotp.collectives import Comm, redistribute
    from autotp.placement import GroupedShard, R, Shard

    comm = Comm.from_default_group()
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)  # (B, heads, D)
    grouped = GroupedShard(1, 2)  # 2 chunks of 4 heads, each on 2 ranks
    mine = full[:, (rank // 2) * 4 : (rank // 2 + 1) * 4]
    spread_full = full[:, :2].unsqueeze(2).expand(2, 2, 4, 3)  # (B, KV=2, 4 copies, D)
    spread_mine = spread_full[:, rank // 2 : rank // 2 + 1, (rank % 2) * 2 : (rank % 2 + 1) * 2]
    return {
        "narrowed from R": torch.equal(redistribute(full, R, grouped, comm), mine),
        "narrowed to a plain shard": torch.equal(
            redistribute(mine, grouped, Shard(1), comm), full[:, rank * 2 : (rank + 1) * 2]
        ),
        "gathered": torch.equal(redistribute(mine, grouped, R, comm), full),
        "spread gathered": torch.equal(
            redistribute(spread_mine.contiguous(), GroupedShard(1, 2, 2), R, comm), spread_full
        ),
    }


def test_grouped_shards_narrow_locally_and_gather_one_chunk_per_group() -> None:
    for checks in run_ranks(_rank_redistribute, 4):
        assert checks == {name: True for name in checks}


def test_grouped_kv_heads_generate_a_left_padded_batch_like_one_process(launched) -> None:
    """With a padding mask transformers repeats each kv head over its query heads itself
    (``repeat_kv``: an expand and a reshape the rewrite localizes), not inside attention."""
    from transformers import AutoModelForCausalLM

    folder, results = launched(*GROUPED)
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = ref.generate(BATCH_IDS, attention_mask=BATCH_MASK, max_new_tokens=6, do_sample=False,
                                pad_token_id=0)
    for r in results:
        assert torch.equal(r["batched"], expected)


TRAIN_IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40]])


def _full_grads(model: torch.nn.Module, comm: Any) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as one process holds it: gathered from its layout (a grouped
    shard's one chunk per group)."""
    from autotp.collectives import full_tensor
    from autotp.context import meta_of

    return {name: full_tensor(p.grad.detach(), meta_of(p).placement, comm).clone()
            for name, p in model.named_parameters()}


def _train_step(model: torch.nn.Module, comm: Any = None) -> dict[str, Any]:
    """One training step (loss, backward, SGD), then a second forward's logits: of the batch's two
    rows as one sequence of 16 tokens, which reads every weight the step moved (each embedding row
    of the batch's tokens, every matrix) at batch 1, the shape the warm-up compiled. (At the batch's
    own shape, batch 2 in eval mode, that forward compiled one more graph on every rank, ~2 CPU-s
    each, and checked the same weights.)"""
    model.train()
    loss = model(input_ids=TRAIN_IDS, labels=TRAIN_IDS).loss
    loss.backward()
    grads = _full_grads(model, comm) if comm is not None else \
        {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if comm is not None:  # the global norm: a grouped gradient counted once per group
        from autotp.training import clip_grad_norm_

        norm = float(clip_grad_norm_(model, max_norm=float("inf")))
    else:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")))
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.eval()
    with torch.no_grad():
        after = model(input_ids=TRAIN_IDS.reshape(1, -1)).logits  # (1, 16)
    return {"loss": float(loss.detach()), "grads": grads, "norm": norm, "logits_after": after.detach().clone()}


def assert_trains_like(step: dict[str, Any], ref: dict[str, Any]) -> None:
    """A rank's :func:`_train_step` equals one process's: the loss and the global norm to 1e-5
    relative, every gradient (gathered) and the logits after the step at atol 1e-5 / rtol 1e-4."""
    assert step["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert set(step["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(step["grads"][name], grad, atol=ATOL, rtol=RTOL, msg=name)
    assert step["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    torch.testing.assert_close(step["logits_after"], ref["logits_after"], atol=ATOL, rtol=RTOL)


def _trained(model: torch.nn.Module) -> dict[str, Any]:
    """:func:`_train_step` on this rank's model, with the k/v weights' placements the warm-up chose."""
    placements = {n: str(model.autotp.plans[0]["parameters"][n]["placement"])
                  for n in model.autotp.plans[0]["parameters"] if any(k in n for k in KV_WEIGHTS)}
    return {**_train_step(model, model.autotp.context.comm), "kv_placements": placements}


def _rank_train(rank: int, world: int, folder: str) -> dict[str, Any]:
    from autotp import parallelize_model

    return _trained(parallelize_model(folder, tp_size=world))  # the warm-up places k/v grouped (or replicated)


#: the weights holding k and v heads: separate projections, or Falcon's fused one
KV_WEIGHTS = ("k_proj", "v_proj", "query_key_value")


@pytest.mark.parametrize(("arch", "kv_heads", "world", "kv_placement"),
                         [("llama", 2, 4, "S(0/2)"), ("llama", 1, 2, "R"), ("falcon", 1, 2, "S(0|64+8r+8r)")],
                         ids=["8-over-2-kv-heads-tp4", "8-over-1-kv-head-tp2", "falcon-fused-whole-kv-head-tp2"])
def test_training_through_grouped_kv_heads_equals_one_process(launched, tmp_path: Path, arch: str, kv_heads: int,
                                                               world: int, kv_placement: str) -> None:
    """Each rank of a group uses its own query heads' share of the kv head, so the k/v projection's
    gradient is partial over the group and summed within it. Falcon's fused query_key_value holds
    its one k and v head whole on every rank beside the split q heads: their gradient counts once
    in the input's gradient (rank 0's) and is summed into the whole rows. The loss, every gradient
    (gathered), the global gradient norm, and the logits after an SGD step equal one process
    (gradients and logits atol 1e-5 / rtol 1e-4, the loss and the norm 1e-5 relative)."""
    from transformers import AutoModelForCausalLM

    if arch == "llama":  # the matrix's launch trained after its checks
        folder, results = launched(kv_heads, world)
        results = [r["train"] for r in results]
    else:  # Falcon: multi-query
        folder = save_tiny(arch, tmp_path / arch, pad_token_id=PAD_ID)
        results = run_ranks(_rank_train, world, str(folder))
    ref = _train_step(AutoModelForCausalLM.from_pretrained(folder))
    for r in results:
        assert r["kv_placements"] and set(r["kv_placements"].values()) == {kv_placement}, r["kv_placements"]
        assert_trains_like(r, ref)


def _rank_cached(rank: int, world: int, folder: str) -> dict[str, Any]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    return {
        "tokens": tokens[0].tolist(),
        "plans": model.autotp.plans,
        "cache": [o.as_dict()["status"] for o in model.autotp.context.plan_cache.outcomes],
    }


def test_a_second_job_reuses_the_grouped_plans_from_the_plan_cache(launched, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped placements (``S(0/2)``, ``S(1/2:2)``) are written to and read back from the cache.
    The first job is the grouped case's launch (:func:`launched`, from an empty cache of its own),
    which also compiled the left-padded batch's and the training step's graphs after the greedy
    ones; the second job generates only: each of its graphs hits, with the first job's plan."""
    folder, first = launched(*GROUPED)
    _, ref_tokens = one_process_reference(folder, PROMPT, NEW_TOKENS, PAD_ID)
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(folder.parent / "cache"))
    second = run_ranks(_rank_cached, GROUPED[1], str(folder))
    for a, b in zip(first, second, strict=True):
        # the first job solves (a later graph identical to an earlier one may already hit)
        assert a["cache"][0] == "miss" and b["cache"] == ["hit"] * len(b["cache"])
        assert len(b["plans"]) >= 2 and b["plans"] == a["plans"][:len(b["plans"])]  # the warm-up's, decode's
        assert a["tokens"] == b["tokens"] == ref_tokens
