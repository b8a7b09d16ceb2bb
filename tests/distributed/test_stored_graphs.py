"""Stored graphs and the plan cache across jobs at tp=2 (gloo, CPU): a second job installs the graphs
the first one stored and runs without Dynamo tracing the model, with the first job's results; a call
the stored guards refuse is traced as before; a corrupt entry is ignored and rewritten. A second job
of the same model finds every graph's plan in the plan cache and runs exactly as the first.

Tolerance: logits are compared with a one-process transformers run at atol=1e-5, rtol=1e-4 (the
row-parallel reductions reorder fp32 additions); a job running stored graphs must equal the job
that traced them bit for bit, since it runs the same program.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import one_process_reference, save_tiny
from tests.distributed.test_parallelize import PAD_ID, PROMPT

pytestmark = pytest.mark.dist

#: two sequences: the warm-up's graph has batch 1, so the stored guards refuse this call
BATCH_OF_TWO = [[5, 17, 99, 3, 64, 12, 7], [8, 1, 42, 77, 30, 2, 9]]


def _job(rank: int, world: int, folder: str, cache_dir: str, new_tokens: int, batch_of_two: bool,
         trace_dir: str | None = None, trace_once: str = "0", fault: str | None = None) -> dict:
    """One job's results on this rank. ``trace_once``: ``AUTOTP_TRACE_ONCE`` (default "0": every
    rank traces, what the gate picks where each rank has a core, and what the tests that count
    each rank's traces check); ``fault``: "install" makes rank 0's installs of the tracer's frames
    fail, "publish" makes the tracer publish no frame (``autotp/shared_frames.py``)."""
    import os

    os.environ["AUTOTP_CACHE_DIR"] = cache_dir
    os.environ["AUTOTP_TRACE_ONCE"] = trace_once
    from torch._dynamo.utils import counters

    from autotp import compat, parallelize_model

    if fault == "install" and rank == 0:
        def refuse(*args: object) -> None:
            raise compat.PackageError("injected: this frame does not install")

        compat._install_frame = refuse
    if fault == "publish" and rank == world - 1:
        compat.DynamoPackage.frame_entry = lambda self, code, scope: None

    model = parallelize_model(folder, tp_size=world, trace_dir=trace_dir)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
        traced_before = counters["frames"]["ok"]
        outcomes = [o.as_dict() for o in model.autotp.context.plan_cache.outcomes]
        plans = list(model.autotp.plans)
        pair = model(input_ids=torch.tensor(BATCH_OF_TWO)).logits if batch_of_two else None
    return {"logits": logits, "tokens": tokens[0].tolist(), "pair": pair, "plans": plans,
            "traced": traced_before, "traced_for_pair": counters["frames"]["ok"] - traced_before,
            "stored": model.autotp.context.stored_graphs.as_dict(),
            "plan_cache": [o["status"] for o in outcomes], "plan_cache_outcomes": outcomes}


@pytest.fixture(scope="module")
def first_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """(the checkpoint, the cache folder, the ranks' :func:`_job` results) of a first job, 8 tokens,
    in an empty cache. Each test runs its later jobs in its own copy of that folder
    (:func:`cache_after`): the first job is the same for all, and traced and solved everything.
    (The plan-cache test, in its own file, ran the same first job again.)"""
    root = tmp_path_factory.mktemp("first-job")
    folder = save_tiny("llama", root / "llama", pad_token_id=PAD_ID)
    return folder, root / "cache", run_ranks(_job, 2, str(folder), str(root / "cache"), 8, False)


def cache_after(first_job: tuple[Path, Path, list[dict]], tmp_path: Path) -> Path:
    """A copy, for this test, of the cache folder the first job left."""
    return Path(shutil.copytree(first_job[1], tmp_path / "cache"))


def test_a_second_job_runs_the_stored_graphs_untraced_and_matches_the_first_and_one_process(
        first_job: tuple[Path, Path, list[dict]], tmp_path: Path) -> None:
    folder, _, first = first_job
    ref_logits, ref_tokens = one_process_reference(folder, PROMPT, 8, PAD_ID)
    ref_pair, _ = one_process_reference(folder, BATCH_OF_TWO, 1, PAD_ID)
    cache = cache_after(first_job, tmp_path)
    second = run_ranks(_job, 2, str(folder), str(cache), 8, True)

    for rank in range(2):
        a, b = first[rank], second[rank]
        assert a["stored"]["status"] == "miss" and a["stored"]["reason"] == "no entry"
        assert a["traced"] >= 2  # the warm-up's prefill and the decode graph
        assert b["stored"]["status"] == "hit" and b["stored"]["graphs"] == a["traced"]
        assert b["traced"] == 0  # Dynamo traced nothing: every call ran a stored frame
        assert b["plan_cache"] == ["hit"] * len(a["plan_cache"])  # each stored graph lowered with its cached plan
        assert b["plans"] == a["plans"]
        assert torch.equal(b["logits"], a["logits"])
        torch.testing.assert_close(b["logits"], ref_logits, atol=1e-5, rtol=1e-4)
        assert a["tokens"] == b["tokens"] == ref_tokens
        # a batch of two fails the stored guards (batch 1): traced and compiled, and right
        assert b["traced_for_pair"] >= 1
        torch.testing.assert_close(b["pair"], ref_pair, atol=1e-5, rtol=1e-4)
    writer = -1  # the last rank writes the entry (it pickles while rank 0 plans)
    assert first[writer]["stored"]["stored"] == first[writer]["traced"]  # it wrote every graph
    assert second[writer]["stored"]["stored"] == first[writer]["traced"] + second[writer]["traced_for_pair"]  # + the new
    assert first[0]["stored"]["stored"] == 0  # the other ranks wrote nothing
    assert len(list((cache / "graphs").glob("*.pkl"))) == 1
    assert not list((cache / "graphs").glob(".*.tmp"))


def test_a_second_job_hits_every_graph_in_the_plan_cache_and_matches_the_first_and_one_process(
        first_job: tuple[Path, Path, list[dict]], tmp_path: Path) -> None:
    """Every graph the first job solved is a plan-cache hit in the second, with the entry the first
    stored and the same plan; the trace says hit or miss per graph."""
    folder, first_cache, first = first_job
    ref_logits, ref_tokens = one_process_reference(folder, PROMPT, 8, PAD_ID)
    cache = cache_after(first_job, tmp_path)
    second = run_ranks(_job, 2, str(folder), str(cache), 8, False, str(tmp_path / "trace2"))

    for rank in range(2):
        a, b = first[rank]["plan_cache_outcomes"], second[rank]["plan_cache_outcomes"]
        assert len(a) >= 2  # the warm-up (prefill) graph and at least one decode graph
        assert all(o["status"] == "miss" and o["reason"] == "no entry" for o in a)
        assert all(o["stored"] for o in a)
        assert [o["status"] for o in b] == ["hit"] * len(a)
        assert [o["entry"] for o in b] == [o["entry"] for o in a]
        assert second[rank]["plans"] == first[rank]["plans"]
        assert torch.equal(second[rank]["logits"], first[rank]["logits"])
        torch.testing.assert_close(second[rank]["logits"], ref_logits, atol=1e-5, rtol=1e-4)
        assert first[rank]["tokens"] == second[rank]["tokens"] == ref_tokens
        # the trace says hit or miss per graph
        notes = [json.loads(p.read_text())["status"]
                 for p in sorted((tmp_path / "trace2" / f"rank{rank}").glob("graph*/plan_cache.json"))]
        assert notes == ["hit"] * len(a)
    plans = list((first_cache / "plans").glob("*.json"))
    assert len(plans) == len(first[0]["plan_cache_outcomes"])  # both ranks wrote the same
    assert not list((first_cache / "plans").glob(".*.tmp"))


def test_a_truncated_entry_is_ignored_with_its_reason_and_rewritten(first_job: tuple[Path, Path, list[dict]],
                                                                     tmp_path: Path) -> None:
    """A truncated entry: the second job traces (and says why), rewrites the entry, and the third
    runs it; the graphs the third read back are the ones the second traced, and with the same
    (cached) plans they lower to the same code."""
    folder = first_job[0]
    _, ref_tokens = one_process_reference(folder, PROMPT, 4, PAD_ID)
    cache = cache_after(first_job, tmp_path)  # the entry a job wrote
    (entry,) = (cache / "graphs").glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    second = run_ranks(_job, 2, str(folder), str(cache), 4, False, str(tmp_path / "trace"))
    third = run_ranks(_job, 2, str(folder), str(cache), 4, False, str(tmp_path / "trace3"))

    for rank in range(2):
        assert second[rank]["stored"]["status"] == "miss"
        assert second[rank]["stored"]["reason"].startswith("corrupt entry (not a pickle, truncated?")
        note = json.loads((tmp_path / "trace" / f"rank{rank}" / "stored_graphs.json").read_text())
        assert note["status"] == "miss" and note["reason"] == second[rank]["stored"]["reason"]
        assert second[rank]["traced"] >= 2
        assert third[rank]["stored"]["status"] == "hit" and third[rank]["traced"] == 0
        assert second[rank]["tokens"] == third[rank]["tokens"] == ref_tokens
        # each graph read back is the one the second job traced, and lowers to the same code and plan
        for name in ("dynamo_graph.py", "rewritten_graph.py", "plan.json"):
            traced = sorted((tmp_path / "trace" / f"rank{rank}").glob(f"graph*/{name}"))
            stored = sorted((tmp_path / "trace3" / f"rank{rank}").glob(f"graph*/{name}"))
            assert len(stored) == len(traced) >= 2
            assert [p.read_text() for p in stored] == [p.read_text() for p in traced], name


def test_a_cold_job_whose_ranks_share_the_tracing_ranks_frames_matches_every_rank_tracing(
        first_job: tuple[Path, Path, list[dict]], tmp_path: Path) -> None:
    """With ``AUTOTP_TRACE_ONCE=1`` in an empty cache, the last rank traces and rank 0 installs its
    frames (``autotp/shared_frames.py``): rank 0 traces nothing, also for the batch of two the
    stored guards refuse (a second compile of the frame, shared the same way), and every rank's
    logits, plans and tokens are those of the first job, whose ranks each traced."""
    folder, _, first = first_job
    ref_pair, _ = one_process_reference(folder, BATCH_OF_TWO, 1, PAD_ID)
    shared = run_ranks(_job, 2, str(folder), str(tmp_path / "cache"), 8, True, None, "1")

    follower, tracer = shared
    assert follower["traced"] == 0 and follower["traced_for_pair"] == 0
    assert tracer["traced"] == first[-1]["traced"] >= 2 and tracer["traced_for_pair"] >= 1
    for rank in range(2):
        assert shared[rank]["stored"]["notes"] == []
        assert shared[rank]["plans"] == first[rank]["plans"]
        assert torch.equal(shared[rank]["logits"], first[rank]["logits"])
        assert shared[rank]["tokens"] == first[rank]["tokens"]
        torch.testing.assert_close(shared[rank]["pair"], ref_pair, atol=1e-5, rtol=1e-4)
    assert tracer["stored"]["stored"] == tracer["traced"] + tracer["traced_for_pair"]  # it wrote every graph


@pytest.mark.parametrize("fault", ["install", "publish"])
def test_a_frame_that_is_not_shared_is_traced_by_each_rank_with_the_same_results(
        first_job: tuple[Path, Path, list[dict]], tmp_path: Path, fault: str) -> None:
    """Sharing frames where rank 0's install of each fails, or where the tracer publishes none (a
    frame its package cannot hold): at that first frame every rank stops sharing (saying why, and
    why the install failed) and traces its own frames from then on, so rank 0 traces every frame
    itself, no rank waits for another, and the results are the first job's."""
    folder, _, first = first_job
    shared = run_ranks(_job, 2, str(folder), str(tmp_path / "cache"), 8, False, None, "1", fault)

    assert shared[0]["traced"] == first[0]["traced"] >= 2
    stopped = "frames no longer shared: " + (
        "a rank could not install the tracing rank's frame" if fault == "install" else "the tracing rank could not share")
    follower, tracer = (shared[rank]["stored"]["notes"] for rank in range(2))
    if fault == "install":
        assert len(follower) == 2 and "did not install here (PackageError: injected" in follower[0]
        follower = follower[1:]
    assert len(follower) == len(tracer) == 1
    assert follower[0].startswith(stopped) and tracer[0].startswith(stopped)
    for rank in range(2):
        assert shared[rank]["plans"] == first[rank]["plans"]
        assert torch.equal(shared[rank]["logits"], first[rank]["logits"])
        assert shared[rank]["tokens"] == first[rank]["tokens"]


