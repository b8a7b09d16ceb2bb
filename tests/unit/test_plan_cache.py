"""The plan cache (``autotp/plan_cache.py``) in one process, on a simulated group of 2 ranks.

A hit must reproduce the plan it stored exactly: the same placements, collectives and rewritten
program, hence the same outputs bit for bit (the simulated group's collectives are deterministic
stand-ins, so equal outputs mean equal programs; the tp=2 test with real ranks and a one-process
reference is in ``tests/distributed/test_stored_graphs.py``). Every bad entry is a miss with a reason,
is solved again and rewritten, and never changes a result.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from autotp.backend import compile_graph
from autotp.collectives import Comm
from autotp.config import AutoTPConfig
from autotp.context import TPContext, attach_meta
from autotp.placement import R
from autotp.plan_cache import (
    FORMAT,
    PlanCache,
    PlanKey,
    Uncacheable,
    cache_dir_from,
    entry_checksum,
    graph_fingerprint,
)
from autotp.weights import ParameterMeta
from tests._tiny import tiny_model

IDS = torch.tensor([[5, 17, 99, 3, 64]])


def _compile(cache: PlanCache, arch: str = "llama", pinned: dict[str, Any] | None = None,
             **config: Any) -> dict[str, Any]:
    """One fresh tiny model (one layer: compiles are what these tests pay for) compiled at a
    simulated tp=2 and called once. ``pinned``: parameter name -> the placement an earlier graph
    fixed for it."""
    torch._dynamo.reset()
    model = tiny_model(arch, **{"num_hidden_layers": 1, **config.pop("model", {})}).eval()
    for name, placement in (pinned or {}).items():
        p = model.get_parameter(name)
        attach_meta(p, ParameterMeta(fqn=name, global_shape=tuple(p.shape), dtype=p.dtype, placement=placement,
                                     tied=(name,)))
    ctx = TPContext(comm=Comm.simulated_group(2), config=AutoTPConfig(**config), plan_cache=cache)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return compile_graph(gm, example_inputs, ctx)

    with torch.no_grad():
        out = torch.compile(model, backend=backend)(input_ids=IDS, use_cache=False).logits
    return {"out": out, "code": [gm.code for gm in graphs], "plans": ctx.plans,
            "outcomes": [o.as_dict() for o in cache.outcomes]}


def _entry(cache: PlanCache) -> Path:
    (entry,) = cache.folder.glob("*.json")
    return entry


def _same_program(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert b["plans"] == a["plans"]
    assert b["code"] == a["code"]
    assert torch.equal(b["out"], a["out"])


@pytest.fixture(scope="module")
def _first_compile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The tiny Llama compiled once into an empty cache folder: the folder and that compile's
    results (read them, never change them)."""
    cache = PlanCache(tmp_path_factory.mktemp("first") / "cache")
    return cache.root, _compile(cache)


@pytest.fixture
def first(_first_compile, tmp_path: Path) -> tuple[PlanCache, dict[str, Any]]:
    """A cache folder of this test's own holding the entry of the tiny Llama's graph, and the
    results of the compile that stored it (a copy of one compile per module: the tests damage,
    replace or add entries, never the results)."""
    root, results = _first_compile
    shutil.copytree(root, tmp_path / "cache")
    return PlanCache(tmp_path / "cache"), results


def test_a_second_compile_of_the_same_model_hits_and_runs_the_same_program(first) -> None:
    cache, a = first
    (outcome,) = a["outcomes"]
    assert outcome["lookup_s"] > 0
    assert {**outcome, "lookup_s": 0} == {"status": "miss", "reason": "no entry", "entry": _entry(cache).name,
                                          "stored": True, "notes": [], "lookup_s": 0}
    b = _compile(PlanCache(cache.root))
    assert [o["status"] for o in b["outcomes"]] == ["hit"]
    _same_program(a, b)
    assert a["plans"][0]["collectives"]  # a real tp plan, not an all-replicated one


def _rewrite(entry: Path, edit) -> None:
    """Edit an entry's JSON and give it a valid checksum, so only the edit can make it fail."""
    data = json.loads(entry.read_text())
    edit(data)
    data["checksum"] = entry_checksum(data["key"], data["payload"])
    entry.write_text(json.dumps(data))


