"""One rank traces, the others install its frames: shared Dynamo frames within a launch.

In a cold launch every rank ran Dynamo's trace of every graph (fake-tensor propagation, variable
building, guards), the same work N times: ~57% of rank 0's CPU and ~85% of the others' (tiny Llama,
tp=2). Where the ranks have a core each that is free; where they share cores, the followers' traces
compete with the one the launch waits for. With sharing on, one rank (the tracer: the last, the
one that records the stored-graph package, ``autotp/stored_graphs.py``) traces; the others install
what it compiled, frame by frame, in the same launch.

**Protocol.** Every rank compiles the same frames in the same order (same code, same guards), so
each call of Dynamo's frame callback (a cache miss) on the tracer has its twin on every follower.
The tracer's callback (``compat._publishing_callback``) runs Dynamo's and then broadcasts one
message naming the frame: its :class:`~autotp.compat.FrameEntry` (its package entry: the
transformed bytecode, the guard state, the compiled functions' names) with the pickled graphs not
sent before, a :class:`~autotp.compat.FrameSkip` where Dynamo compiled no code for it (what its
callback returned), or None; and the tracer's Dynamo code state changed since the last message
(the input sizes per code from which a recompile marks dims dynamic: a follower that installs
updates none of its own). The followers' callback (``compat._receiving_callback``) waits in that
broadcast, checks that the frame is its own, and installs the entry (the globals in place, each
graph a :class:`StoredGraph`, the guard state loaded into a guard manager on its own frame) or
returns the skip, as Dynamo's callback would, tracing nothing. The tracer runs the frame installed
from the same entry too (Dynamo's cleanup of the globals it installed moved to that code), so
every rank's guards are loaded from the same state with the same markings: a live guard that
failed where a follower's loaded one passed (a cache hit on one rank, a compile on the other)
hung a generating model. Installing runs no Python frame of autotp's (the eval-frame hook would
call back on it on that rank only). The tracer's backend does
not lower while tracing (the followers are in the broadcast, not in the plan broadcast): it
returns the :class:`StoredGraph` unlowered, and every rank lowers it on its first call, after the
callback, where rank 0 plans and broadcasts as on any compile.

**Failures: sharing stops, at the same frame on every rank.** After each entry the group agrees
(one all-reduce) that every follower installed it. Where the tracer publishes None (Dynamo raised,
its package cannot hold the frame, a graph does not pickle: that one is lowered while tracing,
after publishing) or a follower's install failed (it says why in ``stored_graphs``), every rank
stops sharing for this compiled forward and compiles this frame and all later ones itself, as
without sharing: no frame is exchanged any more, so no rank can wait for one. The tracer's message
says why it shared none; every rank notes the stop with the frames shared before and logs it
(:data:`log`, INFO). A follower whose
frame is not the one the tracer published (the ranks' frames diverged: a frame that runs on some
ranks only) raises an :class:`AutoTPError` saying to turn sharing off, instead of pairing the wrong
frames; a rank that dies is noticed in the broadcast as in any collective.

**Gate: on where this host's ranks outnumber its cores.** ``AutoTPConfig.trace_once``
(``parallelize_model(trace_once=...)``) or ``AUTOTP_TRACE_ONCE=1/0`` decide where set; else
:func:`trace_once_default` turns sharing on where this host's ranks (``LOCAL_WORLD_SIZE``, else the
group) outnumber the cores this process may run on (``os.sched_getaffinity``). Shipping the frames
adds to the cold launch's critical path (the tracer's pickling, the broadcast, the followers'
install), so sharing pays only where the followers' traces took cores from the tracer's (tp=4 on
two cores: 39.8 / 36.9 -> 29.9 / 34.0 s; tp=2 on two cores: 23.2 / 20.4 -> 20.9 / 21.1 s, a wash;
docs/architecture.md, "Shared frames"). The tracer's choice is broadcast so that every rank
agrees. The test suite's harness turns it on (``tests/_dist.py``). Only with the cache on: the
package and graph pickling are the stored-graph machinery's. Not under FSDP2
(``data_parallel="fsdp"``): installed guards name the model's plain class where FSDP2 swapped it,
so every call recompiled up to Dynamo's limit; its ranks trace their own. DDP shares.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Mapping
from typing import Any

from autotp.collectives import Comm, all_ranks, broadcast_object
from autotp.compat import (
    PICKLE_REFUSALS,
    FrameEntry,
    FrameSkip,
    PackageError,
    apply_code_state,
    code_state_changes,
)
from autotp.config import switch
from autotp.errors import AutoTPError
from autotp.host import local_ranks, usable_cores

__all__ = ["FrameChannel", "ranks_outnumber_cores", "trace_once_agreed", "trace_once_default"]

#: where sharing stopping is logged (INFO: which frame, why, how many frames were shared before)
log = logging.getLogger(__name__)

def trace_once_default(option: bool | None, environ: Mapping[str, str], world_size: int) -> bool:
    """This rank's wish: ``option`` if set, else ``AUTOTP_TRACE_ONCE``, else whether this host's
    ranks outnumber its cores (:func:`ranks_outnumber_cores`; the module docstring, Gate)."""
    return bool(switch(option, environ, "AUTOTP_TRACE_ONCE", default=ranks_outnumber_cores(environ, world_size)))


def ranks_outnumber_cores(environ: Mapping[str, str], world_size: int) -> bool:
    """Whether this host runs more ranks than there are cores this process may run on
    (``autotp/host.py``): then every rank's own trace of a frame competes with the one the launch
    waits for."""
    return local_ranks(environ, world_size) > usable_cores()


def trace_once_agreed(wish: bool, comm: Comm, tracer: int) -> bool:
    """The tracer's wish, on every rank (collective)."""
    return bool(broadcast_object(wish, comm, src=tracer))


