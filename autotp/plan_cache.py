"""The persistent plan cache: a solved graph's plan, kept on disk so that the same graph compiled
again (a second job, another rank, a recompile) skips decompose and solve.

**Key.** Everything the planning passes read, as canonical JSON, hashed with SHA-256:

* the Dynamo graph, node by node: op, name, target (by qualified name), arguments (nodes by index,
  constants by value), and the example value's shapes, strides, dtypes, device and
  ``requires_grad``; ``get_attr`` sub-graphs recursively, tensor constants by content;
* the graph inputs: each placeholder's source, the concrete example inputs (shape, stride, dtype,
  device, ``requires_grad``), for parameters their names (tied ones too) and the placement an
  earlier graph pinned, for user inputs the placement a graph left them sharded at;
* the world size, the options the backend passes (every ``AutoTPConfig`` field that can change
  a plan: overrides, ``memory_weight``, ``beam_width``, ``sequence_parallel``, ``fuse``, ``dtype``,
  ...; whether the unmatched-override check applies; sharded outputs), and the grad, inference
  and autocast mode;
* the versions: this file format, a digest of autotp's own source files (a changed solver is a
  changed key even under one version number), torch, transformers and Python.

Anything the key cannot describe (an argument of an unknown type, a ``call_module`` node) makes
the graph uncacheable: it is planned as without a cache, and the outcome says why.

**Value.** What lowering needs, by Dynamo node *name*, never by object identity: per node its
output placements, the placement each edge arrives with and needs, its local rewrites; each
placeholder's placement; plus the solve's summary (costs, tokens, graph sizes, the overrides'
extra cost) and the plan the lowering reported (parameters and collectives) for the trace.

**Trust.** An entry is one JSON document ``{"format", "key", "payload", "checksum"}`` in
``<cache dir>/plans/<sha256 of the key>.json``. On load it must parse, carry this format, match
its checksum (SHA-256 of the canonical key and payload), carry exactly the expected key (so an
entry of another graph, version or option set under this name is refused), and fit the graph it
is applied to (every node named, placements well-formed, parameter shards dividing). Any failure is
a miss with the reason in the outcome (and the trace); the plan is solved again and the entry
rewritten. Writes go to a unique temporary file in the same folder, then ``os.replace``: readers
see the old entry or the new one, never a part, and concurrent writers (ranks, jobs) all succeed.

**Location.** ``AUTOTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/autotp``, else ``~/.cache/autotp``;
``AUTOTP_CACHE=0`` (or ``false`` / ``off`` / ``no``) turns it off. A location that cannot be written
(read-only, not a folder) warns once per :class:`PlanCache` and the model compiles without storing
plans (entries already there are still read).

The planning passes do no I/O: this module does all of it, and the backend calls it around them.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import os
import time
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from autotp import cache_env
from autotp.cache_env import cache_dir_from
from autotp.compat import FakeTensor, OpOverload, OpOverloadPacket, pytree
from autotp.passes.annotate import Annotation, EdgePlan, NodePlan
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    parse,
)

#: bump when the entry layout or the meaning of a key field changes
FORMAT = 1


class Uncacheable(Exception):
    """The graph holds something the key cannot describe faithfully."""


def versions() -> dict[str, Any]:
    return {"format": FORMAT, **cache_env.versions()}


# --------------------------------------------------------------------------------------------------
# Key
# --------------------------------------------------------------------------------------------------


def _qualname(obj: Any) -> str:
    if isinstance(obj, (OpOverload, OpOverloadPacket)):
        return f"op:{obj}"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is None:
        raise Uncacheable(f"target {obj!r} has no qualified name")
    return f"{module}.{name}"


def _encode_arg(a: Any, index: Mapping[torch.fx.Node, int]) -> Any:
    """A constant or node reference in a node's arguments, as JSON that differs wherever the
    values differ."""
    if isinstance(a, torch.fx.Node):
        return ["node", index[a]]
    if a is None or isinstance(a, (bool, str)):
        return a
    if isinstance(a, int):
        return ["int", str(a)]
    if isinstance(a, float):
        return ["float", repr(a)]
    if isinstance(a, complex):
        return ["complex", repr(a)]
    if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["sym", _expression(a.node.expr)]
    if isinstance(a, (tuple, list)):
        return [type(a).__name__, [_encode_arg(x, index) for x in a]]
    if isinstance(a, dict):
        return ["dict", [[_encode_arg(k, index), _encode_arg(v, index)] for k, v in a.items()]]
    if isinstance(a, slice):
        return ["slice", [_encode_arg(x, index) for x in (a.start, a.stop, a.step)]]
    if a is Ellipsis:
        return ["..."]
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ["torch", type(a).__name__, str(a)]
    if isinstance(a, enum.Enum):
        return ["enum", _qualname(type(a)), a.name]
    if isinstance(a, torch.Tensor):
        return ["tensor", *_tensor_fields(a), _tensor_content(a)]
    if isinstance(a, (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                      OpOverload, OpOverloadPacket, type)):
        return ["callable", _qualname(a)]
    raise Uncacheable(f"an argument of type {type(a).__module__}.{type(a).__qualname__}")


def _tensor_fields(t: torch.Tensor) -> list[Any]:
    return [[_size(s) for s in t.shape], [_size(s) for s in t.stride()], str(t.dtype), t.device.type,
            bool(t.requires_grad), type(t).__qualname__]


def _size(s: Any) -> str:
    """A size or stride as ``str`` writes it (a SymInt as its expression)."""
    return _expression(s.node.expr) if isinstance(s, torch.SymInt) else str(s)


@functools.lru_cache(maxsize=4096)
def _expression(expr: Any) -> str:
    """``str`` of a sympy expression, once per expression: printing is most of keying a graph whose
    values have symbolic sizes (the benchmark model's prefill graph: ~2000 sizes over a few dozen
    expressions)."""
    return str(expr)


def _tensor_content(t: torch.Tensor) -> str:
    if t.device.type == "meta" or isinstance(t, FakeTensor):
        raise Uncacheable("a tensor constant without data")
    data = t.detach().cpu().contiguous().reshape(-1)  # (numel,): a 0-d tensor has no byte view
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()


def _encode_value(v: Any) -> Any:
    """A node's ``example_value`` (fake tensors, SymInts, nests of them)."""
    if isinstance(v, torch.Tensor):
        return ["T", *_tensor_fields(v)]
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["sym", _expression(v.node.expr)]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return ["float", repr(v)]
    if isinstance(v, torch.Size):  # a pickled graph's sizes come back as plain tuples
        return ["tuple", [_encode_value(x) for x in v]]
    if isinstance(v, (tuple, list)):
        return [type(v).__qualname__, [_encode_value(x) for x in v]]
    if isinstance(v, dict):
        return ["dict", [[str(k), _encode_value(x)] for k, x in v.items()]]
    return ["object", f"{type(v).__module__}.{type(v).__qualname__}"]


