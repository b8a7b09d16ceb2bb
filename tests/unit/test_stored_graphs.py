"""The stored-graph entry on disk (``autotp/stored_graphs.py: GraphStore``): what is read back, and
why an entry is refused (truncated, corrupt, stale, another key), atomic writes from concurrent
writers, the cache switched off; a Dynamo graph pickled and read back keys as the traced one; and
what the package records (inlined sources as torch records them, guard-filter entries as torch
makes them)."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autotp import compat
from autotp.compat import DynamoPackage, PackageError, maybe_mark_dynamic, pickle_graph, unpickle_graph
from autotp.plan_cache import graph_fingerprint
from autotp.stored_graphs import FORMAT, GraphStore, StoredGraph

KEY = {"format": FORMAT, "model": "LlamaForCausalLM", "world_size": 2}
PAYLOAD = {"entry": "dynamo entry", "aliases": {}, "graphs": {"__compiled_fn_1": (b"graph", {})}}


def _stored(tmp_path: Path, key: dict = KEY) -> GraphStore:
    store = GraphStore(tmp_path, dict(key))
    assert store.write(PAYLOAD)
    return store


def test_an_entry_written_is_read_back_under_the_same_key(tmp_path: Path) -> None:
    _stored(tmp_path)
    store = GraphStore(tmp_path, dict(KEY))
    assert store.read() == PAYLOAD
    assert store.outcome.status == "miss" and store.outcome.reason is None  # a hit once it installs


def test_no_entry_is_a_miss_that_says_so(tmp_path: Path) -> None:
    store = GraphStore(tmp_path, dict(KEY))
    assert store.read() is None
    assert store.outcome.reason == "no entry"


def test_a_truncated_entry_is_refused_as_corrupt(tmp_path: Path) -> None:
    path = _stored(tmp_path).path
    path.write_bytes(path.read_bytes()[:-40])
    store = GraphStore(tmp_path, dict(KEY))
    assert store.read() is None
    assert store.outcome.reason.startswith("corrupt entry (not a pickle, truncated?")


def test_a_changed_payload_fails_its_checksum(tmp_path: Path) -> None:
    path = _stored(tmp_path).path
    entry = pickle.loads(path.read_bytes())
    entry["payload"] = pickle.dumps({**PAYLOAD, "aliases": {"x": ("module", "os")}})
    path.write_bytes(pickle.dumps(entry))
    store = GraphStore(tmp_path, dict(KEY))
    assert store.read() is None
    assert store.outcome.reason == "corrupt entry (checksum mismatch)"


def test_an_entry_of_another_format_is_stale(tmp_path: Path) -> None:
    path = _stored(tmp_path).path
    entry = pickle.loads(path.read_bytes())
    entry["format"] = FORMAT + 1
    path.write_bytes(pickle.dumps(entry))
    store = GraphStore(tmp_path, dict(KEY))
    assert store.read() is None
    assert store.outcome.reason == f"stale entry (format {FORMAT + 1}, this autotp writes {FORMAT})"


def test_an_entry_under_this_name_with_another_key_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = _stored(tmp_path, {**KEY, "world_size": 4}).path
    store = GraphStore(tmp_path, dict(KEY))
    path.rename(store.path)  # as if two keys met under one file name
    assert store.read() is None
    assert store.outcome.reason == "entry of another world_size"


def test_concurrent_writers_all_succeed_and_leave_one_whole_entry(tmp_path: Path) -> None:
    results: list[bool] = []
    writers = [threading.Thread(target=lambda: results.append(GraphStore(tmp_path, dict(KEY)).write(PAYLOAD)))
               for _ in range(8)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert results == [True] * 8
    assert GraphStore(tmp_path, dict(KEY)).read() == PAYLOAD
    assert [p.name for p in (tmp_path / "graphs").iterdir()] == [GraphStore(tmp_path, dict(KEY)).path.name]


def test_with_the_cache_off_nothing_is_read_or_written(tmp_path: Path) -> None:
    store = GraphStore(None, dict(KEY))
    assert store.read() is None and not store.write(PAYLOAD)
    assert store.outcome.status == "off"


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "with-gradients"])
def test_a_dynamo_graph_read_back_keys_as_the_traced_one(grad: bool) -> None:
    """Plain fake values take pickle_graph's cheap form, views and non-leaf values needing a gradient
    GraphPickler's own: either way the graph read back keys as the traced one (sizes, strides, dtype,
    requires_grad, type)."""
    seen: list[tuple[list, list]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        stored = StoredGraph.of(gm, example_inputs)
        seen.append((graph_fingerprint(gm), graph_fingerprint(unpickle_graph(pickle_graph(gm)))))
        assert stored.markings == {"L['x']": {"_dynamo_weak_dynamic_indices": {1}, "_has_dynamo_dim_marking": True}}
        return gm.forward

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.transpose(0, 1) @ w).relu().view(-1)  # a view and a symbolic size in the example values

    x = torch.randn(3, 5)
    maybe_mark_dynamic(x, 1)
    torch.compile(f, backend=backend)(x, torch.randn(3, 4, requires_grad=grad))
    (traced, read_back), = seen
    assert read_back == traced
    assert any(value[5] for *_, value, _source in traced if value and value[0] == "T") == grad  # requires_grad


def _layouts(gm: torch.fx.GraphModule) -> list[tuple]:
    """Every tensor example value of ``gm``: its type, sizes, strides, offset, storage size, dtype,
    device, ``requires_grad``, leaf-ness and dispatch keys (symbolic sizes as their expressions)."""
    out = []
    for n in gm.graph.nodes:
        for t in torch.utils._pytree.tree_leaves(n.meta.get("example_value")):
            if isinstance(t, torch.Tensor):
                out.append((n.name, type(t).__qualname__, [str(s) for s in t.shape], [str(s) for s in t.stride()],
                            t.storage_offset(), str(t.untyped_storage().nbytes()), t.dtype, t.device,
                            t.requires_grad, t.is_leaf, repr(torch._C._dispatch_keys(t))))
    return out


def test_a_fake_value_read_back_has_the_traced_layout_storage_size_and_dispatch_keys() -> None:
    """pickle_graph's cheap form rebuilds a plain fake value over a storage of the traced size
    (symbolic where a size is), not by torch.empty_strided: the value read back has the traced
    one's layout, storage size and dispatch keys, node for node."""
    seen: list[tuple[list, list]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append((_layouts(gm), _layouts(unpickle_graph(pickle_graph(gm)))))
        return gm.forward

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w).relu() + 1).to(torch.float64)

    x = torch.randn(3, 5)
    maybe_mark_dynamic(x, 0)
    torch.compile(f, backend=backend)(x, torch.randn(5, 4, requires_grad=True))
    (traced, read_back), = seen
    assert read_back == traced
    assert any("s" in storage for *_, storage, _dtype, _device, _grad, _leaf, _keys in traced)  # a symbolic size


