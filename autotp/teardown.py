"""A rank's exit without the interpreter's final walks over the heap (``gc.freeze`` at exit).

Why: when a Python process ends, the interpreter clears every module and collects reference
cycles over every object still alive. A rank that imported torch, Dynamo and transformers and
compiled a model holds ~520,000-530,000 objects the collector tracks (Dynamo's traced frames and
guards, FX graphs, sympy expressions: each rank of the 150m benchmark job, ``benchmarks/startup.py
--tp 2``, 2-core machine), and there each rank's last ``atexit`` handler came 1.9-2.3 s before the
launcher saw the rank end; with the heap frozen at exit 0.33-0.37 s, and the whole job (launch to
exit) 19.6 / 19.6 -> 16.9 / 17.0 s (two alternating pairs, the freeze put in the ranks by a probe,
load 0.7-1.6). The ``autotp`` command already ends its processes with ``os._exit`` (``cli.run``);
a user's ``torchrun`` script cannot.

How: :func:`freeze_at_exit` registers an ``atexit`` handler that calls ``gc.freeze()``, which
moves every object alive at that moment to the collector's permanent generation, which no
collection walks, the final ones included; objects made later (by handlers that run after it)
are collected as usual. Nothing else of the teardown changes: every ``atexit`` handler still runs
(``weakref.finalize`` callbacks, torch's and the user's), the standard streams are flushed, and
an object whose last reference goes away is freed as before.

What it gives up: an object alive at exit that is part of a reference cycle is not finalized
(its ``__del__`` or weakref callbacks do not run) unless something else does it; Python does not
promise that for objects alive at exit either ("It is not guaranteed that ``__del__()`` methods are
called for objects that still exist when the interpreter exits", the data model's reference), but
the interpreter does it today. ``AUTOTP_FAST_EXIT=0`` keeps the full teardown. The session
installs the handler (``parallelize_model``) and removes it when the model is released
(``TPContext.close``), so it holds only while an autotp model is alive.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable, Mapping

from autotp.config import switch

__all__ = ["freeze_at_exit"]

#: the environment variable that turns the fast exit off (0) or on (1); on by default
FAST_EXIT = "AUTOTP_FAST_EXIT"


def freeze_at_exit(environ: Mapping[str, str]) -> Callable[[], None] | None:
    """Register ``gc.freeze`` as an ``atexit`` handler unless ``AUTOTP_FAST_EXIT`` says 0; return
    what unregisters it (None where nothing was registered)."""
    if not switch(None, environ, FAST_EXIT, default=True):
        return None

    def handler() -> None:  # a function object per session: unregistering removes this session's only
        gc.freeze()

    atexit.register(handler)
    return lambda: atexit.unregister(handler)