def graph_fingerprint(gm: torch.fx.GraphModule) -> list[Any]:
    """The Dynamo graph as JSON: every node's op, name, target, arguments and example value."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            raise Uncacheable(f"call_module node {n.name} ({n.target})")
        if n.op == "get_attr":
            attr = _get_attr(gm, n.target)
            if isinstance(attr, torch.fx.GraphModule):
                target: Any = ["subgraph", n.target, graph_fingerprint(attr)]
            elif isinstance(attr, torch.Tensor):
                target = ["tensor", n.target, *_tensor_fields(attr), _tensor_content(attr)]
            else:
                raise Uncacheable(f"get_attr {n.target} of type {type(attr).__qualname__}")
        elif n.op == "call_function":
            target = _qualname(n.target)
        else:
            target = str(n.target)
        grapharg = n.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", None) if grapharg is not None else None
        nodes.append([n.op, n.name, target, _encode_arg(n.args, index), _encode_arg(n.kwargs, index),
                      _encode_value(n.meta.get("example_value", n.meta.get("val"))), source])
    return nodes


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _concrete(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else str(x.node.expr)
    return x


def inputs_fingerprint(example_inputs: list[Any], params: Mapping[int, Any],
                       sharded: Mapping[int, Placement | None]) -> list[Any]:
    """The example inputs as the solver sees them. ``params``: input position -> ParameterMeta;
    ``sharded``: input position -> the placement a user input arrives sharded at (None: R)."""
    out = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            entry: list[Any] = ["T", [str(_concrete(s)) for s in x.shape], [str(_concrete(s)) for s in x.stride()],
                                str(x.dtype), x.device.type, bool(x.requires_grad),
                                isinstance(x, torch.nn.Parameter)]
            meta = params.get(i)
            if meta is not None:
                entry += ["param", list(meta.tied), meta.fqn, list(meta.global_shape),
                          _placement_text(meta.placement)]
            else:
                entry += ["input", _placement_text(sharded.get(i))]
        elif isinstance(x, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)) or x is None:
            entry = ["value", repr(_concrete(x))]
        else:
            entry = ["object", f"{type(x).__module__}.{type(x).__qualname__}"]
        out.append(entry)
    return out


@dataclass(frozen=True)
class PlanKey:
    """The canonical key of one graph's plan and its digest (the entry's file name)."""

    fields: dict[str, Any]
    digest: str

    @classmethod
    def of(cls, fields: dict[str, Any]) -> PlanKey:
        return cls(fields, hashlib.sha256(_canonical(fields).encode()).hexdigest())


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


# --------------------------------------------------------------------------------------------------
# Value
# --------------------------------------------------------------------------------------------------


def _placement_text(p: Any) -> Any:
    if p is None:
        return None
    if isinstance(p, (Replicate, Shard, Partial, GroupedShard, HeadShard)):
        return str(p)
    if isinstance(p, tuple):
        return {"tuple": [_placement_text(x) for x in p]}
    raise Uncacheable(f"a placement of type {type(p).__qualname__}")


def _placement_of(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, dict):
        return tuple(_placement_of(y) for y in x["tuple"])
    if not isinstance(x, str):
        raise ValueError(f"not a placement: {x!r}")
    return _parsed(x)


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Placement:
    """``placement.parse``, once per distinct text: an entry names a few placements thousands of
    times (placements are frozen values, so one object serves every node)."""
    return parse(text)


def encode_annotation(gm: torch.fx.GraphModule, annotation: Annotation) -> dict[str, Any]:
    """The annotation keyed by Dynamo node name (called before the rewrite edits the graph)."""
    plans = {}
    for n, plan in annotation.plans.items():
        plans[n.name] = {
            "outputs": [[sub, _placement_text(p)] for sub, p in sorted(plan.outputs.items())],
            "edges": [[leaf, sub, _placement_text(e.src), _placement_text(e.dst)]
                      for (leaf, sub), e in sorted(plan.edges.items())],
            "local": sorted(plan.local),
        }
    placeholders = {n.name: _placement_text(p) for n, p in annotation.placeholder_placements.items()}
    encoded = {"plans": plans, "placeholders": placeholders}
    if decode_annotation(gm, encoded, world=None, params={}) != annotation:  # round trip, or nothing stored
        raise Uncacheable("the annotation does not round-trip through JSON")
    return encoded


def decode_annotation(gm: torch.fx.GraphModule, encoded: Mapping[str, Any], world: int | None,
                       params: Mapping[str, tuple[tuple[int, ...], Placement | None]]) -> Annotation:
    """Rebuild the annotation on ``gm``'s nodes, checking that it fits the graph (raises
    ValueError where it does not). ``params``: placeholder name -> (global shape, pinned placement)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    plans_in, placeholders_in = encoded["plans"], encoded["placeholders"]
    if set(plans_in) != set(by_name):
        missing, extra = sorted(set(by_name) - set(plans_in)), sorted(set(plans_in) - set(by_name))
        raise ValueError(f"the entry's nodes differ from the graph's (missing {missing[:3]}, extra {extra[:3]})")
    plans: dict[torch.fx.Node, NodePlan] = {}
    for name, p in plans_in.items():
        node = by_name[name]
        leaves = len(_leaves(node))
        outputs = {int(sub): _placement_of(x) for sub, x in p["outputs"]}
        edges = {}
        for leaf, sub, src, dst in p["edges"]:
            if not 0 <= int(leaf) < max(leaves, 1) and node.op != "placeholder":
                raise ValueError(f"node {name}: an edge into argument {leaf}, but it has {leaves}")
            edges[(int(leaf), int(sub))] = EdgePlan(src=_placement_of(src), dst=_placement_of(dst))
        local = set(p["local"])
        if not all(isinstance(t, str) for t in local):
            raise ValueError(f"node {name}: local rewrites {sorted(map(str, local))} are not names")
        _check_ranks(node, outputs)
        plans[node] = NodePlan(outputs=outputs, edges=edges, local=local)
    placeholders: dict[torch.fx.Node, Placement] = {}
    for name, text in placeholders_in.items():
        if name not in by_name or by_name[name].op != "placeholder":
            raise ValueError(f"{name} is not a placeholder of the graph")
        placement = _placement_of(text)
        if name in params and world is not None:
            _check_parameter(name, placement, *params[name], world)
        placeholders[by_name[name]] = placement
    if world is not None and set(params) - set(placeholders_in):
        raise ValueError(f"parameters without a placement: {sorted(set(params) - set(placeholders_in))[:3]}")
    return Annotation(plans=plans, placeholder_placements=placeholders)


