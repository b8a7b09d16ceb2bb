"""Handing freed heap memory back to the operating system at the points where loading peaks.

Why: a rank's peak resident set while ``parallelize_model`` loads is what decides whether a model
fits. Tracing, decomposing and solving a graph allocate ~0.1 GB of Python objects and fake
tensors, and laying out fused weights frees the shards they replace; once those are garbage,
glibc keeps the freed chunks in its heap (resident) unless asked to give them back. The next
allocation burst — Dynamo building guards after the backend returns, the warm-up's activations, a
recompile's decomposition — then lands on top of the shards instead of in pages the process had
already returned. :func:`release_free_memory` collects cycles and calls glibc's
``malloc_trim(0)``, which returns every whole free page of every arena (``madvise``), not only the
top of the heap.

Where it runs (only when a graph did work that leaves garbage, never per call): in
``compile_graph`` after the solver state of a solved graph is dropped — with a full collection
when this rank is about to read shards (the tracing's garbage is cyclic: FX graphs), a trim only
for later graphs (recompiles, decode steps), since a collection walks every live Python object
(~0.9 s in a rank holding the loaded benchmark model) and the automatic collector frees that
garbage eventually; then trims alone in the fuse pass after each group it lays out anew and at the
end of ``parallelize_model``.
Elsewhere than glibc (macOS, musl) only the collection runs. The planning itself (decompose,
solve), like every Dynamo compile of the model, runs under :func:`collecting_new_objects_only`,
so the collector's collections there walk neither the loaded model nor the imported libraries
(and the collection before the shard reads is then a young one, which there is as thorough);
work that allocates many long-lived objects and no garbage cycles (the solver's search,
installing and lowering stored graphs) runs with the collector paused
(:func:`cycle_collection_paused`).

One allocation burst is not the model's at all: after a backend returns, Dynamo measures how long
the new graph's guards take to check (``torch._dynamo.guards.profile_guard_manager``, for its
compile-time metrics), and first evicts the CPU caches by writing a fresh buffer of about 32 MB
(measured: +26 to +32 MB of peak per compiled graph, on top of the shards).
:func:`autotp.compat.no_guard_latency_profile` (it patches a private Dynamo name) skips that measurement while autotp's compiled model runs (the
metric ``guard_latency_us`` reads 0 for those graphs; guards are built and checked as before).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def trim_heap() -> bool:
    """``malloc_trim(0)`` where the C library has it (glibc); True if it returned memory."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def release_free_memory(collect: bool = True) -> bool:
    """Collect garbage cycles (unless ``collect`` is False: a full collection walks every Python
    object, ~0.9 s in a rank holding a loaded 150M model), then return the heap's free pages to
    the OS; True if any were. Inside a :func:`collecting_new_objects_only` block the collection is
    of the young generations, which there hold every object the collector walks (see that block)."""
    if collect:
        gc.collect(_YOUNG_GENERATIONS if _open_blocks else _OLDEST)
    return trim_heap()


#: whether this process had frozen objects itself when autotp first looked (None: not looked yet)
_frozen_before: bool | None = None
#: how many :func:`collecting_new_objects_only` blocks are open (only the outermost freezes)
_open_blocks = 0


def _process_froze_objects() -> bool:
    """Had this process frozen objects itself (``gc.freeze``: the rank servers do at each fork,
    the CLI after its imports) when this was first asked? Asked once per process and remembered
    (a forked rank inherits the answer with the frozen heap): ``gc.get_freeze_count`` walks the
    whole permanent generation, ~0.2 CPU-s per call in a rank forked from a server that froze
    ~750,000 objects (profiled), and planning asks once per graph."""
    global _frozen_before
    if _frozen_before is None:
        _frozen_before = gc.get_freeze_count() > 0
    return _frozen_before


