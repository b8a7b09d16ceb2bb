"""``torch.compile(model, backend="autotp")`` on an in-memory model (same weights on every rank).

Tolerance: logits at atol=1e-5, rtol=1e-4 against the uncompiled model in the same process
(partial sums across ranks reorder fp32 additions). Decoding through the compiled ``forward`` (the
KV cache kept sharded across steps, the logits gathered once per call, a reordered cache refused)
is the architecture matrix's ``-compile`` cases (tests/distributed/test_architectures.py).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist


def _param_bytes(model: torch.nn.Module) -> int:
    """Bytes this rank holds for parameters: module storages (stand-ins hold one element) plus the
    local shards kept on each ParameterMeta, each distinct storage once (fused sibling weights,
    autotp/passes/fuse.py, are views into one storage)."""
    from autotp.context import meta_of

    storages: dict[int, int] = {}
    for p in model.parameters():
        tensors = [p]
        meta = meta_of(p)
        if meta is not None and meta.local is not None:
            tensors.append(meta.local)
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _rank_compile(rank: int, world: int, folder: str) -> dict:
    """Compile an in-memory Llama, run it at two lengths, then call the original module (sharded in
    place by the first call) and the compiled one again."""
    import os

    from transformers import AutoModelForCausalLM

    from autotp import AutoTPError, session_of
    from autotp.context import meta_of

    os.environ["AUTOTP_TRACE_DIR"] = str(Path(folder) / "trace")
    os.environ["AUTOTP_CACHE_DIR"] = str(Path(folder) / "plans")  # empty: every graph is planned
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    full_bytes = _param_bytes(model)
    compiled = torch.compile(model, backend="autotp")
    short, long = torch.tensor([[3, 9, 27, 81, 4]]), torch.tensor([[5, 17, 99, 3, 64, 12, 7, 8, 1]])
    with torch.no_grad():
        ref_short, ref_long = model(input_ids=short).logits, model(input_ids=long).logits
    with torch.no_grad():
        out_short = compiled(input_ids=short, use_cache=False).logits
    metas = {p: meta_of(p) for p in model.parameters()}
    locals_after_first = {m.fqn: id(m.local) for m in metas.values()}
    placements_after_first = {m.fqn: str(m.placement) for m in metas.values()}
    bytes_after_first = _param_bytes(model)
    with torch.no_grad():
        out_long = compiled(input_ids=long, use_cache=False).logits
        try:
            eager = model(input_ids=short, use_cache=False).logits
            error = f"no error; logits finite: {bool(torch.isfinite(eager).all())}"
        except AutoTPError as e:
            error = str(e)
        again = compiled(input_ids=short, use_cache=False).logits  # the compiled model is unaffected
    graphs = sorted((Path(folder) / "trace" / f"rank{rank}").glob("graph*"))
    return {
        "short_err": (out_short - ref_short).abs().max().item(),
        "long_err": (out_long - ref_long).abs().max().item(),
        "full_bytes": full_bytes,
        "bytes_after_first": bytes_after_first,
        "same_local_objects": locals_after_first == {m.fqn: id(m.local) for m in metas.values()},
        "same_placements": placements_after_first == {m.fqn: str(m.placement) for m in metas.values()},
        "sharded_fqns": [m.fqn for m in metas.values() if "S(" in str(m.placement)],
        "graph_ids": [g.graph_id for g in session_of(model).graphs],
        "sessions": len({id(m.session) for m in metas.values()}),
        "trace_folders": sorted(p.name for p in (Path(folder) / "trace" / f"rank{rank}").iterdir()),
        "solved": [(g / "decisions.jsonl").exists() for g in graphs],
        "plan_from": [json.loads((g / "summary.json").read_text()).get("plan_from") for g in graphs],
        "plans": session_of(model).plans,
        "error": error,
        "again_err": (again - ref_short).abs().max().item(),
    }


@pytest.fixture(scope="module")
def compiled_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """:func:`_rank_compile` on 2 ranks, once for the tests of this module that read it."""
    folder = save_tiny("llama", tmp_path_factory.mktemp("compile") / "llama")
    return run_ranks(_rank_compile, 2, str(folder), timeout=600)


def test_compiled_in_memory_model_matches_and_keeps_one_nth_of_sharded_weights(compiled_ranks: list[dict]) -> None:
    for r in compiled_ranks:
        assert r["short_err"] < 1e-4 and r["long_err"] < 1e-4
        assert r["same_local_objects"] and r["same_placements"]
        assert len(r["sharded_fqns"]) >= 15  # q/k/v/o/gate/up/down x 2 layers + embedding + lm_head
        # every 2-D weight is sharded in two: what is left is half of it plus the small replicated norms
        assert r["bytes_after_first"] < 0.55 * r["full_bytes"]
        # one session per model: the recompiles for the longer input and after the weights were
        # released join the first graph's session, so graph ids (and trace folders) do not repeat
        assert r["sessions"] == 1 and len(r["graph_ids"]) >= 2
        assert r["graph_ids"] == list(range(len(r["graph_ids"])))
        assert r["trace_folders"] == [f"graph{i:03d}" for i in r["graph_ids"]]


def test_rank_0_plans_each_graph_for_the_group_and_the_others_trace_the_plan_it_sent(
        compiled_ranks: list[dict]) -> None:
    """The test harness's group waits 10 minutes (``run_ranks(timeout=600)``), as long as one
    autotp starts: rank 0 alone solves (its trace holds the decisions), rank 1 rebuilds rank 0's
    plan on its own graph and its trace says so; both lower the same plans."""
    rank0, rank1 = compiled_ranks
    assert rank0["solved"][0] and not any(rank1["solved"])
    assert not any(rank0["plan_from"])
    # a graph rank 0 solved, rank 1 rebuilt from what it sent; a graph compiled again (the weights
    # released after the first call) both read from the plan cache the first one filled
    assert rank1["plan_from"] == ["rank 0" if solved else None for solved in rank0["solved"]]
    assert rank1["plans"] == rank0["plans"]


def _rank_waits(rank: int, world: int) -> bool:
    from autotp.backend import waits_for_a_plan
    from autotp.collectives import Comm

    return waits_for_a_plan(Comm.from_default_group())


def test_a_group_with_a_short_timeout_plans_on_every_rank() -> None:
    """Under ``backend="autotp"`` the others wait for rank 0's plan in a collective of the caller's
    group: only where its timeout is at least 10 minutes; a shorter one bounds peer skew."""
    assert run_ranks(_rank_waits, 1, timeout=60) == [False]
    assert run_ranks(_rank_waits, 1, timeout=datetime.timedelta(minutes=10).total_seconds()) == [True]


def _rank_refused(rank: int, world: int) -> str:
    torch.manual_seed(0)  # the same weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    compiled = torch.compile(model, backend="autotp", options={"overrides": {"0": "vocab"}})
    try:
        compiled(torch.ones(4, 8))
    except Exception as e:  # noqa: BLE001 - Dynamo may wrap the backend's error; its text is compared
        return str(e)
    return "compiled"


def test_a_planning_error_on_rank_0_reaches_the_other_rank() -> None:
    """Rank 0 plans for the group: its refusal of an override is broadcast and raised on rank 1
    too, which would otherwise wait for a plan that never comes."""
    messages = run_ranks(_rank_refused, 2, timeout=600)
    for message in messages:
        assert "override '0': 'vocab' cannot be honoured for 0.weight" in message, message


def test_backend_name_resolves_through_the_entry_point_without_importing_autotp() -> None:
    code = (
        "import torch, sys\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))\n"
        "x = torch.randn(4, 8)\n"
        "expected = m(x)\n"
        "assert 'autotp' not in sys.modules\n"
        "y = torch.compile(m, backend='autotp')(x)\n"
        "assert 'autotp.backend' in sys.modules\n"
        "torch.testing.assert_close(y, expected)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_the_original_module_refuses_to_run_once_the_backend_sharded_it(compiled_ranks: list[dict]) -> None:
    # Before: the uncompiled model computed with the NaN stand-ins and returned NaN logits, no error.
    for r in compiled_ranks:
        assert "was sharded in place by torch.compile(model, backend='autotp')" in r["error"], r["error"]
        assert "Call the module torch.compile returned instead" in r["error"]
        assert r["short_err"] < 1e-4 and r["again_err"] < 1e-4  # atol as in the module docstring