def _plain_then_hidden_states(rank: int, world: int, folder: str, cache_dir: str, trace_once: str) -> dict:
    import os

    os.environ["AUTOTP_CACHE_DIR"] = cache_dir
    os.environ["AUTOTP_TRACE_ONCE"] = trace_once
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        out = model(input_ids=ids, output_hidden_states=True)  # a new version of the forward
    return {"plain": plain, "logits": out.logits, "hidden": [h for h in out.hidden_states],
            "stored": model.autotp.context.stored_graphs.as_dict()}


@pytest.mark.parametrize("trace_once", ["0", "1"])
def test_a_later_call_that_compiles_a_frame_no_entry_can_hold_runs_and_a_warm_job_compiles_it_again(
        tmp_path: Path, trace_once: str) -> None:
    # output_hidden_states=True after a plain call compiles a frame whose entry pickle refuses
    # ("cannot pickle 'module' object"): the storing rank and the tracing rank that shares its
    # frames failed the call; the entry keeps the graphs it had, and the warm job (its installed
    # globals' numbers reserved) compiles the new frame itself
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama", pad_token_id=PAD_ID)
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=torch.tensor(PROMPT),
                                                                  output_hidden_states=True)
    logits, hidden = out.logits, out.hidden_states
    for job in ("cold", "warm"):
        for got in run_ranks(_plain_then_hidden_states, 2, str(folder), str(tmp_path / "cache"), trace_once):
            torch.testing.assert_close(got["plain"], logits, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-4)
            assert len(got["hidden"]) == len(hidden)
            for mine, theirs in zip(got["hidden"], hidden, strict=True):
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
            assert got["stored"]["status"] == ("miss" if job == "cold" else "hit")