class FrameChannel:
    """The :class:`autotp.compat.FrameShare` of one compiled forward: the tracer (``comm`` rank
    ``src``) broadcasts each frame with its new graphs, the followers receive them as
    :class:`StoredGraph` s of ``session``. ``graphs`` (tracer): the forward's stored graphs by
    compiled function name; ``notes``: where a follower says why a frame did not install, and
    where sharing stopped.

    A message is ``(name, item, code_state, why)``: the frame the tracer is in, what the followers
    do with it (``(FrameEntry, new graphs)``, a :class:`FrameSkip`, or None: not shared, ``why``
    says why) and the tracer's Dynamo code state changed since the last message
    (:func:`compat.code_state_changes`). After a None, or a :class:`FrameEntry` that did not
    install on some follower (the group agrees in one all-reduce after each), :attr:`active` is
    False on every rank, at the same frame; each rank notes it with the counts below and logs it
    (:data:`log`)."""

    def __init__(self, comm: Comm, src: int, session: Any, graph_type: type, notes: list[str]) -> None:
        self.comm = comm
        self.src = src
        self.tracer = comm.rank == src
        self.active = True
        self.session = session
        self.graph_type = graph_type
        self.notes = notes
        self.graphs: Callable[[], dict[str, Any]] = dict
        self._owed: tuple[str, str, int] | None = None
        self._why = ""  # why the owed frame is not shared (tracer)
        self._sent: set[str] = set()
        self._new: dict[str, Any] = {}  # the graphs of the prepared entry the followers have not had
        self._code_state: dict[Any, Any] = {}
        self._received_name = ("", "", 0)
        self.received: dict[str, Any] = {}
        self.markings: dict[str, dict[str, Any]] = {}
        #: frames installed from the tracer (on the tracer: installed on every rank), frames whose
        #: skip was taken from it (published), frames not shared (the tracer published none, or
        #: one did not install here) while sharing was on
        self.installed_count = 0
        self.skipped = 0
        self.compiled_here = 0

    def begin(self, name: tuple[str, str, int]) -> None:
        self._owed, self._why = name, ""

    def prepare(self, entry: FrameEntry) -> tuple[FrameEntry, dict[str, Any], dict[str, dict[str, Any]]]:
        graphs = self.graphs()
        new = {}
        for graph_name in entry.backend_ids():
            g = graphs.get(graph_name)
            if not isinstance(g, self.graph_type):  # lowered while tracing: the others trace too
                raise PackageError(f"its graph {graph_name} does not pickle")
            if graph_name not in self._sent:
                new[graph_name] = (g.data, g.markings)
        self._new = new
        for graph_name in new:
            for source, m in graphs[graph_name].markings.items():
                self.markings.setdefault(source, {}).update(m)
        return entry, graphs, self.markings

    def not_shared(self, why: str) -> None:
        self._why = why

    def publish(self, item: FrameEntry | FrameSkip | None) -> None:
        if self._owed is None:
            return
        name, self._owed = self._owed, None
        message: Any = (item, self._new) if isinstance(item, FrameEntry) else item
        why = self._why or "its callback was left"
        code_state = code_state_changes(self._code_state)
        try:  # pickled here, so that an entry pickle refuses is published as None, not a failed rank
            data = pickle.dumps((name, message, code_state, why))
        except PICKLE_REFUSALS as e:
            # output_hidden_states=True on a tiny Llama after a plain call: "cannot pickle 'module' object"
            message, why = None, f"its entry does not pickle ({type(e).__name__}: {e})"
            data = pickle.dumps((name, message, code_state, why))
        broadcast_object(data, self.comm, src=self.src)
        if message is None:
            self.compiled_here += 1
            self._stop(f"the tracing rank could not share {_where(name)} ({why})")
        elif isinstance(item, FrameEntry):
            self._sent.update(self._new)
            if not all_ranks(True, self.comm):
                self._stop(f"a rank could not install the tracing rank's frame {_where(name)}")
            else:
                self.installed_count += 1
        else:
            self.skipped += 1

    def receive(self, name: tuple[str, str, int]) -> tuple[FrameEntry, dict[str, Any], dict[str, dict[str, Any]]] \
            | FrameSkip | None:
        published, message, code_state, why = pickle.loads(broadcast_object(None, self.comm, src=self.src))
        if published != name:
            self.active = False
            raise AutoTPError(
                f"autotp: the tracing rank compiled {_where(published)} where this rank compiles {_where(name)}: "
                "the ranks' frames diverged (a frame that runs on some ranks only, such as a finalizer of model "
                "code). Set AUTOTP_TRACE_ONCE=0 (or parallelize_model(trace_once=False)) so that every rank "
                "traces its own frames.")
        apply_code_state(code_state)
        self._received_name = name
        if message is None:
            self.compiled_here += 1
            self._stop(f"the tracing rank could not share {_where(name)} ({why})")
            return None
        if isinstance(message, FrameSkip):
            self.skipped += 1
            return message
        entry, new = message
        for graph_name, (data, marks) in new.items():
            self.received[graph_name] = self.graph_type(data, marks, self.session)
            for source, m in marks.items():
                self.markings.setdefault(source, {}).update(m)
        return entry, self.received, self.markings

    def installed(self, error: Exception | None) -> None:
        if error is None:
            self.installed_count += 1
        else:
            self.compiled_here += 1
            self.notes.append(f"a frame the tracing rank compiled did not install here "
                              f"({type(error).__name__}: {error})")
        if not all_ranks(error is None, self.comm):
            self._stop(f"a rank could not install the tracing rank's frame {_where(self._received_name)}")

    def _stop(self, why: str) -> None:
        """Every rank traces its own frames from here on (each rank calls this at the same frame)."""
        self.active = False
        note = (f"frames no longer shared: {why}; every rank traces its own (shared before: "
                f"{self.installed_count} installed, {self.skipped} skipped)")
        self.notes.append(note)
        log.info("autotp rank %d: %s", self.comm.rank, note)


def _where(name: tuple[str, str, int]) -> str:
    function, filename, line = name
    return f"{function} ({filename}:{line})"