def _leaves(n: torch.fx.Node) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), out.append)
    return out


def _check_ranks(node: torch.fx.Node, outputs: Mapping[int, Any]) -> None:
    flat, _ = pytree.tree_flatten(node.meta.get("example_value"))
    for sub, p in outputs.items():
        value = flat[sub] if 0 <= sub < len(flat) else None
        if isinstance(p, (Shard, GroupedShard, HeadShard)) and isinstance(value, torch.Tensor) and p.dim >= value.dim():
            raise ValueError(f"node {node.name}: {p} on a {value.dim()}-d value")


def _check_parameter(name: str, placement: Any, shape: tuple[int, ...], pinned: Placement | None,
                     world: int) -> None:
    if pinned is not None and placement != pinned:
        raise ValueError(f"parameter {name}: the entry places it at {placement}, an earlier graph pinned {pinned}")
    if isinstance(placement, StridedShard):
        if placement.dim >= len(shape) or not placement.fits(shape[placement.dim], world):
            raise ValueError(f"parameter {name}: {placement} does not fit shape {shape} at world size {world}")
    elif isinstance(placement, GroupedShard):
        chunks = placement.groups
        if placement.dim >= len(shape) or shape[placement.dim] % chunks or world % chunks:
            raise ValueError(f"parameter {name}: {placement} does not fit shape {shape} at world size {world}")
    elif isinstance(placement, HeadShard):
        if placement.dim >= len(shape) or shape[placement.dim] % placement.heads or world % placement.groups \
                or min(placement.heads_per_rank(world)) < 1:
            raise ValueError(f"parameter {name}: {placement} does not fit shape {shape} at world size {world}")
    elif isinstance(placement, Shard):  # a dim no rank count divides is split unevenly (a vocabulary)
        if placement.dim >= len(shape) or shape[placement.dim] < world:
            raise ValueError(f"parameter {name}: {placement} does not fit shape {shape} at world size {world}")
    elif not isinstance(placement, Replicate):
        raise ValueError(f"parameter {name}: stored as {placement}")


