"""``autotp/memory.py``: freed heap pages go back to the OS; Dynamo's guard-latency profiling (a
~32 MB cache-eviction buffer per compiled graph) is skipped inside the block and only there;
planning's and each Dynamo compile's collections walk only their own objects, unless the process
froze its own, and a compile makes no automatic full collection (nor one of its own that would bring
the next one forward); a call on a fresh stack is a plain call
run in another thread.

Exact checks only (which function Dynamo calls, what is restored); no RSS or timing asserts.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch._dynamo.guards as dynamo_guards

from autotp import memory
from autotp.compat import _optimize as compat_optimize
from autotp.compat import no_guard_latency_profile
from autotp.memory import cycle_collection_paused, release_free_memory


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_release_free_memory_collects_cycles_and_trims_the_heap_only_when_asked(monkeypatch) -> None:
    import weakref

    import autotp.memory

    trims: list[int] = []
    monkeypatch.setattr(autotp.memory, "trim_heap", lambda: trims.append(1) or True)

    def cycle() -> weakref.ref:
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # unreachable once this returns, freed only by a collection
        return weakref.ref(a)

    gc_was_enabled = gc.isenabled()
    gc.disable()  # only release_free_memory may collect here
    try:
        kept = cycle()
        assert release_free_memory(collect=False) is True and kept() is not None  # no collection asked
        assert release_free_memory() is True and kept() is None  # the cycle is gone
    finally:
        if gc_was_enabled:
            gc.enable()
    assert trims == [1, 1]  # the heap is trimmed on every call


def test_guard_latency_profile_is_skipped_inside_the_block_and_restored_after() -> None:
    original = dynamo_guards.profile_guard_manager
    calls: list[int] = []

    def counting(*args: object) -> float:
        calls.append(1)
        return original(*args)

    dynamo_guards.profile_guard_manager = counting
    try:
        torch._dynamo.reset()
        with no_guard_latency_profile():
            assert dynamo_guards.profile_guard_manager is not counting
            with no_guard_latency_profile():  # nested: restores what it found
                pass
            assert dynamo_guards.profile_guard_manager is not counting
            out = torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        assert calls == []  # the graph compiled inside the block was not profiled
        assert dynamo_guards.profile_guard_manager is counting
        torch.testing.assert_close(out, torch.full((3,), 3.0))  # exact: small integers in fp32
        torch.compile(lambda x: x * 3 - 1, backend="eager")(torch.ones(3))
        assert calls == [1]  # outside the block Dynamo profiles as before
    finally:
        dynamo_guards.profile_guard_manager = original
        torch._dynamo.reset()


def test_the_collector_pauses_for_the_outermost_block_and_resumes_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="lowering failed"), cycle_collection_paused():
        with cycle_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it to the outer one
        raise RuntimeError("lowering failed")
    assert gc.isenabled()


def test_planning_freezes_older_objects_for_the_outermost_block_only(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_frozen_before", None)  # as in a fresh process
    assert gc.get_freeze_count() == 0
    with memory.collecting_new_objects_only():
        frozen = gc.get_freeze_count()
        assert frozen > 0  # every object older than the block, out of the collector's walks
        with memory.collecting_new_objects_only():
            pass
        # the inner block left them to the outer one (a frozen object freed by its last reference
        # leaves the count, so not an exact equality)
        assert gc.get_freeze_count() > frozen // 2
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_is_left_as_it_was(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_frozen_before", None)
    gc.freeze()  # as a rank server does before it forks
    try:
        frozen = gc.get_freeze_count()
        with memory.collecting_new_objects_only():
            assert gc.get_freeze_count() <= frozen  # nothing newer was frozen (freed ones leave the count)
        assert frozen // 2 < gc.get_freeze_count() <= frozen  # nor unfrozen
    finally:
        gc.unfreeze()


def test_a_collection_inside_a_planning_block_frees_its_garbage_and_the_next_full_collection_is_not_brought_forward(
        monkeypatch) -> None:
    """CPython (3.11) makes an automatic full collection once the objects promoted since the last
    one exceed a quarter of the objects that one left. A full collection inside the frozen block
    counted only the block's survivors, so the next one came after a few thousand promotions and
    walked the whole heap (0.3 s per rank in the startup benchmark's first decode step)."""
    monkeypatch.setattr(memory, "_frozen_before", None)
    monkeypatch.setattr(memory, "trim_heap", lambda: False)
    threshold = gc.get_threshold()
    full: list[dict[str, int]] = []

    def count_full_collections(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info)

    gc.set_threshold(100, 10, 10)  # a middle collection every 1,000 allocations, full ones due after 10 of them
    gc.collect()  # the count of long-lived objects: this whole process (torch, Dynamo, pytest)
    assert len(gc.get_objects()) > 8 * 20_000  # a quarter of it is more than the 20,000 kept below
    try:
        with memory.collecting_new_objects_only():
            assert gc.get_threshold()[0] == 100 and min(gc.get_threshold()[1:]) > 10**9  # young ones only
            cycle = _Node()
            cycle.other = cycle
            freed = weakref.ref(cycle)
            del cycle
            kept_inside = [[] for _ in range(1_000)]
            release_free_memory(collect=True)
            assert freed() is None  # the block's garbage cycle was collected
        assert gc.get_threshold() == (100, 10, 10)
        gc.callbacks.append(count_full_collections)
        kept_after = [[] for _ in range(20_000)]  # 20 middle collections, ~20,000 objects promoted
        gc.callbacks.remove(count_full_collections)
        assert len(kept_inside) + len(kept_after) == 21_000
        assert full == []
    finally:
        if count_full_collections in gc.callbacks:
            gc.callbacks.remove(count_full_collections)
        gc.set_threshold(*threshold)


def test_full_collections_are_deferred_for_the_outermost_block_and_restored_after_an_error() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError, match="trace failed"), memory.full_collections_deferred():
        deferred = gc.get_threshold()
        assert deferred[:2] == before[:2]  # the young generations are collected as before
        assert deferred[2] > before[2]
        with memory.full_collections_deferred():
            assert gc.get_threshold() == deferred
        assert gc.get_threshold() == deferred  # the inner block leaves it to the outer one
        raise RuntimeError("trace failed")
    assert gc.get_threshold() == before