def _other_version(data: dict) -> None:
    data["key"]["versions"]["torch"] = "0.0.1"


def _stale_format(data: dict) -> None:
    data["format"] = FORMAT - 1


def _misplaced_parameter(data: dict) -> None:
    placeholders = data["payload"]["annotation"]["placeholders"]
    name = next(n for n in placeholders if "q_proj" in n)
    placeholders[name] = "S(7)"  # a dim the weight does not have


def _unknown_node(data: dict) -> None:
    plans = data["payload"]["annotation"]["plans"]
    plans["not_a_node"] = plans.pop(next(iter(plans)))


@pytest.mark.parametrize("damage, reason", [
    (lambda e: e.write_bytes(e.read_bytes()[: len(e.read_bytes()) // 2]), "corrupt entry (not JSON"),
    (lambda e: e.write_bytes(b"\x00\xff garbage"), "corrupt entry (not JSON"),
    (lambda e: e.write_text(e.read_text().replace('"S(0)"', '"S(1)"', 1)), "corrupt entry (checksum mismatch)"),
    (lambda e: e.write_text("[1, 2, 3]"), "corrupt entry (not a plan-cache entry)"),
    (lambda e: _rewrite(e, _stale_format), "stale entry (format"),
    (lambda e: _rewrite(e, _other_version), "entry of another version (torch)"),
    (lambda e: _rewrite(e, _misplaced_parameter), "entry does not fit the graph"),
    (lambda e: _rewrite(e, _unknown_node), "entry does not fit the graph"),
], ids=["truncated", "garbage", "bit-flip", "not-an-entry", "stale-format", "other-version",
        "misplaced-parameter", "unknown-node"])
def test_a_bad_entry_is_ignored_with_a_reason_and_rewritten(first, damage, reason: str) -> None:
    cache, a = first
    entry = _entry(cache)
    damage(entry)
    b = _compile(PlanCache(cache.root))
    (outcome,) = b["outcomes"]
    assert outcome["status"] == "miss" and outcome["reason"].startswith(reason), outcome
    assert outcome["stored"]
    _same_program(a, b)
    c = _compile(PlanCache(cache.root))  # the rewritten entry is good again
    assert [o["status"] for o in c["outcomes"]] == ["hit"]
    _same_program(a, c)


def test_an_entry_of_another_graph_under_this_graphs_name_is_refused(first, tmp_path: Path) -> None:
    cache, a = first
    other = PlanCache(tmp_path / "other")
    _compile(other, model={"intermediate_size": 256})
    _entry(other).replace(_entry(cache))  # the other model's valid entry, renamed to this graph's key
    b = _compile(PlanCache(cache.root))
    (outcome,) = b["outcomes"]
    assert outcome["status"] == "miss" and outcome["reason"] == "entry of another graph, other inputs"
    _same_program(a, b)


@pytest.mark.parametrize("change", [
    {"model": {"intermediate_size": 256}}, {"beam_width": 8}, {"memory_weight": 2.0},
    {"sequence_parallel": True}, {"fuse": False}, {"overrides": {"*.down_proj": "replicate"}},
], ids=["shape", "beam_width", "memory_weight", "sequence_parallel", "fuse", "overrides"])
def test_a_graph_or_option_that_differs_misses(first, change: dict) -> None:
    cache, _ = first
    b = _compile(PlanCache(cache.root), **change)
    assert [(o["status"], o["reason"]) for o in b["outcomes"]] == [("miss", "no entry")]
    assert len(list(cache.folder.glob("*.json"))) == 2


def test_a_parameter_pinned_elsewhere_misses_and_keeps_its_placement(first) -> None:
    cache, a = first
    name = "model.layers.0.self_attn.q_proj.weight"
    assert any(e["placement"] == "S(0)" for f, e in a["plans"][0]["parameters"].items() if f.endswith(name))
    b = _compile(PlanCache(cache.root), pinned={name: R})
    assert [(o["status"], o["reason"]) for o in b["outcomes"]] == [("miss", "no entry")]
    assert b["plans"][0]["parameters"][name]["placement"] == "R"


def test_a_location_that_cannot_be_written_works_without_a_cache_and_warns_once(_first_compile, tmp_path: Path) -> None:
    _, reference = _first_compile  # the same model compiled into a folder that could be written
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache = PlanCache(blocker / "cache")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = _compile(cache)
        b = _compile(cache, model={"intermediate_size": 256})
    messages = [str(w.message) for w in caught if "plan cache" in str(w.message)]
    assert len(messages) == 1 and "cannot be written" in messages[0] and "AUTOTP_CACHE_DIR" in messages[0]
    assert [o["status"] for o in b["outcomes"]] == ["miss", "miss"]
    assert not any(o["stored"] for o in b["outcomes"])
    _same_program(reference, a)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_still_serves_its_entries(first) -> None:
    cache, a = first
    os.chmod(cache.folder, 0o500)
    try:
        b = _compile(PlanCache(cache.root))
    finally:
        os.chmod(cache.folder, 0o700)
    assert [o["status"] for o in b["outcomes"]] == ["hit"]
    _same_program(a, b)


def test_the_cache_can_be_turned_off(tmp_path: Path) -> None:
    assert cache_dir_from({"AUTOTP_CACHE": "0", "AUTOTP_CACHE_DIR": str(tmp_path)}) is None
    cache = PlanCache.from_environment({"AUTOTP_CACHE": "off"})
    out = _compile(cache)
    assert out["outcomes"] == [{"status": "off", "reason": "AUTOTP_CACHE=0", "entry": None, "stored": False,
                                "notes": [], "lookup_s": 0.0}]


def test_the_location_comes_from_the_environment(tmp_path: Path) -> None:
    assert cache_dir_from({"AUTOTP_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache_dir_from({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "autotp"
    assert cache_dir_from({}) == Path.home() / ".cache" / "autotp"


def _write_many(root: str, fields: dict, digest: str, payload: dict, times: int) -> list[bool]:
    cache = PlanCache(Path(root))
    return [cache.store(PlanKey(fields, digest), payload["annotation"], payload["solve"], payload["plan"])
            for _ in range(times)]


def test_concurrent_writers_of_one_entry_both_succeed_and_readers_never_see_a_part(first) -> None:
    cache, a = first
    entry = _entry(cache)
    data = json.loads(entry.read_text())
    args = (str(cache.root), data["key"], entry.stem, data["payload"], 40)
    # forked, not spawned: a writer only stores JSON (no torch), and a spawned one would import
    # this module, torch with it, to find _write_many (~4 CPU-s each)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pending = [pool.apply_async(_write_many, args) for _ in range(2)]
        reads = 0
        while not all(p.ready() for p in pending):
            text = entry.read_text()  # always a whole entry: the old one or a new one
            assert json.loads(text)["checksum"] == data["checksum"]
            reads += 1
        results = [p.get(timeout=120) for p in pending]
    assert results == [[True] * 40, [True] * 40]
    assert reads > 0
    assert not list(cache.folder.glob(".*.tmp"))
    b = _compile(PlanCache(cache.root))
    assert [o["status"] for o in b["outcomes"]] == ["hit"]
    _same_program(a, b)


def _traced(fn) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


def test_the_graph_fingerprint_tells_apart_constants_and_targets() -> None:
    prints = [graph_fingerprint(_traced(fn)) for fn in (
        lambda x: x + 1, lambda x: x + 2, lambda x: x + 1.0, lambda x: x - 1, lambda x: x.view(2, 3),
        lambda x: x.view(3, 2), lambda x: torch.relu(x), lambda x: torch.sigmoid(x))]
    assert len({json.dumps(p) for p in prints}) == len(prints)
    assert graph_fingerprint(_traced(lambda x: x + 1)) == prints[0]  # and is stable


def test_a_graph_the_key_cannot_describe_is_uncacheable() -> None:
    with pytest.raises(Uncacheable, match="call_module"):
        graph_fingerprint(_traced(torch.nn.Sequential(torch.nn.Linear(2, 2))))

    class Opaque:
        pass

    gm = _traced(lambda x: x + 1)
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    add.args = (add.args[0], Opaque())
    with pytest.raises(Uncacheable, match="Opaque"):
        graph_fingerprint(gm)
