"""Imported first by the servers ranks are forked from (the CLI's, ``autotp.cli._start_rank_server``,
and the test suite's, ``tests/_dist.py``), and never anywhere else: it changes how its process
collects garbage and exits.

The server imports torch, Dynamo, transformers and autotp, which allocate millions of objects that
live until exit, then only forks. So, as ``autotp plan`` does for its own imports
(``cli._plan_report``): no collection while it imports (the collector would walk the growing heap
again and again), and at each fork what was built is frozen out of the collections of the forked
rank (``gc.freeze``: a rank's compile collects often and would walk the whole import heap each
time), whose collector is on again. When the launching process exits, the server ends with
``os._exit`` instead of the interpreter's teardown of those modules (measured: 1-2 CPU-s, after the
command has finished). A forked rank does not run that exit: multiprocessing ends its processes
with ``os._exit`` of their own, and the fork hook takes it off the rank's exit handlers anyway.

A server that forks many ranks can also fill, once, the per-process caches every rank's first
compile fills for itself (:func:`warm_caches`; the test suite's server does, as its last preload):
pure caches of source text and of torch's op registry, no model is run, so no state of one launch
reaches another. Measured on tp=2 launches of a tiny Llama (parallelize, one forward, an 8-token
generate; 4 launches per server, two alternating runs each, 2-core machine), the ranks' CPU per
launch with the test server's plain preload against the freeze at fork and these caches: 7.8-8.7
-> 6.5-7.4 s at load ~4; 10.2-13.5 -> 7.6-11.9 s at load 9-17 (there, each alone: the freeze
8.6-11.1 s, the caches 8.2-10.4 s). The CLI's server does not: it
forks the ranks of one launch, which at tp <= cores fill their caches in parallel, and a warm
launch traces nothing and would wait ~0.8 s for caches it never reads.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys


def _end_at_once() -> None:
    os._exit(0)


def _in_rank() -> None:
    atexit.unregister(_end_at_once)
    gc.enable()


#: module names (prefixes end with ".") whose functions make the FX nodes of a model's forward when
#: Dynamo traces it: transformers' modeling code, its layers, caches, masks, losses and attention
#: integrations, and the layers of ``torch.nn`` (not ``torch.nn.functional``, whose functions Dynamo
#: puts in the graph whole)
_TRACED_MODULES = ("transformers.models.", "transformers.modeling_utils", "transformers.modeling_layers",
                   "transformers.cache_utils", "transformers.masking_utils", "transformers.activations",
                   "transformers.pytorch_utils", "transformers.integrations.", "transformers.loss.",
                   "torch.nn.modules.")
#: of those, the ones no forward runs (the auto classes' name tables)
_NOT_TRACED = ("transformers.models.auto.",)


def _traced_sources() -> list[str]:
    """The source files of the loaded modules of :data:`_TRACED_MODULES`."""
    files = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and name.startswith(_TRACED_MODULES) and not name.startswith(_NOT_TRACED):
            files.append(file)
    return files


def warm_caches() -> None:
    """What a rank's first compile computes per process and never changes, computed once here for
    every rank forked after: Dynamo's function names per source line of the modeling code
    (``compat.warm_source_names``), ``inspect``'s module-by-file table (Dynamo's package records
    each inlined function's module), transformers' checkpoint conversions by model type
    (``compat.warm_weight_conversions``), autotp's decomposition table. Call after the imports."""
    import inspect

    from autotp.compat import warm_source_names, warm_weight_conversions
    from autotp.passes.decompose import decomposition_table

    warm_source_names(_traced_sources())
    inspect.getmodule(warm_caches)
    warm_weight_conversions()
    decomposition_table()


gc.disable()
os.register_at_fork(before=gc.freeze, after_in_child=_in_rank)
atexit.register(_end_at_once)
