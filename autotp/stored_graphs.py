"""Stored graphs: a warm launch of ``parallelize_model`` runs the graphs Dynamo captured in an
earlier launch without tracing the model again.

With a plan-cache hit, most of a graph's compile was Dynamo's own trace (fake-tensor propagation,
variable building, guards: ~80% on the 150m benchmark model), which the plan cache cannot skip
since it keys on the traced graph. Dynamo's precompile package (``torch._dynamo.package``,
reached through :class:`autotp.compat.DynamoPackage`) records, per compiled frame, the
transformed bytecode, the guards and the name of each graph's compiled function. This module
stores that package with each graph as the backend received it, and a later launch installs them:
the first call that passes a stored frame's guards runs its bytecode, which calls the stored graph.

**What is stored is the Dynamo graph, not the lowered code.** The per-rank code binds this
process's shards and process group, which do not outlive it. Each graph is pickled before the
passes edit it (``compat.pickle_graph``: fake example values and symbolic sizes kept) together with
the dim markings its inputs carried. A :class:`StoredGraph` lowers on its first call in a session:
the graph is unpickled and compiled by ``backend.compile_graph`` with the call's own arguments as
example inputs, so the plan cache, rank 0's plan broadcast, the shard reads and the trace work as on
a traced compile (the plan cache's entry is a hit: the unpickled graph keys as the traced one did).
The session is the one that placed the parameters among the arguments, so two models of one class in
a process each lower their own.

**Guards.** Dynamo's guards are stored without the ones its guard state cannot hold (object
identities, globals; ``compat._serializable_guards``); the model's class, its config constants and
every input's type, size, stride and dtype stay guarded. A call no stored frame accepts (another
shape, dtype, cache state) is traced and compiled as without stored graphs, and the new graph
joins the entry.

**Key.** SHA-256 of canonical JSON: this entry format, the versions the plan cache keys on
(autotp's source digest, torch, transformers, Python), the model's class and config, every
plan-affecting option (``backend.plan_options``), the world size and the device type.

**Trust.** One file per key, ``<cache dir>/graphs/<sha256 of the key>.pkl``: a pickle of
``{"format", "key", "payload", "checksum"}`` with the payload as bytes and the checksum SHA-256
over the canonical key and the payload. It is used only if it unpickles, has this format, matches
its checksum and carries exactly the expected key, and if its package installs (torch refuses a
package whose inlined sources changed); otherwise the launch compiles as without it, the outcome
says why (``no entry``, ``corrupt entry (...)``, ``stale entry (...)``, ``entry of another ...``,
``entry does not install (...)``), and the entry is rewritten. The payload is a pickle (Dynamo's
package is pickled by torch too): only a cache folder the user trusts should be used, as for any
pickle. Writes go to a unique temporary file in the same folder and ``os.replace`` it, so readers
see whole entries and concurrent writers all succeed. One rank (the last) writes, after each call that
compiled a new graph. ``AUTOTP_CACHE=0`` turns stored graphs off with the plan cache.

**Within a launch.** Where the group shares traced frames (``autotp/shared_frames.py``), the
writing rank is the one that traces: its backend returns each :class:`StoredGraph` unlowered (it
lowers on its first call, as the others' copies do), and the others install its frames as they
are compiled.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autotp import cache_env
from autotp.compat import (
    PICKLE_REFUSALS,
    DynamoCompiled,
    DynamoPackage,
    PackageError,
    dim_markings,
    pickle_graph,
    source_of,
    unpickle_graph,
)
from autotp.errors import AutoTPError
from autotp.memory import cycle_collection_paused
from autotp.passes.inline import inline_subgraphs
from autotp.trace import write_json

__all__ = ["FORMAT", "GraphStore", "StoredForward", "StoredGraph", "graph_key", "storing_backend"]

FORMAT = 2


@dataclass
class StoredOutcome:
    """What became of one model's stored graphs: ``status`` hit (the entry installed), miss (no
    usable entry: ``reason``) or off; the entry's file name; how many graphs it held and how long
    reading and installing took; whether this process wrote the entry (``stored``: graphs count)."""

    status: str
    reason: str | None = None
    entry: str | None = None
    graphs: int = 0
    load_s: float = 0.0
    stored: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "entry": self.entry, "graphs": self.graphs,
                "load_s": self.load_s, "stored": self.stored, "notes": list(self.notes)}


def graph_key(module: torch.nn.Module, options: dict[str, Any], world_size: int, device: torch.device) -> dict[str, Any]:
    """The fields an entry is keyed on (see the module docstring)."""
    config = getattr(module, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {"repr": repr(config)}
    fields.pop("_name_or_path", None)  # where the checkpoint lies changes no graph
    config_json = _canonical(fields)
    return {"format": FORMAT, "versions": cache_env.versions(),
            "model": f"{type(module).__module__}.{type(module).__qualname__}",
            "config": hashlib.sha256(config_json.encode()).hexdigest(), "options": options,
            "world_size": world_size, "device": torch.device(device).type}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)


def _checksum(key: dict[str, Any], payload: bytes) -> str:
    return hashlib.sha256(_canonical(key).encode() + b"\0" + payload).hexdigest()


class StoredGraph:
    """What the backend returns for a graph of a session with stored graphs, and what an installed
    entry calls: one Dynamo graph (pickled before lowering, with its inputs' dim markings) and, per
    session that called it, that session's lowered code."""

    def __init__(self, data: bytes, markings: dict[str, dict[str, Any]], session: Any = None,
                 run: Callable[..., Any] | None = None) -> None:
        self.data = data
        self.markings = markings
        #: the session whose package installed this graph: it lowers a graph that reads no parameter
        self.owner = session
        self._runs: dict[int, tuple[Any, Callable[..., Any]]] = {}
        if run is not None:
            self._runs[id(session)] = (session, run)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> StoredGraph:
        """``gm`` as Dynamo gave it to the backend (call before the passes edit it)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        markings = {}
        for ph, value in zip(placeholders, example_inputs, strict=True):
            source = source_of(ph)
            marks = dim_markings(value) if isinstance(value, torch.Tensor) else {}
            if source is not None and marks:
                markings[source] = marks
        return cls(pickle_graph(gm), markings)

    def bind(self, session: Any, run: Callable[..., Any]) -> StoredGraph:
        """``run`` is this graph's code for ``session`` (compiled as Dynamo traced it)."""
        self.owner = self.owner if self.owner is not None else session
        self._runs[id(session)] = (session, run)
        return self

    def __call__(self, *args: Any) -> Any:
        session = _session_of(args, self.owner)
        found = self._runs.get(id(session))
        if found is None:
            from autotp.backend import compile_graph

            with cycle_collection_paused():
                run = compile_graph(unpickle_graph(self.data), list(args), session)
            found = self._runs[id(session)] = (session, run)
        return found[1](*args)


def _session_of(args: tuple[Any, ...], owner: Any) -> Any:
    """The session that placed the parameters among a graph's arguments; for a graph that reads
    none, ``owner``."""
    from autotp.context import meta_of

    for a in args:
        meta = meta_of(a) if isinstance(a, torch.Tensor) else None
        if meta is not None and meta.session is not None:
            return meta.session
    if owner is None:
        raise AutoTPError("a stored autotp graph was called with no parameter placed by parallelize_model. Set "
                          "AUTOTP_CACHE=0 to compile without stored graphs.")
    return owner


class GraphStore:
    """One model's stored-graph entry: where it lives (``root``: the cache folder; None: off), its
    key, reading and writing it, and the :class:`StoredOutcome`."""

    def __init__(self, root: Path | None, key: dict[str, Any]) -> None:
        self.root = root
        self.key = key
        self.digest = hashlib.sha256(_canonical(key).encode()).hexdigest()
        self.outcome = StoredOutcome("off", "AUTOTP_CACHE=0") if root is None else StoredOutcome("miss")
        self._writable = True

    @property
    def path(self) -> Path:
        assert self.root is not None
        return self.root / "graphs" / f"{self.digest}.pkl"

    def read(self) -> dict[str, Any] | None:
        """The entry's payload (``{"entry", "aliases", "graphs"}``), or None with the reason in the outcome."""
        if self.root is None:
            return None
        self.outcome.entry = self.path.name
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return self.refuse("no entry")
        except OSError as e:
            return self.refuse(f"unreadable entry ({type(e).__name__}: {e})")
        try:
            entry = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - truncated or not a pickle
            return self.refuse(f"corrupt entry (not a pickle, truncated? {type(e).__name__}: {e})")
        if not isinstance(entry, dict) or not {"format", "key", "payload", "checksum"} <= set(entry):
            return self.refuse("corrupt entry (not a stored-graph entry)")
        if entry["format"] != FORMAT:
            return self.refuse(f"stale entry (format {entry['format']!r}, this autotp writes {FORMAT})")
        if not isinstance(entry["payload"], bytes) or entry["checksum"] != _checksum(entry["key"], entry["payload"]):
            return self.refuse("corrupt entry (checksum mismatch)")
        if entry["key"] != self.key:
            differ = sorted(k for k in set(entry["key"]) | set(self.key) if entry["key"].get(k) != self.key.get(k))
            return self.refuse(f"entry of another {', '.join(differ)}")
        try:
            return pickle.loads(entry["payload"])
        except Exception as e:  # noqa: BLE001
            return self.refuse(f"corrupt entry (payload: {type(e).__name__}: {e})")

    def refuse(self, reason: str) -> None:
        """Record that the entry is not used, and why."""
        self.outcome.status, self.outcome.reason = "miss", reason
        return None

    def write(self, payload: dict[str, Any]) -> bool:
        """Write the entry atomically; False (after one warning) where the folder cannot be written."""
        if self.root is None or not self._writable:
            return False
        data = pickle.dumps(payload)
        entry = {"format": FORMAT, "key": self.key, "payload": data, "checksum": _checksum(self.key, data)}
        try:
            cache_env.write_atomic(self.path, pickle.dumps(entry))
        except OSError as e:
            self._writable = False
            warnings.warn(f"autotp: stored graphs cannot be written to {self.path.parent} ({type(e).__name__}: "
                          f"{e}); the next launch traces the model again.", stacklevel=2)
            return False
        return True


class StoredForward:
    """A model's compiled forward with stored graphs: the stored entry installed where one is usable
    (:class:`GraphStore`), else a fresh Dynamo package; after a call that compiled new graphs, the
    entry is written again with them (by one rank, the last: ``write``)."""

    def __init__(self, fn: Callable[..., Any], backend: Callable[..., Any], store: GraphStore, write: bool,
                 session: Any = None, trace: Path | None = None, share: Any = None) -> None:
        self.store = store
        self.trace = trace
        self.write = write and store.root is not None
        self.loaded: dict[str, StoredGraph] = {}
        start = time.perf_counter()
        payload = store.read()
        package = None
        if payload is not None:
            try:
                graphs = {name: StoredGraph(data, marks, session) for name, (data, marks) in payload["graphs"].items()}
                markings: dict[str, dict[str, Any]] = {}
                for g in graphs.values():
                    for source, marks in g.markings.items():
                        markings.setdefault(source, {}).update(marks)
                with cycle_collection_paused():
                    package = DynamoPackage(fn, backend, (payload["entry"], payload["aliases"]), graphs, markings,
                                            share=share)
                self.loaded = graphs
                store.outcome.status, store.outcome.reason, store.outcome.graphs = "hit", None, len(graphs)
            except (PackageError, KeyError, TypeError, ValueError) as e:
                store.refuse(f"entry does not install ({e})")
        # a rank that writes no entry records no package it would not store (``DynamoCompiled``)
        self.package = package if package is not None else \
            DynamoPackage(fn, backend, share=share) if self.write or (share is not None and share.tracer) else \
            DynamoCompiled(fn, backend, share=share)
        if share is not None and share.tracer:
            share.graphs = self.graphs
        store.outcome.load_s = time.perf_counter() - start
        self._written = len(self.loaded)
        self._write_trace()

    def _write_trace(self) -> None:
        """The outcome as ``stored_graphs.json`` in this rank's trace folder (where one is kept)."""
        if self.trace is not None:
            self.trace.mkdir(parents=True, exist_ok=True)
            write_json(self.trace, "stored_graphs.json", self.store.outcome.as_dict())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.package(*args, **kwargs)
        if self.write:
            self._write_new()
        return out

    def graphs(self) -> dict[str, StoredGraph]:
        """Every stored graph the package's frames call: loaded ones and those compiled here."""
        new = {name: g for name, g in self.package.graphs().items() if isinstance(g, StoredGraph)}
        return {**self.loaded, **new}

    def _write_new(self) -> None:
        graphs = self.graphs()
        if len(graphs) == self._written:
            return
        self._written = len(graphs)
        unstored = [name for name, g in self.package.graphs().items() if not isinstance(g, StoredGraph)]
        if unstored:  # the entry would name a graph it does not hold
            self.store.outcome.notes.append(f"not stored: {len(unstored)} graph(s) do not pickle")
            self.write = False
            self._write_trace()
            return
        try:
            entry, aliases = self.package.entry()
        except PackageError as e:
            self.store.outcome.notes.append(f"not stored: Dynamo cannot store this model's frames or guards ({e})")
            self.write = False
            self._write_trace()
            return
        payload = {"entry": entry, "aliases": aliases,
                   "graphs": {name: (g.data, g.markings) for name, g in graphs.items()}}
        try:
            written = self.store.write(payload)
        except PICKLE_REFUSALS as e:
            # a frame's guards or code hold what pickle refuses (output_hidden_states=True on a tiny
            # Llama after a plain call: "cannot pickle 'module' object"): the call's result stands,
            # the entry on disk keeps the graphs it had
            self.store.outcome.notes.append(f"not stored: the entry does not pickle ({type(e).__name__}: {e})")
            self.write = False
            self._write_trace()
            return
        if written:
            self.store.outcome.stored = len(graphs)
        self._write_trace()

    def uninstaller(self) -> Callable[[], None]:
        """What takes the installed frames off the model's code when the session closes (holding
        no reference to the model, so that it can be collected)."""
        return self.package.uninstaller()


def storing_backend(backend: Callable[..., Any], session: Any, share: Any = None) -> Callable[..., Any]:
    """``backend`` whose result is a :class:`StoredGraph`: the graph is pickled before the backend's
    passes edit it (its layer regions inlined, ``autotp/passes/inline.py``), and the session's compiled code is its lowering for this session. With
    ``share`` (the tracing rank of ``autotp/shared_frames.py``) the graph lowers on its first call,
    after the frame was published, as the other ranks' copies do; one that does not pickle is
    lowered now, after publishing that the others compile the frame themselves."""

    def store_and_compile(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inline_subgraphs(gm)  # stored as the backend plans it: no higher-order op to unpickle
        try:
            stored = StoredGraph.of(gm, example_inputs)
        except Exception:  # noqa: BLE001 - a graph that does not pickle is compiled, not stored
            if share is not None:
                share.publish(None)
            return backend(gm, example_inputs)
        if share is not None:
            stored.owner = session
            return stored
        return stored.bind(session, backend(gm, example_inputs))

    return store_and_compile
