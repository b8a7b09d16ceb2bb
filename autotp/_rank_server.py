"""Imported first by the server the CLI's ranks are forked from (``autotp.cli._start_rank_server``),
and never anywhere else: it changes how its process collects garbage and exits.

The server imports torch, Dynamo, transformers and autotp, which allocate millions of objects that
live until exit, then only forks. So, as ``autotp plan`` does for its own imports
(``cli._plan_report``): no collection while it imports (the collector would walk the growing heap
again and again), and at each fork what was built is frozen out of the collections of the forked
rank (``gc.freeze``: a rank's compile collects often and would walk the whole import heap each
time), whose collector is on again. When the launching process exits, the server ends with
``os._exit`` instead of the interpreter's teardown of those modules (measured: 1-2 CPU-s, after the
command has finished). A forked rank does not run that exit: multiprocessing ends its processes
with ``os._exit`` of their own, and the fork hook takes it off the rank's exit handlers anyway.
"""

from __future__ import annotations

import atexit
import gc
import os


def _end_at_once() -> None:
    os._exit(0)


def _in_rank() -> None:
    atexit.unregister(_end_at_once)
    gc.enable()


gc.disable()
os.register_at_fork(before=gc.freeze, after_in_child=_in_rank)
atexit.register(_end_at_once)
