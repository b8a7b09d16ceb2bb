"""What ``autotp plan`` reports (:class:`PlanReport`, one :class:`GraphReport` per compiled graph),
as plain data: no torch import, so a report read from the report cache (``autotp/report_cache.py``)
is rendered before torch or transformers load. :mod:`autotp.planner` computes it.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from autotp.errors import AutoTPError

if TYPE_CHECKING:
    from autotp.backend import SolveRecord

__all__ = ["FIRST_DECODE", "STATISTIC", "GraphReport", "PlanReport", "block_in", "block_of"]

#: a module path inside a block: (the stack's path, the block's index), e.g. ``model.layers.3.mlp``
_BLOCK_PATH = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")
#: suffix of a collective's kind in :meth:`GraphReport.block_collectives` when it moves one value
#: per token: a norm over a sharded dim reduces its statistic instead of gathering its input
STATISTIC = " of a statistic"
#: the name of an encoder-decoder's first decode step (:attr:`PlanReport.first_decode`)
FIRST_DECODE = "first-decode"


def block_in(path: str) -> tuple[str, int] | None:
    """The block a module path lies in: (its stack, its index), the stack being the path before
    the first index (``model.layers``; T5's ``encoder.block`` and ``decoder.block``, whose blocks
    share indices); None outside every block."""
    found = _BLOCK_PATH.search(path)
    return (found.group(1), int(found.group(2))) if found is not None else None


def block_of(site: Mapping[str, Any]) -> tuple[str, int] | None:
    """The block a collective belongs to: the block whose op made the value it moves (``origin``),
    or, for a value made outside every block (OPT's embedding partial sum, carried in the residual
    stream and reduced with block 0's attention output), the block it sits in (``after``); None
    outside every block (the logits' gather, a vocab-parallel lookup's reduction)."""
    return block_in(site["origin"]) or block_in(site["after"])


@dataclass
class GraphReport:
    """One compiled graph: what it is, its collectives and where they sit, and its timings."""

    name: str
    input_shape: tuple[int, ...]
    collectives: dict[str, int]
    collective_bytes: dict[str, int]
    #: one row per collective of the solution: kind, placements, the module whose output it moves
    sites: list[dict[str, Any]]
    timings: dict[str, float]
    cost: float | None = None
    extra_cost_of_overrides: float | None = None
    #: the solver's certificate, summed over the graph's solves: no plan costs less than
    #: ``lower_bound``; ``gap = cost - lower_bound`` (0: proved optimal)
    lower_bound: float | None = None

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> GraphReport:
        return cls(**{**state, "input_shape": tuple(state["input_shape"])})

    @property
    def gap(self) -> float | None:
        return None if self.cost is None or self.lower_bound is None else max(self.cost - self.lower_bound, 0.0)

    def block_collectives(self) -> dict[str, dict[int, dict[str, int]]]:
        """Collectives by stack of blocks and block: stack -> block index -> kind -> count, each
        site in the block :func:`block_of` names; a kind moving one value per token is suffixed
        :data:`STATISTIC`; stacks in program order. One stack for a decoder or an encoder, two for
        an encoder-decoder's forward (its decode steps run the decoder's alone)."""
        out: dict[str, dict[int, Counter]] = {}
        for site in self.sites:
            block = block_of(site)
            if block is not None:
                statistic = tuple(site.get("global_shape") or ())[-1:] == (1,)
                kind = site["kind"] + (STATISTIC if statistic else "")
                out.setdefault(block[0], {}).setdefault(block[1], Counter())[kind] += 1
        return {stack: {i: dict(sorted(kinds.items())) for i, kinds in sorted(blocks.items())}
                for stack, blocks in out.items()}

    def outside_blocks(self) -> list[dict[str, Any]]:
        """The sites no block owns (:func:`block_of`), in program order."""
        return [site for site in self.sites if block_of(site) is None]


@dataclass
class PlanReport:
    """Everything ``autotp plan`` prints; :meth:`to_json` is the ``--json`` object."""

    model: str
    architecture: str
    tp: int
    dtype: str
    batch: int
    seq_len: int
    num_layers: int | None
    #: fqn -> style, placement, shard_dim, global_shape, global_numel, local_shape, bytes_per_rank
    parameters: dict[str, dict[str, Any]]
    param_bytes_per_rank: int
    param_bytes_total: int
    forward: GraphReport
    decode: GraphReport | None
    decode_note: str | None
    kv_cache_bytes_per_rank: int | None
    kv_cache_bytes_total: int | None
    timings: dict[str, float]
    #: transformers' spelling of the plan (:func:`to_tp_plan`), None when it has none
    tp_plan: dict[str, str] | None
    overrides: dict[str, str] = field(default_factory=dict)
    #: why ``tp_plan`` is None: the parameter whose layout transformers cannot express
    tp_plan_refusal: str | None = None
    record: SolveRecord | None = field(default=None, repr=False)
    #: how the layers were planned: expanded from a shortened stand-in (``autotp/depth.py``) or at
    #: full depth, and why
    depth: str | None = None
    #: the warm-up graph, compiled first when ``(batch, seq_len)`` is not the warm-up shape
    #: ``(1, 2*tp+1)``: its free solve fixed the plan, so it is the ``forward`` that a plan at
    #: batch 1 and the default length reports (None when ``forward`` is that graph itself)
    warmup: GraphReport | None = None
    #: an encoder-decoder's first decode step, ``generate``'s first decoder call: one token per
    #: sequence into a fresh, empty cache, so each decoder block computes the cross-attention's keys
    #: and values from the encoder's output and stores them, a graph of its own (``decode`` is every
    #: later step). None for a decoder-only model (its first decode step is ``forward``, the
    #: prefill) and where no decode step was planned (``decode_note`` says why)
    first_decode: GraphReport | None = None

    @property
    def collectives(self) -> dict[str, int]:
        """Collectives of one forward (the prefill graph), by kind."""
        return self.forward.collectives

    def graph(self, name: str) -> GraphReport | None:
        """The graph called ``name``: ``forward``, ``decode``, ``warm-up`` or :data:`FIRST_DECODE`
        (None where it was not compiled)."""
        graphs = {"forward": self.forward, "decode": self.decode, "warm-up": self.warmup,
                  FIRST_DECODE: self.first_decode}
        if name not in graphs:
            raise AutoTPError(f"no graph {name!r} in a plan report: choose one of {sorted(graphs)}")
        return graphs[name]

    def block_collectives(self, graph: str = "forward") -> dict[str, dict[int, dict[str, int]]]:
        """:meth:`GraphReport.block_collectives` of the graph called ``graph`` ({} where it was not
        compiled)."""
        g = self.graph(graph)
        return g.block_collectives() if g is not None else {}

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "architecture": self.architecture, "tp": self.tp, "dtype": self.dtype,
            "batch": self.batch, "seq_len": self.seq_len, "num_layers": self.num_layers,
            "parameters": self.parameters,
            "collectives": self.forward.collectives,
            "solver": {"cost": self.forward.cost, "lower_bound": self.forward.lower_bound, "gap": self.forward.gap},
            "collective_bytes_per_rank": self.forward.collective_bytes,
            "collectives_per_block": self.block_collectives("forward"),
            "collectives_per_token": self.decode.collectives if self.decode else None,
            "collectives_per_block_per_token": self.block_collectives("decode") if self.decode else None,
            "collective_bytes_per_token_per_rank": self.decode.collective_bytes if self.decode else None,
            "decode_note": self.decode_note,
            "first_decode_step": None if self.first_decode is None else {
                "input_shape": list(self.first_decode.input_shape),
                "collectives": self.first_decode.collectives,
                "collectives_per_block": self.block_collectives(FIRST_DECODE),
                "collective_bytes_per_rank": self.first_decode.collective_bytes},
            "param_bytes_per_rank": self.param_bytes_per_rank,
            "param_bytes_total": self.param_bytes_total,
            "kv_cache_bytes_per_rank": self.kv_cache_bytes_per_rank,
            "kv_cache_bytes_total": self.kv_cache_bytes_total,
            "timings": self.timings,
            "graphs": [asdict(g) for g in (self.forward, self.first_decode, self.decode) if g is not None],
            "overrides": self.overrides,
            "tp_plan": self.tp_plan,
            "tp_plan_refusal": self.tp_plan_refusal,
            "depth": self.depth,
        }

    def to_state(self) -> dict[str, Any]:
        """Every field but the solver record, as JSON-able values (the report cache's entry)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "record"}
        state["forward"] = asdict(self.forward)
        state["decode"] = asdict(self.decode) if self.decode is not None else None
        state["warmup"] = asdict(self.warmup) if self.warmup is not None else None
        state["first_decode"] = asdict(self.first_decode) if self.first_decode is not None else None
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PlanReport:
        graphs = {key: GraphReport.from_state(state[key]) if state.get(key) is not None else None
                  for key in ("decode", "warmup", "first_decode")}
        return cls(**{**state, "forward": GraphReport.from_state(state["forward"]), **graphs})

    #: what :meth:`to_json` holds about how the plan was computed rather than what it is
    COMPUTATION = ("timings", "solver", "depth")
    COMPUTATION_PER_GRAPH = ("timings", "cost", "lower_bound", "extra_cost_of_overrides")

    def plan_json(self) -> dict[str, Any]:
        """:meth:`to_json` less how the plan was computed (timings, the solver's cost and
        certificate, ``depth``): what a stand-in's expanded report and the full-depth one share
        (``autotp/depth.py``)."""
        out = self.to_json()
        for key in self.COMPUTATION:
            out.pop(key)
        for graph in out["graphs"]:
            for key in self.COMPUTATION_PER_GRAPH:
                graph.pop(key)
        return out

    def transformers_tp_plan(self) -> dict[str, str]:
        """``tp_plan``, or the :class:`AutoTPError` that says why transformers cannot express it."""
        if self.tp_plan is None:
            raise AutoTPError(f"no transformers tp_plan for this plan: {self.tp_plan_refusal}")
        return self.tp_plan
