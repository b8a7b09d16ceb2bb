"""compile_inner="inductor" at tp=2 (gloo, CPU): the rewritten per-rank inference graphs run through
inductor with functional collectives; logits and greedy tokens match compile_inner="eager", the
same collectives are issued, and a training graph falls back to eager with a trace note. A second
job of the same two models (eager, then inductor) runs both from the graphs the first job stored.

One first job per module (:func:`first_job`, in an empty cache of its own) serves both tests: the
stored-graphs test ran the same job (the same checkpoint, both inner compilers) as its first.

Tolerance: atol=1e-5, rtol=1e-4 (inductor fuses the elementwise ops of a norm or an activation
into one C++ loop, which may round fp32 differently; the matmuls are the same library calls).
Greedy tokens are identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _run(rank: int, world: int, folder: str, trace: str) -> dict:
    import torch._inductor.config

    from autotp import parallelize_model

    # each rank compiles its few kernels itself: inductor's pool of compile workers (on a machine
    # with 2 cores, a process importing torch for each rank of each job) costs more than it saves
    torch._inductor.config.compile_threads = 1
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


@pytest.fixture(scope="module")
def first_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, list[dict]]:
    """(the checkpoint, its cache folder, the first job's trace folder, the ranks' :func:`_run`
    results): a 1-layer tiny Llama (what the tests check is per graph, per forward code object and
    per model, not per block; with 2, inductor compiled the C++ of 2 blocks in every rank) run once
    with both inner compilers, in an empty cache of its own."""
    root = tmp_path_factory.mktemp("inner")
    folder = save_tiny("llama", root / "llama", pad_token_id=0, num_hidden_layers=1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AUTOTP_CACHE_DIR", str(root / "cache"))
        results = run_ranks(_run, 2, str(folder), str(root / "trace"))
    return folder, root / "cache", root / "trace", results


@pytest.mark.slow
def test_inductor_matches_eager_and_training_graphs_fall_back(first_job: tuple[Path, Path, Path, list[dict]]) -> None:
    _, _, trace, results = first_job
    for rank, r in enumerate(results):
        eager, ind = r["eager"], r["inductor"]
        torch.testing.assert_close(ind["logits"], eager["logits"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ind["train_logits"], eager["logits"], atol=1e-5, rtol=1e-4)
        assert ind["tokens"] == eager["tokens"]
        assert ind["counts"] == eager["counts"] and ind["counts"]["all_reduce"] > 0
        assert ind["graphs"] > ind["graphs_inference"] >= 2
        infos = [json.loads((trace / "inductor" / f"rank{rank}" / f"graph{g:03d}" / "inner.json").read_text())
                 for g in range(ind["graphs"])]
        assert all(i["compiler"] == "inductor" for i in infos[: ind["graphs_inference"]]), infos
        assert all(i["compiler"] == "eager" and "training graph" in i["fallback"]
                   for i in infos[ind["graphs_inference"]:]), infos


def test_a_second_job_loading_two_models_of_one_class_runs_both_from_the_stored_graphs(
        first_job: tuple[Path, Path, Path, list[dict]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two models of one class in one process (eager then inductor inner graphs, the first released
    when the second is assigned), in a second job whose stored entries they install: both install
    frames on the class's one forward code, and the first model's release must not take away what
    the second installed (it did: the second job's second model failed with a NameError on a
    Dynamo module alias). Checked as the test above checks one job: same logits and tokens.
    (The second job runs in a copy of the first job's cache.)"""
    folder, first_cache, _, first = first_job
    cache = Path(shutil.copytree(first_cache, tmp_path / "cache"))
    assert list((cache / "graphs").glob("*.pkl"))  # the first job stored its graphs
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(cache))
    second = run_ranks(_run, 2, str(folder), str(tmp_path / "trace"))
    for a, b in zip(first, second, strict=True):
        for inner in ("eager", "inductor"):
            assert b[inner]["tokens"] == a[inner]["tokens"]
            torch.testing.assert_close(b[inner]["logits"], a[inner]["logits"], atol=1e-5, rtol=1e-4)