# --------------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------------


def summary_elsewhere(solve: Mapping[str, Any], timings_key: str) -> dict[str, Any]:
    """A solve's summary for the trace of a compile that did not run that solve (a cache hit, or a
    rank that got rank 0's plan): costs and sizes as solved, the solve's timings (every ``*_s``
    field) under ``timings_key``, so that no trace reports another compile's time as its own."""
    timings = {k: v for k, v in solve.items() if k.endswith("_s")}
    return {**{k: v for k, v in solve.items() if k not in timings}, timings_key: timings}


@dataclass
class CachedPlan:
    """A hit: the annotation rebuilt on this graph, what the solve and lowering reported, and the
    annotation as stored (``encoded``: what rank 0 broadcasts on a hit without encoding it again,
    and what another rank's hit compares the broadcast with before skipping its decode)."""

    annotation: Annotation
    solve: dict[str, Any]
    plan: dict[str, Any]
    encoded: dict[str, Any] = field(default_factory=dict)

    def trace_summary(self) -> dict[str, Any]:
        """The solve's summary for a hit's trace: costs and sizes as solved, and the solve's
        timings under ``stored_timings`` (they are the miss's, not this compile's)."""
        return {**summary_elsewhere(self.solve, "stored_timings"), "plan_cache": "hit"}