def test_a_dynamo_compile_runs_with_older_objects_frozen_and_no_automatic_full_collection(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_frozen_before", None)
    seen: list[tuple[int, int]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append((gc.get_freeze_count(), gc.get_threshold()[2]))
        return gm.forward

    threshold = gc.get_threshold()
    torch._dynamo.reset()
    compiled = compat_optimize(lambda x: x * 2 + 1, backend)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    (frozen, full_threshold), = seen
    assert frozen > 0 and full_threshold > threshold[2]
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold


def test_a_call_on_a_fresh_stack_returns_raises_and_keeps_grad_mode_as_a_plain_call() -> None:
    import threading

    def where(x: int) -> tuple[int, bool, bool]:
        return x + 1, threading.current_thread() is threading.main_thread(), torch.is_grad_enabled()

    assert memory.on_a_fresh_stack(where)(1) == (2, False, True)
    with torch.no_grad():
        assert memory.on_a_fresh_stack(where)(1) == (2, False, False)

    def fails() -> None:
        raise ValueError("no plan")

    with pytest.raises(ValueError, match="no plan"):
        memory.on_a_fresh_stack(fails)()


def test_a_call_on_a_fresh_stack_traces_under_the_callers_torch_state() -> None:
    """Inference mode, autocast, Dynamo's tracing context and fake tensors' thread-local permission to
    take a real tensor (the planner's meta constants) are the caller's in the new thread; under
    a Python dispatch mode (a stack only the caller's thread holds) the call stays in the caller's
    thread."""
    import threading

    from torch._guards import TracingContext, tracing
    from torch.utils._python_dispatch import TorchDispatchMode

    def where() -> tuple[bool, bool, bool, torch.dtype, Any, bool]:
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"), TracingContext.try_get(),
                threading.current_thread() is threading.main_thread())

    with torch.inference_mode():
        assert memory.on_a_fresh_stack(where)() == where()[:5] + (False,)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert memory.on_a_fresh_stack(where)() == where()[:5] + (False,)
    context = TracingContext(None)
    with tracing(context):
        assert memory.on_a_fresh_stack(where)()[4] is context
    from autotp.compat import fake_tensor_tls

    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        assert memory.on_a_fresh_stack(lambda: fake_tensor_tls.allow_non_fake_inputs_override)() is True
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = None

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    with Passing():
        assert memory.on_a_fresh_stack(where)()[5] is True