@contextlib.contextmanager
def collecting_new_objects_only() -> Iterator[None]:
    """Within the block, the cyclic collector walks only the objects made inside it (``gc.freeze``
    moves every older one to the permanent generation; ``gc.unfreeze`` puts them back after), and
    only in young collections: the block's objects are not promoted to the oldest generation
    (the middle and oldest thresholds are out of reach; the young one is as before), so an
    explicit collection inside, :func:`release_free_memory`'s or Dynamo's own after each compile
    (``gc.collect(1)``), walks them all and frees all their garbage.

    Why: planning a graph (decompose, solve) allocates enough to trigger the collector's full
    (oldest-generation) collections, each of which walks every live Python object, the loaded
    model and Dynamo's state included: two such collections, 0.33 and 0.53 CPU s, during the
    benchmark model's two plans (rank 0, loaded machine), for garbage that is the planning's own.
    Why young collections only: CPython (3.11) makes an automatic full collection only once the
    objects promoted since the last one exceed a quarter of the objects that one left, and a full
    collection inside the block counts only the block's survivors; after the block the next one
    then came at once and walked the whole heap: in the startup benchmark's first decode step,
    0.28-0.33 s on each rank (``gc.callbacks``, 10-s launches). With the block's collections young,
    the count stays the one the last full collection outside left: that walk is gone, the decode
    graph's trace garbage (~65,000 objects) is freed by Dynamo's own young collection after its
    compile (0.06 s), and the greedy generate took 2.15 s instead of 2.42 (medians of six
    alternating launches each).
    Safe: nothing changes but what a collection visits and when. The block's garbage that
    outlives a young collection waits for an explicit collection inside or for the first middle
    collection after the block (the middle collections that came every ten young ones inside do
    not run): peak RSS unchanged on the startup benchmark (852 against 851 MB on rank 0, medians of
    ten cold launches) and on ``plan_model`` of Llama-3-70B's widths at tp=8 (491-494 against 495
    MB). Garbage older than the block (unreachable before it began) waits for the first full
    collection after it. A process that had frozen objects itself when first asked
    (:func:`_process_froze_objects`) is left alone (nothing is frozen or unfrozen then, no
    threshold changed); one that freezes objects only later gets them unfrozen at the end of a
    block, which changes what later collections walk, never what they free. Nested blocks leave it
    to the outermost; the thresholds are put back after it."""
    global _open_blocks
    if _open_blocks or _process_froze_objects():
        yield
        return
    _open_blocks += 1
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold[0], _NEVER, _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
        _open_blocks -= 1


#: a threshold of the middle or oldest generation that the collector's count never reaches (a C int)
_NEVER = 2**31 - 1
#: ``gc.collect`` arguments: the young and middle generations; every generation
_YOUNG_GENERATIONS, _OLDEST = 1, 2


@contextlib.contextmanager
def full_collections_deferred() -> Iterator[None]:
    """Within the block the cyclic collector makes no automatic full (oldest-generation)
    collection; the young generations are collected as before, so short-lived cycles are freed as
    they would be. The threshold is put back after the block (the next full collection then comes
    when it is due), an explicit ``gc.collect()`` inside still runs. Nested blocks leave it to the
    outermost."""
    t0, t1, t2 = gc.get_threshold()
    if t2 == _NEVER:
        yield
        return
    gc.set_threshold(t0, t1, _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(t0, t1, t2)


@contextlib.contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Within the block Python's cyclic garbage collector does not run; it resumes after the block
    (where it was on), so cycles made inside are collected later, and nested blocks leave it to the
    outermost. Reference counting still frees every dropped object.

    For work that allocates many objects forming no garbage cycles, where every collection the
    allocations trigger scans the whole heap (torch, transformers, Dynamo, the model) for nothing:
    the solver's search (millions of states, each pointing back to its parents only: the passes
    took ~25% of the solve on 8 layers of Gemma-2-9B's widths), installing a stored package (its
    guard states) and unpickling and lowering a stored graph (~10^5 objects that live on, in a
    process of ~400,000 tracked objects: on the 150m benchmark model one full collection in the
    guard states and one in the plan-cache entry's decoding, ~0.25 CPU s each)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def on_a_fresh_stack(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run, when called, in a new thread that the caller waits for: its frames start at the
    bottom of an empty Python stack instead of under the caller's (``fn``'s result is returned, its
    exception raised). The thread enters the caller's torch state (``compat.thread_state``: grad
    and inference mode, autocast, Dynamo's tracing context), so what ``fn`` traces is what the
    caller would trace; where that state cannot be carried (a Python dispatch mode is active) ``fn``
    runs in the caller's thread.

    Why: CPython 3.11 keeps a thread's frames in a stack of 16 KB chunks, each ``mmap``-ed when a
    call does not fit the current one and ``munmap``-ed when that call returns, so a hot loop whose
    calls straddle a chunk boundary maps, faults in and unmaps a chunk per call. Where that happens
    depends on how deep the loop runs, and planning runs under Dynamo's trace of the whole model
    (hundreds of frames): on the 150m startup benchmark's prefill one depth of the solver's search
    cost ~590,000 ``mmap``/``munmap`` pairs and ~1.3 million page faults (strace, ``getrusage``),
    4-11 CPU s of system time in a solve of ~2 s, and adding one to three frames above ``solve``
    moved it to 288,000 / 54,000 / 19,000 faults: any change of the callers' depth (a wrapper,
    another Python version of a caller) turned it on or off. Decomposing that prefill likewise
    took ~83,000 faults and 0.6-0.9 s of system time at one depth, ~3,300 faults on a fresh stack.
    On a fresh stack the work's depth is its own."""

    def run(*args: Any, **kwargs: Any) -> T:
        import threading

        from autotp.compat import thread_state

        state = thread_state()
        if state is None:
            return fn(*args, **kwargs)
        out: list[Any] = []

        def target() -> None:
            try:
                with state():
                    out.append((True, fn(*args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                out.append((False, e))

        thread = threading.Thread(target=target, name=f"autotp-{getattr(fn, '__name__', 'call')}", daemon=True)
        thread.start()
        thread.join()
        ok, value = out[0]
        if not ok:
            raise value
        return value

    return run