@dataclass
class Outcome:
    """What the cache did for one graph: ``status`` is ``hit``, ``miss``, ``uncacheable`` or
    ``off``; ``reason`` says why a miss or an uncacheable graph (an absent, corrupt, stale or
    foreign entry); ``stored`` whether this graph's plan was written."""

    status: str
    reason: str | None = None
    entry: str | None = None
    stored: bool = False
    notes: list[str] = field(default_factory=list)
    #: wall seconds spent keying the graph and reading and checking its entry
    lookup_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "entry": self.entry, "stored": self.stored,
                "notes": list(self.notes), "lookup_s": self.lookup_s}


@dataclass
class Lookup:
    """One graph's pass through the cache: its key (None: off or uncacheable), the entry it hit,
    the outcome, and (after a miss's solve) what :meth:`PlanCache.finish` stores."""

    key: PlanKey | None
    cached: CachedPlan | None
    outcome: Outcome
    pending: tuple[dict[str, Any], dict[str, Any]] | None = None


class PlanCache:
    """One model's handle on the cache folder (``root``; None: off). Holds the versions it keys on
    and each graph's :class:`Outcome` (``outcomes``, in compile order)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.outcomes: list[Outcome] = []
        self._versions: dict[str, Any] | None = None
        self._writable: bool | None = None  # unknown until the first store

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> PlanCache:
        return cls(cache_dir_from(os.environ if env is None else env))

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @property
    def folder(self) -> Path:
        assert self.root is not None
        return self.root / "plans"

    def path_of(self, key: PlanKey) -> Path:
        return self.folder / f"{key.digest}.json"

    def key(self, gm: torch.fx.GraphModule, example_inputs: list[Any], params: Mapping[int, Any],
            sharded: Mapping[int, Placement | None], world: int, options: Mapping[str, Any]) -> PlanKey:
        """Raises :class:`Uncacheable` for a graph the key cannot describe."""
        if self._versions is None:
            self._versions = versions()
        modes = {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
                 "autocast": torch.is_autocast_enabled()}
        return PlanKey.of({"versions": self._versions, "world_size": world, "options": dict(options),
                           "modes": modes, "graph": graph_fingerprint(gm),
                           "inputs": inputs_fingerprint(example_inputs, params, sharded)})

    def load(self, key: PlanKey, gm: torch.fx.GraphModule, world: int,
             params: Mapping[str, tuple[tuple[int, ...], Placement | None]]) -> tuple[CachedPlan | None, str]:
        """The entry for ``key`` checked against ``gm``, or None and the reason it was not used."""
        path = self.path_of(key)
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None, "no entry"
        except OSError as e:
            return None, f"unreadable entry ({type(e).__name__}: {e})"
        try:
            entry = json.loads(text)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
            return None, f"corrupt entry (not JSON, truncated? {type(e).__name__}: {e})"
        if not isinstance(entry, dict) or not {"format", "key", "payload", "checksum"} <= set(entry):
            return None, "corrupt entry (not a plan-cache entry)"
        if entry["format"] != FORMAT:
            return None, f"stale entry (format {entry['format']!r}, this autotp writes {FORMAT})"
        if entry["checksum"] != entry_checksum(entry["key"], entry["payload"]):
            return None, "corrupt entry (checksum mismatch)"
        if entry["key"] != key.fields:
            return None, f"entry of {_difference(entry['key'], key.fields)}"
        payload = entry["payload"]
        try:
            annotation = decode_annotation(gm, payload["annotation"], world, params)
            return CachedPlan(annotation, dict(payload["solve"]), dict(payload["plan"]),
                              payload["annotation"]), "hit"
        except (KeyError, TypeError, ValueError) as e:
            return None, f"entry does not fit the graph ({type(e).__name__}: {e})"

    def store(self, key: PlanKey, annotation: dict[str, Any], solve: dict[str, Any], plan: dict[str, Any]) -> bool:
        """Write the entry atomically; False (after one warning per cache) when the folder cannot
        be written."""
        if self._writable is False:
            return False
        payload = {"annotation": annotation, "solve": solve, "plan": plan}
        entry = {"format": FORMAT, "key": key.fields, "payload": payload,
                 "checksum": entry_checksum(key.fields, payload)}
        try:
            cache_env.write_atomic(self.path_of(key), _canonical(entry).encode())
        except OSError as e:
            self._writable = False
            warnings.warn(f"autotp: the plan cache at {self.root} cannot be written ({type(e).__name__}: {e}); "
                          "plans are not cached. Set AUTOTP_CACHE_DIR to a writable folder, or AUTOTP_CACHE=0 "
                          "to turn the cache off.", stacklevel=2)
            return False
        self._writable = True
        return True

    def lookup(self, gm: torch.fx.GraphModule, example_inputs: list[Any], params: Mapping[int, Any],
               sharded: Mapping[int, Placement | None], world: int, options: Mapping[str, Any],
               bypass: str | None = None) -> Lookup:
        """Key the graph and read its entry. ``params``: input position -> ParameterMeta;
        ``sharded``: input position -> the placement a user input arrives sharded at (None: R);
        ``bypass``: a reason not to use the cache for this graph (a tool needs solver records)."""
        if not self.enabled or bypass:
            return self._record(Lookup(None, None, Outcome("off", bypass or "AUTOTP_CACHE=0")))
        start = time.perf_counter()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        by_name = {placeholders[i].name: (tuple(m.global_shape), m.placement) for i, m in params.items()}
        try:
            key = self.key(gm, example_inputs, params, sharded, world, options)
        except (Uncacheable, ValueError) as e:  # ValueError: a NaN option JSON cannot carry
            return self._record(Lookup(None, None, Outcome("uncacheable", str(e),
                                                           lookup_s=time.perf_counter() - start)))
        cached, reason = self.load(key, gm, world, by_name)
        outcome = Outcome("hit" if cached else "miss", None if cached else reason, self.path_of(key).name,
                          lookup_s=time.perf_counter() - start)
        return self._record(Lookup(key, cached, outcome))

    def solved(self, lookup: Lookup, gm: torch.fx.GraphModule, annotation: Annotation,
               solve: dict[str, Any]) -> None:
        """After a miss's solve, before the rewrite edits the graph: encode what will be stored."""
        if lookup.key is None:
            return
        try:
            lookup.pending = (encode_annotation(gm, annotation), _jsonable(solve))
        except (Uncacheable, ValueError) as e:
            lookup.outcome.notes.append(f"not stored: {e}")

    def finish(self, lookup: Lookup, plan: dict[str, Any]) -> None:
        """After lowering: store a miss's entry with the plan it lowered to; on a hit, check that
        the lowering reproduced the entry's plan (else drop the entry, so the next compile solves)."""
        if lookup.key is None:
            return
        plan = _jsonable(plan)
        if lookup.cached is not None:
            if lookup.cached.plan != plan:
                lookup.outcome.notes.append("the lowered plan differs from the entry's; entry discarded")
                self.discard(lookup.key)
            return
        if lookup.pending is not None:
            lookup.outcome.stored = self.store(lookup.key, *lookup.pending, plan)
            if not lookup.outcome.stored:
                lookup.outcome.notes.append(f"not stored: {self.root} cannot be written")

    def _record(self, lookup: Lookup) -> Lookup:
        self.outcomes.append(lookup.outcome)
        return lookup

    def discard(self, key: PlanKey) -> None:
        """Remove an entry that proved wrong (the next compile solves and rewrites it)."""
        try:
            self.path_of(key).unlink()
        except OSError:
            pass


def _jsonable(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, keys strings, a non-finite float
    its repr, anything else its str), so that what is compared on a hit is what was stored."""
    return json.loads(json.dumps(_finite(obj), allow_nan=False, default=str))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def entry_checksum(key: Any, payload: Any) -> str:
    return hashlib.sha256(_canonical({"key": key, "payload": payload}).encode()).hexdigest()


def _difference(stored: Any, expected: Mapping[str, Any]) -> str:
    """Which part of the key an entry disagrees on, in words."""
    if not isinstance(stored, dict):
        return "another key layout"
    if stored.get("versions") != expected["versions"]:
        differ = sorted(k for k in expected["versions"]
                        if (stored.get("versions") or {}).get(k) != expected["versions"][k])
        return f"another version ({', '.join(differ)})"
    parts = [k for k in ("graph", "inputs", "world_size", "options", "modes") if stored.get(k) != expected[k]]
    names = {"graph": "another graph", "inputs": "other inputs", "world_size": "another world size",
             "options": "other options", "modes": "another grad/autocast mode"}
    return ", ".join(names[p] for p in parts) or "another key"
