"""One rank traces, the others install its frames: shared Dynamo frames within a launch.

In a cold launch every rank ran Dynamo's trace of every graph (fake-tensor propagation, variable
building, guards), the same work N times: ~57% of rank 0's CPU and ~85% of the others' (tiny Llama,
tp=2). Where the ranks have a core each that is free; where they share cores, the followers' traces
compete with the one the launch waits for. With sharing on, one rank (the tracer: the last, the
one that records the stored-graph package, ``autotp/stored_graphs.py``) traces; the others install
what it compiled, frame by frame, in the same launch.

**Protocol.** Every rank compiles the same frames in the same order (same code, same guards), so
each call of Dynamo's frame callback (a cache miss) on the tracer has its twin on every follower.
The tracer's callback (``compat._publishing_callback``) runs Dynamo's and then broadcasts the
frame's :class:`~autotp.compat.FrameEntry` (its package entry: the transformed bytecode, the guard
state, the compiled functions' names) with the pickled graphs not sent before; the followers'
callback (``compat._receiving_callback``) waits in that broadcast, loads the guard state into a
guard manager on its own frame, puts the globals in place (each graph a :class:`StoredGraph`) and
returns the guarded code as Dynamo's callback would. The tracer's backend does not lower while
tracing (the followers are in the broadcast, not in the plan broadcast): it returns the
:class:`StoredGraph` unlowered, and every rank lowers it on its first call, after the callback,
where rank 0 plans and broadcasts as on any compile.

**Failures.** The tracer publishes exactly once per callback, also when Dynamo raised or compiled
no code for the frame, or its package cannot hold it (``PackageError``): then it publishes None
and each follower compiles that frame itself (Dynamo's own callback), as without sharing. A graph
that does not pickle is lowered while tracing: the tracer publishes None first. A follower whose
install fails compiles the frame itself and notes why in ``stored_graphs`` (its trace still meets
the tracer's graph at the same plan broadcast, since both lower before any other collective). No
rank waits on another's install, so no agreement round is needed; a rank that dies is noticed in
the broadcast as in any collective.

**Gate: opt-in for now.** A follower that compiles a frame itself after installing the tracer's
(gradient checkpointing: the tracer publishes None for a frame after a graph break) hung in
``tests/distributed/test_gradient_checkpointing.py`` (after fixing what it failed on first: the
compile id, ``orig_code_map``, the builtins-dict and resume-function names, the resume functions'
module aliases). Until that works, sharing is off unless asked for. The intended gate: shipping the frames adds to the cold launch's critical path (the tracer's pickling, the
broadcast, the followers' install), so sharing pays only where the followers' traces took cores
from the tracer's: on by default where this host's ranks (``LOCAL_WORLD_SIZE``, else the group)
outnumber the cores this process may run on (``os.sched_getaffinity``). ``AutoTPConfig.trace_once``
(``parallelize_model(trace_once=...)``) or ``AUTOTP_TRACE_ONCE=1/0`` forces it; the tracer's choice
is broadcast so that every rank agrees. Only with the cache on: the package and graph pickling are
the stored-graph machinery's. Not for a data-parallel model (``mesh=`` with ``data_parallel=``):
a 2x2 mesh training under FSDP2 with sharing hung after loading (not diagnosed), so its ranks trace
their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from autotp.collectives import Comm, broadcast_object
from autotp.compat import FrameEntry

__all__ = ["FrameChannel", "available_cores", "trace_once_agreed", "trace_once_default"]

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def trace_once_default(option: bool | None, environ: Mapping[str, str], group_size: int, cores: int) -> bool:
    """This rank's wish: ``option`` if set, else ``AUTOTP_TRACE_ONCE``, else off. (The intended
    default, where this host's ranks outnumber ``cores``, is not on: see the module docstring.)"""
    if option is not None:
        return bool(option)
    env = environ.get("AUTOTP_TRACE_ONCE", "").strip().lower()
    if env in _ON:
        return True
    if env in _OFF:
        return False
    return False  # see the module docstring (Gate): not on by default until a follower that
    # compiles a frame itself after installing others works (a graph-breaking model hangs there)


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def trace_once_agreed(wish: bool, comm: Comm, tracer: int) -> bool:
    """The tracer's wish, on every rank (collective)."""
    return bool(broadcast_object(wish, comm, src=tracer))


class FrameChannel:
    """The :class:`autotp.compat.FrameShare` of one compiled forward: the tracer (``comm`` rank
    ``src``) broadcasts each frame with its new graphs, the followers receive them as
    :class:`StoredGraph` s of ``session``. ``graphs`` (tracer): the package's graphs by compiled
    function name; ``notes``: where a follower says why a frame did not install."""

    def __init__(self, comm: Comm, src: int, session: Any, graph_type: type, notes: list[str]) -> None:
        self.comm = comm
        self.src = src
        self.tracer = comm.rank == src
        self.session = session
        self.graph_type = graph_type
        self.notes = notes
        self.graphs: Callable[[], dict[str, Any]] = dict
        self._owed = False
        self._sent: set[str] = set()
        self.received: dict[str, Any] = {}
        self.markings: dict[str, dict[str, Any]] = {}
        #: frames installed from the tracer, frames compiled here after the tracer published none
        self.installed = 0
        self.compiled_here = 0

    def begin(self) -> None:
        self._owed = True

    def publish(self, entry: FrameEntry | None) -> None:
        if not self._owed:
            return
        self._owed = False
        message = None
        if entry is not None:
            graphs = self.graphs()
            new = {}
            for name in entry.backend_ids():
                g = graphs.get(name)
                if not isinstance(g, self.graph_type):  # lowered while tracing: the others trace too
                    new = None
                    break
                if name not in self._sent:
                    new[name] = (g.data, g.markings)
            if new is not None:
                message = (entry, new)
                self._sent.update(new)
        broadcast_object(message, self.comm, src=self.src)

    def receive(self) -> tuple[FrameEntry, dict[str, Any], dict[str, dict[str, Any]]] | None:
        message = broadcast_object(None, self.comm, src=self.src)
        if message is None:
            self.compiled_here += 1
            return None
        entry, new = message
        for name, (data, marks) in new.items():
            self.received[name] = self.graph_type(data, marks, self.session)
            for source, m in marks.items():
                self.markings.setdefault(source, {}).update(m)
        self.installed += 1
        return entry, self.received, self.markings

    def failed(self, error: Exception) -> None:
        self.installed -= 1
        self.compiled_here += 1
        self.notes.append(f"a frame the tracing rank compiled did not install here ({type(error).__name__}: {error})")
