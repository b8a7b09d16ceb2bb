"""Dropout in training graphs at tp=2 (gloo, CPU).

Replicated regions draw from the default generator, seeded alike on every rank, so replicated
activations stay identical across ranks; sharded regions (attention probabilities of a rank's
heads) draw from per-rank streams derived from the seed and the rank (``autotp/rng.py``).

* same seed on every rank -> every rank returns the same logits and loss (replicated masks agree),
  and the sharded attention dropout ran on per-rank streams (``rank_rng`` rewrites in the trace);
  GPT-2's (SDPA's dropout mask over its 8 heads split 4 + 4) keeps Megatron's plan;
* the mean training loss over 12 seeds is statistically equal to one process's: the two means may
  differ by at most 4 standard errors of a difference of two 12-sample means, 4 * s * sqrt(2 / 12),
  with s the per-seed loss spread one process shows (a false failure about once in 16 000 runs),
  and the spreads agree within a factor 3;
* with dropout 0 the loss equals one process's within 1e-5 relative (the row-parallel all-reduces
  reorder fp32 sums).

The layers run through their layer regions (``layer_regions=True``: the path of every model of 4
layers or more, here at 2).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny, through_regions

pytestmark = pytest.mark.dist

IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40]])
SEEDS = range(12)
LAYERS = 2  # tests/_tiny.py's


def _tiny_llama(folder: Path, dropout: float) -> Path:
    """Llama with attention dropout, eager attention (dropout on the probabilities of each rank's heads)."""
    path = save_tiny("llama", folder, seed=0, num_hidden_layers=2, attention_dropout=dropout)
    config = json.loads((path / "config.json").read_text())
    config["attn_implementation"] = "eager"
    (path / "config.json").write_text(json.dumps(config))
    return path


def _gpt2(folder: Path, dropout: float) -> Path:
    """GPT-2: embedding, residual and (sdpa) attention dropout."""
    return save_tiny("gpt2", folder, seed=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


def _losses(model: torch.nn.Module) -> tuple[list[float], list[torch.Tensor]]:
    model.train()
    losses, logits = [], []
    for seed in SEEDS:
        torch.manual_seed(seed)
        out = model(input_ids=IDS, labels=IDS)
        losses.append(float(out.loss.detach()))
        logits.append(out.logits.detach())
    return losses, logits


def _rank_losses(rank: int, world: int, folder: str, trace: str) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, trace_dir=trace, logits_with_loss=True, layer_regions=True)
    warmup = len(model.autotp.plans)
    losses, logits = _losses(model)
    model(input_ids=IDS, labels=IDS).loss.backward()  # the training graph compiled above, backward
    finite = all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
    rewrites: dict[str, int] = {}
    for summary in sorted(Path(trace, f"rank{rank}").glob("graph*/summary.json")):
        for tag, count in json.loads(summary.read_text()).get("local_rewrites", {}).items():
            rewrites[tag] = rewrites.get(tag, 0) + count
    return {"losses": losses, "logits": logits, "rewrites": rewrites, "finite": finite, "regional": through_regions(model),
            "training_collectives": [plan["collectives"] for plan in model.autotp.plans[warmup:]]}


def _one_process(folder: Path) -> list[float]:
    from transformers import AutoModelForCausalLM

    return _losses(AutoModelForCausalLM.from_pretrained(folder))[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Callable[[Path, float], Path], float], tuple]:
    """``trained(build, dropout)`` -> (folder, the ranks' results of :func:`_rank_losses`): each model
    trains on 2 ranks once per module (the eager-attention stream test reads the rank_rng rewrites
    of the same dropout-0.1 Llama run whose losses the distribution test compares)."""
    runs: dict[tuple[str, float], tuple[Path, list[dict]]] = {}

    def run(build: Callable[[Path, float], Path], dropout: float) -> tuple[Path, list[dict]]:
        key = (build.__name__, dropout)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"{build.__name__}-{dropout}")
            folder = build(root / "model", dropout)
            runs[key] = folder, run_ranks(_rank_losses, 2, str(folder), str(root / "trace"))
        return runs[key]

    return run


@pytest.mark.parametrize("build", [_tiny_llama, _gpt2], ids=["llama-eager-attention", "gpt2"])
def test_dropout_keeps_ranks_in_sync_and_matches_one_process_in_distribution(trained, build) -> None:
    folder, ranks = trained(build, 0.1)
    for other in ranks[1:]:  # replicated regions drew the same masks on every rank
        assert other["losses"] == ranks[0]["losses"]
        for a, b in zip(other["logits"], ranks[0]["logits"], strict=True):
            assert torch.equal(a, b)
    assert len(set(ranks[0]["losses"])) == len(SEEDS)  # dropout is on: every seed gives another loss
    reference = _one_process(folder)
    spread = statistics.stdev(reference)
    bound = 4 * spread * (2 / len(SEEDS)) ** 0.5
    assert abs(statistics.mean(ranks[0]["losses"]) - statistics.mean(reference)) < bound
    # same spread: a variance ratio of two 12-sample sets beyond 9 has p ~ 5e-4 under F(11, 11)
    assert 1 / 3 < statistics.stdev(ranks[0]["losses"]) / spread < 3


@pytest.mark.parametrize("build", [_tiny_llama, _gpt2], ids=["llama-eager-attention", "gpt2"])
def test_training_with_dropout_zero_equals_one_process(trained, build) -> None:
    folder, ranks = trained(build, 0.0)
    reference = _one_process(folder)
    for r in ranks:
        assert r["regional"] and all(r["regional"])  # each layer through its region (layer_regions=True)
        assert r["losses"] == pytest.approx(reference, rel=1e-5)


def test_eager_attention_dropout_runs_on_the_ranks_own_streams(trained) -> None:
    _, (rank0, _) = trained(_tiny_llama, 0.1)
    assert rank0["rewrites"].get("rank_rng", 0) >= 2  # one per layer: each rank's heads, its own stream


def test_training_gpt2_with_attention_dropout_over_heads_split_evenly_keeps_megatrons_plan(trained) -> None:
    """With GPT-2's attention dropout SDPA's math kernel draws the mask as ``empty_like(attn).bernoulli_``:
    over 8 heads split 4 + 4 the mask keeps the probabilities' head split, each rank drawing its
    heads' mask from its own stream (one ``rank_rng`` per block), and the training graph
    communicates as Megatron's (2 all-reduces per block and the embedding's, no all-gather; before,
    evenly split heads ran attention replicated). Gradients are finite. (Heads split 2 + 1:
    tests/distributed/test_uneven_heads.py.)"""
    _, ranks = trained(_gpt2, 0.1)
    for r in ranks:
        # the model's graph; the loss function's own graph then gathers the vocab-sharded logits
        assert r["training_collectives"][0] == {"all_reduce": 2 * LAYERS + 1}, r["training_collectives"]
        assert r["rewrites"].get("rank_rng", 0) == LAYERS
        assert r["finite"]
