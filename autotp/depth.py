"""Plan a deep model from a shortened stand-in: ``autotp plan``'s cost independent of depth.

A decoder of ``n`` layers repeats a few kinds of layer. :func:`autotp.planner.plan_model` traces,
decomposes and solves a model of ``k = 4p + n mod p`` layers instead (``p``: the period of the
layer kinds, 1 for Llama, 2 for Gemma-2's sliding/global alternation), then expands its report to
the ``n`` layers. The stand-in keeps three periods of head, one period of tail (plus ``n mod p``):
layers ``[0, 3p)`` are the full model's first ``3p``, layers ``[3p, k)`` its last ``k - 3p``; the
``q = (n - k) / p`` periods in between are copies of the head's last period ``[2p, 3p)``.

Why the shortcut is sound, step by step, and what is checked (any failed check plans at full
depth and says why in :attr:`PlanReport.depth <autotp.planner.PlanReport>`):

1. **The layers are the same program.** Each layer's *signature* is its structure: every
   submodule's name and class, its parameters' and buffers' names, shapes, dtypes, its public
   attributes (``attention_type``, ``sliding_window``, ``is_sliding``, ``scaling``; an integer equal
   to the layer's own index in every layer, ``layer_idx``, is read as "the index"; an attribute that cannot be
   compared by value, compared by identity, which tells layers apart), and the config's per-layer
   entries (every config list of length ``n``: ``layer_types[i]``). Equal signatures are one kind;
   ``p`` is the smallest period of the kind sequence, so Gemma-2, dense/MoE interleaving
   (``decoder_sparse_step``) and Gemma-3's 5:1 pattern keep their pattern. A sequence with no
   period short enough to save anything (Qwen2 with ``max_window_layers`` turning sliding layers
   on part-way) is planned at full depth.
2. **The stand-in is the same model, shorter.** It is built from a copy of the config with
   ``num_hidden_layers = k`` and every per-layer list cut to the kept layers, so layers are indexed
   ``0..k-1`` everywhere (KV cache, masks). Its layer ``j`` must have the signature of the full
   model's layer ``kept[j]``, and everything outside the stack the same parameters; otherwise full
   depth (a config field a layer's ``__init__`` reads by index, such as ``mlp_only_layers``, that
   the cut does not follow, is caught here). What a layer's ``forward`` reads of the config by its
   index at run time is not seen; transformers' layers fix their kind in ``__init__``.
3. **The solver reaches a steady state, and the stand-in shows it.** The solver replays a block
   whose structure and incoming states equal an earlier block's (``autotp/passes/solve.py``,
   repeated blocks): once the frontier settles, every further period has the same transitions,
   and the best plan's path through them repeats. In the stand-in, the traced graph of period
   ``[p, 2p)`` must equal that of ``[2p, 3p)`` node by node (op and name, up to Dynamo's name
   counters, which advance by a fixed step per period), and their plans must agree: every
   parameter's placement and style, every collective (kind, placements, module, shape, bytes), the
   KV-cache bytes of each layer. The full model's middle periods see the same incoming states, so
   they get the same plan; its tail sees what the stand-in's tail sees.
4. **Expansion is bookkeeping.** Parameters of full layer ``i`` take the placement and style of
   stand-in layer ``s(i)`` (``i`` itself in the head, ``2p + (i - 3p) mod p`` in the middle,
   ``i - qp`` in the tail), so the parameter table and memory totals are computed on the full
   model exactly as at full depth. A collective of the copied period repeats ``q`` times with its
   layer indices and Dynamo node names shifted; the tail's are shifted by ``q`` periods; the
   collective counts and bytes and the KV-cache bytes grow by ``q`` times the period's, after
   checking that the stand-in's collectives add up to what its program issued.

What is not expanded: the solver's cost, certificate and timings are the stand-in graph's (the
solver does not attribute cost per layer), and the solver record is the stand-in's, so
:func:`autotp.planner.explain` needs a full-depth plan (``plan_model`` plans at full depth when
``explain_names`` are given). Overrides are honoured when every pattern names the same parameters
in each layer of a kind (``model.layers.*.mlp``); one that tells layers apart (``model.layers.7.*``)
plans at full depth.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import re
import types
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

#: a Dynamo/FX node name: its base and the counter FX appends (``hidden_states_19``)
_COUNTER = re.compile(r"^(.*)_(\d+)$")


class CannotShorten(Exception):
    """Why a model is planned at full depth (the message goes into the report)."""


@dataclass
class Shortening:
    """How the full model's ``depth`` layers map onto the stand-in's (see the module docstring)."""

    path: str  # the layer stack's module name, "model.layers"
    depth: int  # n
    period: int  # p
    config: Any = field(repr=False)  # the stand-in's config

    @property
    def short_depth(self) -> int:
        return 4 * self.period + self.depth % self.period

    @property
    def head(self) -> int:
        return 3 * self.period

    @property
    def copies(self) -> int:
        """q: periods the full model has between the stand-in's head and tail."""
        return (self.depth - self.short_depth) // self.period

    def kept(self) -> list[int]:
        """Stand-in layer j -> the full model's layer it is."""
        shift = self.copies * self.period
        return [j if j < self.head else j + shift for j in range(self.short_depth)]

    def short_of(self, i: int) -> int:
        """The stand-in layer whose plan full layer ``i`` gets."""
        p, shift = self.period, self.copies * self.period
        if i < self.head:
            return i
        if i < self.head + shift:
            return 2 * p + (i - self.head) % p
        return i - shift

    def describe(self) -> str:
        return (f"{self.depth} layers planned from a {self.short_depth}-layer stand-in (layer period {self.period}; "
                f"{self.copies} periods expanded; autotp/depth.py)")

    # -- names ------------------------------------------------------------------------------------

    def _index(self, name: str) -> re.Match | None:
        return re.match(rf"^{re.escape(self.path)}\.(\d+)(?=\.|$)", name)

    def short_name(self, name: str) -> str:
        """A full model's parameter or module name -> the stand-in's name it takes its plan from."""
        m = self._index(name)
        return name if m is None else f"{self.path}.{self.short_of(int(m.group(1)))}{name[m.end():]}"

    def shift_name(self, name: str, by: int, lowest: int) -> str:
        """A stand-in module name with its layer index moved ``by`` layers; refuses an index below
        ``lowest`` (a value from a layer the expansion does not repeat)."""
        m = self._index(name)
        if m is None:
            return name
        j = int(m.group(1))
        if j < lowest:
            raise CannotShorten(f"a collective of a repeated layer reads {name}, outside the repeated period")
        return f"{self.path}.{j + by}{name[m.end():]}"