def test_a_node_added_to_a_graph_read_back_is_named_as_in_the_traced_graph() -> None:
    """The names a traced graph used and dropped are kept: a node a pass adds to the graph read
    back gets the name it gets in the traced graph, so the lowered code is the same, name for name."""
    names: list[tuple[str, str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            gm.graph.erase_node(gm.graph.call_function(torch.relu, (x,)))  # a name used, then dropped
        read_back = unpickle_graph(pickle_graph(gm))
        added = []
        for graph in (gm.graph, read_back.graph):
            first = next(n for n in graph.nodes if n.op == "placeholder")
            with graph.inserting_after(first):
                added.append(graph.call_function(torch.relu, (first,)).name)
        names.append(tuple(added))
        return gm.forward

    torch.compile(lambda x: x.relu() + 1, backend=backend)(torch.randn(3))
    ((traced, read_back),) = names
    assert read_back == traced != "relu"


class _NoPickle:
    """A callable module attribute no pickle holds (as a process group is)."""

    def __call__(self) -> None:
        return None

    def __reduce__(self) -> tuple:
        raise TypeError("this attribute does not pickle")


def test_a_model_whose_guards_cannot_be_stored_still_compiles_and_runs_and_is_not_stored() -> None:
    model = torch.nn.Linear(3, 2)
    model.hook = _NoPickle()
    package = DynamoPackage(type(model).forward.__get__(model), lambda gm, example_inputs: gm.forward)
    x = torch.randn(4, 3)
    torch.testing.assert_close(package(x), model(x), atol=0, rtol=0)
    with pytest.raises(PackageError, match="this attribute does not pickle"):
        package.entry()


def _linear_forward(model: torch.nn.Linear) -> object:
    return type(model).forward.__get__(model)


def test_an_installed_package_runs_its_stored_graph_and_a_changed_parameter_shape_fails_its_guards() -> None:
    """The guard states are rebuilt in one fake mode (``compat._guard_tensors_in_one_fake_mode``), not
    torch's one per tensor: the parameters' sizes are still guarded, so another weight shape compiles anew."""
    torch._dynamo.reset()
    compiled: list[tuple[int, ...]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiled.append(tuple(next(t.shape for t in example_inputs if t.dim() == 2 and t.shape[0] == 2)))
        return gm.forward

    first, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    package = DynamoPackage(_linear_forward(first), backend)
    package(x)
    stored = pickle.loads(pickle.dumps(package.entry()))
    graphs = package.graphs()
    package.uninstall()
    torch._dynamo.reset()
    compiled.clear()

    same, wider = torch.nn.Linear(3, 2), torch.nn.Linear(5, 2)
    installed = DynamoPackage(_linear_forward(same), backend, stored, graphs)
    torch.testing.assert_close(installed(x), same(x), atol=0, rtol=0)
    assert compiled == []  # the stored graph ran: nothing traced
    y = torch.randn(4, 5)
    torch.testing.assert_close(torch.compile(_linear_forward(wider), backend=backend)(y), wider(y), atol=0, rtol=0)
    assert compiled == [(2, 5)]  # the stored frame's guards refused the other weight shape
    installed.uninstall()
    torch._dynamo.reset()


HELPER = """import torch


def double(x):
    y = x * 2
    return y + 1


def outer(x):
    return double(x) - sum(v for v in (1, 2))
"""


def test_a_package_records_an_inlined_function_s_source_as_torch_does_and_refuses_it_once_changed(
        tmp_path: Path) -> None:
    """``compat._inlined_source`` reads a function's lines from its code object, not torch's
    ``inspect`` scan: for a plain function the record is torch's own, and an install still refuses
    the package once a line of an inlined function changed."""
    from torch._dynamo.package import SourceInfo

    (tmp_path / "autotp_inlined_helper.py").write_text(HELPER)
    sys.path.insert(0, str(tmp_path))
    try:
        helper = importlib.import_module("autotp_inlined_helper")
        torch._dynamo.reset()
        x = torch.randn(3)
        package = DynamoPackage(helper.outer, lambda gm, example_inputs: gm.forward)
        torch.testing.assert_close(package(x), helper.outer(x), atol=0, rtol=0)
        stored = pickle.loads(pickle.dumps(package.entry()))
        graphs = package.graphs()
        package.uninstall()
        torch._dynamo.reset()
        torch_records = SourceInfo(inlined_sources=set())
        torch_records.add_code(helper.double.__code__)
        recorded = {r for r in stored[0].source_info.inlined_sources if r.module == helper.__name__}
        assert compat._inlined_source(helper.double.__code__) in torch_records.inlined_sources
        assert torch_records.inlined_sources <= recorded  # double, as torch records it
        assert {r.firstlineno for r in recorded} >= {helper.double.__code__.co_firstlineno,
                                                     helper.outer.__code__.co_firstlineno}

        DynamoPackage(helper.outer, lambda gm, example_inputs: gm.forward, stored, graphs).uninstall()  # installs
        torch._dynamo.reset()
        path = tmp_path / "autotp_inlined_helper.py"
        path.write_text(HELPER.replace("x * 2", "x * 3"))
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))  # inspect's line cache sees the change
        with pytest.raises(PackageError, match="Source code changes detected"):
            DynamoPackage(helper.outer, lambda gm, example_inputs: gm.forward, stored, graphs)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("autotp_inlined_helper", None)
        torch._dynamo.reset()


def _filter_entries(model: torch.nn.Module, x: torch.Tensor, lazily: bool) -> list[tuple]:
    """Every guard-filter entry Dynamo makes compiling ``model(x)``: its fields, its value as a kind
    (the object itself for the model, its parameters and ``x``)."""
    seen: list[tuple] = []
    known = {id(v) for v in (model, x, *model.parameters())}

    def keep_all(entries: list) -> list[bool]:
        for e in entries:
            value = (id(e.value) if id(e.value) in known else type(e.value).__name__) if e.has_value else None
            seen.append((e.name, e.has_value, value, e.guard_type, e.derived_guard_types, e.is_global))
        return [True] * len(entries)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", options={"guard_filter_fn": keep_all})
    if lazily:
        with compat._guard_values_read_lazily():
            compiled(x)
    else:
        compiled(x)
    torch._dynamo.reset()
    return seen


def test_a_guard_filter_sees_the_entries_torch_makes_when_values_are_read_lazily() -> None:
    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    eager = _filter_entries(model, x, lazily=False)
    assert eager and _filter_entries(model, x, lazily=True) == eager


def test_ranks_share_traced_frames_where_asked_else_where_they_outnumber_the_cores() -> None:
    """The gate of ``autotp/shared_frames.py``: the option wins, then ``AUTOTP_TRACE_ONCE``, else
    on exactly where this host's ranks (``LOCAL_WORLD_SIZE``, else the group) outnumber the cores
    this process may run on."""
    import os

    from autotp.shared_frames import trace_once_default

    cores = len(os.sched_getaffinity(0))
    assert not trace_once_default(None, {"LOCAL_WORLD_SIZE": str(cores)}, world_size=cores + 1)
    assert trace_once_default(None, {"LOCAL_WORLD_SIZE": str(cores + 1)}, world_size=1)
    assert not trace_once_default(None, {}, world_size=cores)
    assert trace_once_default(None, {}, world_size=cores + 1)
    assert trace_once_default(None, {"AUTOTP_TRACE_ONCE": "1", "LOCAL_WORLD_SIZE": "1"}, world_size=1)
    assert not trace_once_default(None, {"AUTOTP_TRACE_ONCE": "off"}, world_size=cores + 1)
    assert trace_once_default(True, {"AUTOTP_TRACE_ONCE": "0"}, world_size=1)
    assert not trace_once_default(False, {"AUTOTP_TRACE_ONCE": "1"}, world_size=cores + 1)


def test_a_resume_function_with_free_variables_is_made_without_running_a_python_frame() -> None:
    """A follower of ``autotp/shared_frames.py`` installs the tracer's resume functions; Dynamo's
    code calls the factory of one with free variables with its closure. A Python frame there would
    be a frame only that rank runs: the eval-frame hook calls the frame callback on it, which takes
    the tracer's next frame as its own (a gradient-checkpointed Llama hung so). The factory runs
    none, and makes the function on the given closure."""
    import torch._dynamo.package as package_module

    def outer() -> object:
        x = 3

        def inner() -> int:
            return x + 1

        return inner

    serialized = SimpleNamespace(python_code=package_module.SerializedCode.from_code_object(outer().__code__))
    factory = compat._resume_function(package_module, serialized, {}, "__resume_at_0_0")
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        function = factory((types.CellType(41),))
    finally:
        sys.setprofile(None)
    assert [c for c in calls if c != "<lambda>"] == []
    assert function() == 42


def test_a_frame_dynamo_compiled_no_code_for_is_returned_alike_on_the_followers() -> None:
    """What Dynamo's callback returns for a frame it compiles no code for (its default: skip this
    frame and later ones of its code) travels as a :class:`compat.FrameSkip` and comes back equal."""
    import torch._dynamo.types as dynamo_types

    for result in (dynamo_types.ConvertFrameReturn(), dynamo_types.ConvertFrameReturn(
            frame_exec_strategy=dynamo_types.FrameExecStrategy(dynamo_types.FrameAction.RUN_ONLY,
                                                               dynamo_types.FrameAction.RUN_ONLY),
            apply_to_code=False, skip_reason="recompile limit")):
        back = pickle.loads(pickle.dumps(compat.FrameSkip.of(result))).result()
        assert back.guarded_code is None and back.apply_to_code == result.apply_to_code
        assert back.skip_reason == result.skip_reason
        assert back.frame_exec_strategy.cur_action == result.frame_exec_strategy.cur_action
        assert back.frame_exec_strategy.recursive_action == result.frame_exec_strategy.recursive_action