# ---------------------------------------------------------------------------------------------
# Which layers repeat
# ---------------------------------------------------------------------------------------------


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_stack(module: torch.nn.Module, depth: int) -> str:
    """The name of the one ``ModuleList`` of ``depth`` layers (the decoder stack)."""
    stacks = [name for name, m in module.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    if len(stacks) != 1:
        raise CannotShorten(f"{len(stacks)} module lists of {depth} layers (need exactly one layer stack)")
    return stacks[0]


def _per_layer_entries(text: Any, depth: int) -> dict[str, list]:
    """The config's per-layer lists (``layer_types``): every list or tuple of length ``depth``."""
    return {k: list(v) for k, v in vars(text).items()
            if not k.startswith("_") and isinstance(v, (list, tuple)) and len(v) == depth}


def _value(v: Any, configs: tuple[Any, ...]) -> Any:
    """A module attribute as a comparable, hashable token (see the module docstring, step 1)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value(x, configs) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((str(k), _value(x, configs)) for k, x in v.items())))
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype))
    if any(v is c for c in configs):
        return "<config>"
    if isinstance(v, functools.partial):  # GELU-tanh activations: partial(gelu, approximate="tanh")
        return ("partial", _value(v.func, configs), _value(v.args, configs), _value(v.keywords, configs))
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        return ("callable", getattr(v, "__module__", None), getattr(v, "__qualname__", repr(v)))
    return ("object", type(v).__qualname__, id(v))  # compared by identity: tells layers apart


def _attributes(layer: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """Every public attribute of the layer and its submodules: (module name, attribute) -> value."""
    return {(name, k): v for name, m in layer.named_modules() for k, v in vars(m).items()
            if not k.startswith("_") and k != "training"}


def _kinds(module: torch.nn.Module, path: str, config: Any) -> list[tuple]:
    """Each layer's signature (see the module docstring, step 1). An integer attribute equal to
    the layer's own index in every layer (``layer_idx``) is read as "the index"."""
    text = _text_config(config)
    layers = list(module.get_submodule(path))
    entries = _per_layer_entries(text, len(layers))
    attributes = [_attributes(layer) for layer in layers]
    positional = {key for key, v in attributes[0].items() if type(v) is int
                  and all(type(a.get(key)) is int and a.get(key) == i for i, a in enumerate(attributes))}
    configs = (config, text)
    out = []
    for i, (layer, attrs) in enumerate(zip(layers, attributes, strict=True)):
        rows: list[tuple] = [("config", tuple(sorted((k, _value(v[i], configs)) for k, v in entries.items())))]
        rows.append(("attributes", tuple(sorted((key, "<layer index>" if key in positional else _value(v, configs))
                                                for key, v in attrs.items()))))
        for name, m in layer.named_modules():
            params = tuple((k, tuple(p.shape), str(p.dtype), p.requires_grad)
                           for k, p in m.named_parameters(recurse=False))
            buffers = tuple((k, tuple(b.shape), str(b.dtype), k not in m._non_persistent_buffers_set)
                            for k, b in m.named_buffers(recurse=False))
            rows.append((name, type(m).__module__, type(m).__qualname__, params, buffers))
        out.append(tuple(rows))
    return out


def period_of(kinds: Sequence[Any]) -> int:
    """The smallest ``p`` with ``kinds[i] == kinds[i + p]`` for every ``i``."""
    n = len(kinds)
    return next(p for p in range(1, n + 1) if all(kinds[i] == kinds[i + p] for i in range(n - p)))


def shorten(config: Any, module: torch.nn.Module, overrides: Mapping[str, str]) -> Shortening:
    """The stand-in for ``module`` (built from ``config``), or :class:`CannotShorten` saying why
    the model is planned at full depth."""
    text = _text_config(config)
    depth = getattr(text, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth < 1:
        raise CannotShorten("the config names no num_hidden_layers")
    path = layer_stack(module, depth)
    kinds = _kinds(module, path, getattr(module, "config", config))
    p = period_of(kinds)
    out = Shortening(path=path, depth=depth, period=p, config=None)
    if out.short_depth >= depth:
        raise CannotShorten(f"{depth} layers of period {p}: a stand-in needs {out.short_depth} (4 periods)")
    _check_overrides(out, module, overrides)
    short = copy.deepcopy(config)
    short_text = _text_config(short)
    kept = out.kept()
    for k, v in _per_layer_entries(short_text, depth).items():
        setattr(short_text, k, type(getattr(short_text, k))(v[i] for i in kept))
    short_text.num_hidden_layers = out.short_depth
    out.config = short
    return out


def _check_overrides(short: Shortening, module: torch.nn.Module, overrides: Mapping[str, str]) -> None:
    """Every override pattern must name the same parameters in each layer as in the stand-in layer
    that layer takes its plan from."""
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    for pat in overrides:
        for name in names:
            full = {name, name.rpartition(".")[0]}
            mapped = {short.short_name(t) for t in full}
            if any(fnmatch.fnmatchcase(t, pat) for t in full) != any(fnmatch.fnmatchcase(t, pat) for t in mapped):
                raise CannotShorten(f"override {pat!r} tells layers apart ({name})")


def check_stand_in(short: Shortening, full: torch.nn.Module, stand_in: torch.nn.Module) -> None:
    """The stand-in is the full model, shorter (module docstring, step 2)."""
    layers = stand_in.get_submodule(short.path)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != short.short_depth:
        raise CannotShorten(f"the stand-in config did not build {short.short_depth} layers at {short.path}")
    # the configs differ (cut lists, depth): each side is read against its own
    full_kinds = _kinds(full, short.path, getattr(full, "config", None))
    short_kinds = _kinds(stand_in, short.path, getattr(stand_in, "config", short.config))
    for j, i in enumerate(short.kept()):
        if short_kinds[j] != full_kinds[i]:
            raise CannotShorten(f"stand-in layer {j} differs from layer {i} (a config field read by layer index "
                                "that the stand-in's config does not follow)")
    prefix = short.path + "."

    def outside(m: torch.nn.Module) -> list[tuple]:
        return [(n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters(remove_duplicate=False)
                if not n.startswith(prefix)]

    if outside(full) != outside(stand_in):
        raise CannotShorten("the stand-in's parameters outside the layer stack differ from the full model's")


# ---------------------------------------------------------------------------------------------
# The steady state and the expansion
# ---------------------------------------------------------------------------------------------


def _split(name: str) -> tuple[str, int]:
    m = _COUNTER.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _join(base: str, num: int) -> str:
    return base if num == 0 else f"{base}_{num}"


@dataclass
class GraphLayout:
    """Where the stand-in's layers sit in one Dynamo graph (node positions; the head's last two
    periods end at ``ends[0]``, ``ends[1]``, ``ends[2]``), and how node names advance per period."""

    position: dict[str, int]  # node name -> index in graph order
    ends: tuple[int, int, int]  # last node of layers p-1, 2p-1, 3p-1
    step: dict[str, int]  # name base -> how far its FX counter advances per period

    def region(self, name: str) -> int:
        """0: before period [p, 2p); 1: in it; 2: in [2p, 3p) (the copied period); 3: after it.
        A name that is no node (the boundary gather on return) comes after."""
        pos = self.position.get(name)
        if pos is None and not name.startswith("return"):
            raise CannotShorten(f"a collective goes into {name}, a node the traced graph does not have")
        return 3 if pos is None else sum(pos > end for end in self.ends)

    def shift(self, name: str, periods: int) -> str:
        if name not in self.position:
            return name
        base, num = _split(name)
        if base not in self.step:
            raise CannotShorten(f"a collective after the repeated layers goes into {name}, whose name the repeated "
                                "layers do not number")
        return _join(base, num + periods * self.step[base])


def graph_layout(short: Shortening, nodes: Sequence[tuple[str, str, str, str]]) -> GraphLayout:
    """Read the stand-in's Dynamo graph as traced (``nodes``: name, op, target, module name of each
    node, before the backend rewrote the graph) and check that periods ``[p, 2p)`` and ``[2p, 3p)``
    trace to the same nodes (op, target, name up to a fixed counter step per name base: FX's
    counters, which also count nodes Dynamo removed)."""
    p = short.period
    ends: dict[int, int] = {}
    for pos, (_, _, _, module) in enumerate(nodes):
        m = short._index(module)
        if m is not None:
            ends[int(m.group(1))] = pos
    if any(j not in ends for j in range(3 * p)) or any(ends[j] >= ends[j + 1] for j in range(3 * p - 1)):
        raise CannotShorten("the traced graph does not run the layers one after another")
    bounds = (ends[p - 1], ends[2 * p - 1], ends[3 * p - 1])
    first, second = nodes[bounds[0] + 1:bounds[1] + 1], nodes[bounds[1] + 1:bounds[2] + 1]
    if len(first) != len(second):
        raise CannotShorten("two periods of the stand-in traced to graphs of different sizes")
    # FX numbers names per base, counting nodes Dynamo later removed, so the step of a base is read
    # off corresponding nodes, and must be one step per base
    step: dict[str, int] = {}
    for a, b in zip(first, second, strict=True):
        (base, num), (base_b, num_b) = _split(a[0]), _split(b[0])
        if (base, *a[1:3]) != (base_b, *b[1:3]) or step.setdefault(base, num_b - num) != num_b - num:
            raise CannotShorten(f"two periods of the stand-in traced differently ({a[0]} / {b[0]})")
    return GraphLayout(position={n[0]: pos for pos, n in enumerate(nodes)}, ends=bounds, step=step)


def _moved(short: Shortening, site: Mapping[str, Any], layout: GraphLayout, periods: int, lowest: int
           ) -> dict[str, Any]:
    """A stand-in collective ``periods`` periods later; ``lowest``: the first layer it may read."""
    by = periods * short.period
    out = dict(site)
    out["after"] = short.shift_name(site["after"], by, lowest)
    out["origin"] = short.shift_name(site["origin"], by, lowest)
    if site["layer"] is not None:
        if site["layer"] < lowest:
            raise CannotShorten(f"a repeated collective belongs to layer {site['layer']}, outside the period")
        out["layer"] = site["layer"] + by
    out["into"] = layout.shift(site["into"], periods)
    return out


def expand_sites(short: Shortening, sites: list[dict[str, Any]], layout: GraphLayout
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The full model's collectives, and those of one copied period; checks the steady state
    (the copied period's collectives are the previous period's, one period later)."""
    regions = [layout.region(s["into"]) for s in sites]
    if regions != sorted(regions):
        raise CannotShorten("the stand-in's collectives do not follow its layers' order")
    previous = [s for s, r in zip(sites, regions, strict=True) if r == 1]
    period = [s for s, r in zip(sites, regions, strict=True) if r == 2]
    after = [s for s, r in zip(sites, regions, strict=True) if r == 3]
    if [_moved(short, s, layout, 1, lowest=0) for s in previous] != period:
        raise CannotShorten("the stand-in's plan has not settled: its last two head periods communicate differently")
    p, q = short.period, short.copies
    head = [s for s, r in zip(sites, regions, strict=True) if r <= 2]
    copies = [_moved(short, s, layout, i, lowest=p) for i in range(1, q + 1) for s in period]
    tail = [_moved(short, s, layout, q, lowest=2 * p) for s in after]
    return head + copies + tail, period


def grown(totals: Mapping[str, int], period_sites: Sequence[Mapping[str, Any]], key: str | None, copies: int
          ) -> dict[str, int]:
    """Counts (``key`` None) or bytes (``key`` ``"bytes_per_rank"``) by kind, grown by ``copies``
    periods of ``period_sites``."""
    out = dict(totals)
    for s in period_sites:
        out[s["kind"]] += copies * (1 if key is None else s[key])
    return out


def check_sites_add_up(sites: Sequence[Mapping[str, Any]], counts: Mapping[str, int], nbytes: Mapping[str, int]) -> None:
    """The stand-in's collectives, as the solution's sites list them, are what its program issued."""
    by_count, by_bytes = Counter(), Counter()
    for s in sites:
        by_count[s["kind"]] += 1
        by_bytes[s["kind"]] += s["bytes_per_rank"]
    if dict(by_count) != {k: v for k, v in counts.items() if v} or dict(by_bytes) != {k: v for k, v in nbytes.items() if v}:
        raise CannotShorten(f"the stand-in's collective sites {dict(by_count)} do not add up to what it issued "
                            f"{dict(counts)}")


def expand_kv(short: Shortening, per_layer: Mapping[int | None, tuple[int, int]]) -> tuple[int, int]:
    """KV-cache bytes (per rank, total) of the full model from the stand-in's per cache layer."""
    if None in per_layer or any(j not in per_layer for j in range(short.short_depth)):
        raise CannotShorten("the stand-in's KV-cache entries could not be told apart by layer")
    p = short.period
    for r in range(p):
        if per_layer[p + r] != per_layer[2 * p + r]:
            raise CannotShorten("the stand-in's KV cache differs between its last two head periods")
    full = [per_layer[short.short_of(i)] for i in range(short.depth)]
    return sum(r for r, _ in full), sum(t for _, t in full)


def transfer_placements(short: Shortening, full: torch.nn.Module, stand_in: torch.nn.Module, meta_of: Any) -> None:
    """Give each full-model parameter the placement, style and layout of the stand-in parameter it
    takes its plan from (module docstring, step 4); checks the steady state of the parameters."""
    params = dict(stand_in.named_parameters(remove_duplicate=False))
    p = short.period
    for name, param in params.items():
        m = short._index(name)
        if m is not None and p <= int(m.group(1)) < 2 * p:
            later = short.shift_name(name, p, 0)
            a, b = meta_of(param), meta_of(params[later])
            if (a.placement, a.style, a.strided) != (b.placement, b.style, b.strided):
                raise CannotShorten(f"the stand-in's plan has not settled: {name} is {a.placement}, {later} "
                                    f"{b.placement}")
    for name, param in full.named_parameters(remove_duplicate=False):
        src, dst = meta_of(params[short.short_name(name)]), meta_of(param)
        dst.placement, dst.style, dst.strided = src.placement, src.style, src.strided


def expand_names(short: Shortening, full_names: Sequence[str], short_set: set[str]) -> set[str]:
    """The full model's names whose stand-in name is in ``short_set``."""
    return {n for n in full_names if short.short_name(n) in short_set}
