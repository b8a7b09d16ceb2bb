"""Propagate: plan a graph whose parameters are all pinned by the exact frontier, without a beam.

When an earlier graph fixed every parameter's storage placement (a decode step after the warm-up
graph, a training graph after ``parallelize_model``'s warm-up, sequence parallelism's solve with
every parameter pinned where the first stored it), the weights decide most of the plan: a
column-parallel weight makes its matmul's output a shard, a row-parallel one makes it ``Partial``,
and what is left to choose is where each ``Partial`` is reduced and which activations travel
sharded. :func:`plan_pinned` runs the search of :mod:`autotp.passes.solve` (same steps, rules,
costs, tie-breaks, repeated-block replay) with every *dominated* state dropped after every step
and no beam, with a tighter dominance than the search's (still exact, :class:`_Propagation`). Each
step keeps at most ``max_states`` states, so the time is ``O(V * max_states^2 * C)`` for ``V`` ATen
nodes and ``C`` candidates per node: linear in the graph size for a fixed ``max_states``. A step
whose non-dominated states outnumber ``max_states`` is a choice propagation cannot settle: it
stops there (:class:`Unsettled`) and the graph is planned by the beam search, as without it.

Guaranteed, where it settles (``PropagationReport.settled``): no state was dropped except
dominated ones, so the plan is an optimum of the solver's objective up to the collective-free
narrows' tie-breaker (``NARROW_EPSILON``): ``Solution.gap`` is 0, it never costs more than the
beam search's plan, and every parameter keeps its pinned placement. Tested
(``tests/unit/test_propagate.py``): on the tiny Llama's and Qwen2's pinned graphs at tp=2, plain
and sequence-parallel, a settled plan costs what the beam search's costs and issues the same
collectives.

Not guaranteed, and why the backend does not call it: that it is fast. The non-dominated frontier
of a pinned graph is not a handful of states: states differ in placements no later edge can move
(an op's output inside a Dynamo node), which dominance cannot compare. Measured on a 2-layer
hidden-256 Llama at tp=2: the decode step settles at 192 states in 1.5 s where the beam search
takes 0.7 s; the pinned prefill outgrows 256 states (the search: 1.0 s); its sequence-parallel
solves settle with the search's placements in 1.04 / 1.28 / 0.40 s against 0.36 / 0.53 / 0.35 s
(warm-up, 16-token prefill, decode step). It is an exact reference
for pinned plans (a certificate the beam search's own bound does not give), not a faster planner.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch.fx

from autotp.ops.registry import TensorSpec
from autotp.passes.decompose import ShadowGraph
from autotp.passes.solve import (
    NARROW_EPSILON,
    Pending,
    Solution,
    SolverOptions,
    _Search,
    edge_cost,
    edge_targets,
    solve,
)
from autotp.placement import Placement

#: the most non-dominated states one step may keep before propagation gives up (the beam search's
#: default width: a frontier that wide is what the search is for)
MAX_STATES = 32


class Unsettled(Exception):
    """A step left more non-dominated states than propagation keeps: the beam search decides."""


@dataclass
class PropagationReport:
    """How a pinned graph was planned (in the trace summary as ``propagation``)."""

    #: True: propagated (optimal, see the module docstring); False: planned by the beam search
    settled: bool
    #: the most states one step made while propagating (before its dominated ones were dropped)
    max_states: int = 0
    #: why propagation did not settle (the step that outgrew ``max_states``), else ""
    reason: str = ""
    #: seconds spent propagating (including a propagation that gave up)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Propagation(_Search):
    """The frontier DP with exact (dominance) pruning after every step and no beam.

    Dominance is the search's (:meth:`_Search.dominates`) with a tighter, still exact, bound of what
    following the other state's plan costs more (:meth:`conversion`): a value read by ``k`` more
    edges is redistributed to at most ``k`` placements by any plan, so only the ``k`` largest
    differences count, not the sum over every placement it could reach (a pending edge is resolved
    once, by its first consumer: ``k = 1``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.here = -1  # position of the step being advanced
        #: value -> positions of the edges that read it (a Dynamo-node output's later redistributions)
        self.edge_positions: dict[int, list[int]] = {}
        for k, s in enumerate(self.steps):
            if s.kind == "edge" and s.inputs:
                self.edge_positions.setdefault(s.inputs[0], []).append(k)
        self.bounded: dict[tuple, float] = {}

    def advance(self, step: Any, states: dict) -> dict:
        self.here = self.position[step.index]
        out = super().advance(step, states)  # prunes (dominance, then the beam) above max_states
        if self.trace.pruned_states:
            raise Unsettled(f"{len(states)} states met {step.node.name} ({step.node.target}) from Dynamo "
                            f"node {step.owner} and left more than {self.opts.beam_width} non-dominated ones")
        if len(out) > 1:
            out = self.prune(out)  # at most max_states: dominance only, nothing of the beam
        return out

    def dominates(self, a: Any, cost_a: float, b: Any, cost_b: float, loose: list[int] | None = None) -> bool:
        """:meth:`_Search.dominates`, except that placements ``b`` holds ready and ``a`` does not are
        no reason to keep ``b``: ``a`` can make each ready at the cost of that one redistribution
        (counted against the slack), as it would at the edge that reads it."""
        (live_a, ready_a), (_, ready_b) = a, b
        extra = ready_b - ready_a
        if not extra:
            return super().dominates(a, cost_a, b, cost_b, loose)
        placed = dict(live_a)
        owed = 0.0
        for m, q in extra:
            p = placed.get(m)
            spec = self.spec_of.get(m)
            if not isinstance(p, Placement) or not isinstance(spec, TensorSpec) \
                    or q not in edge_targets(p, spec, self.opts.world_size, self.opts.kv_groups):
                return False
            owed += self.free_of_narrow(edge_cost(p, q, spec, self.opts))
        if cost_a + owed > cost_b:
            return False
        return super().dominates((live_a, ready_a | extra), cost_a + owed, b, cost_b, loose)

    @staticmethod
    def free_of_narrow(cost: float) -> float:
        """A collective-free narrow costs ``NARROW_EPSILON``, a tie-breaker, not communication: 0 here."""
        return 0.0 if cost <= NARROW_EPSILON else cost

    def conversion(self, j: int, pa: Any, pb: Any) -> float:
        """What a plan from ``pa`` pays more than one from ``pb`` for value ``j``: the ``k`` largest
        ``max(0, cost(pa -> q) - cost(pb -> q))`` over the placements ``q`` ``pb`` reaches, ``k`` the
        edges still to read ``j`` (1 for a pending edge); ``inf`` where ``pa`` cannot reach a ``q``."""
        if isinstance(pa, Pending) or isinstance(pb, Pending):
            k = 1
        else:
            k = max(1, sum(1 for pos in self.edge_positions.get(j, ()) if pos > self.here))
        key = (j, pa, pb, k)
        cached = self.bounded.get(key)
        if cached is not None:
            return cached
        spec = self.spec_of.get(j)
        src_a, free_a = (pa.src, pa.ready | {pa.src}) if isinstance(pa, Pending) else (pa, frozenset([pa]))
        src_b, free_b = (pb.src, pb.ready | {pb.src}) if isinstance(pb, Pending) else (pb, frozenset([pb]))
        if not isinstance(spec, TensorSpec) or not isinstance(src_a, Placement) or not isinstance(src_b, Placement):
            total = float("inf")
        else:
            world, groups = self.opts.world_size, self.opts.kv_groups
            reach_a = set(edge_targets(src_a, spec, world, groups))
            extra = []
            for q in set(edge_targets(src_b, spec, world, groups)) | free_b:
                cost_b = 0.0 if q in free_b else edge_cost(src_b, q, spec, self.opts)
                cost_a = 0.0 if q in free_a else edge_cost(src_a, q, spec, self.opts) if q in reach_a else float("inf")
                extra.append(max(0.0, self.free_of_narrow(cost_a) - cost_b))
            total = sum(sorted(extra, reverse=True)[:k])
        self.bounded[key] = total
        return total


def plan_pinned(shadow: ShadowGraph, opts: SolverOptions, fixed: dict[torch.fx.Node, Placement],
                param_nodes: set[torch.fx.Node], max_states: int = MAX_STATES) -> tuple[Solution, PropagationReport]:
    """Plan ``shadow`` with every parameter in ``param_nodes`` pinned in ``fixed``: by propagation
    where it settles, else by :func:`~autotp.passes.solve.solve` (see the module docstring)."""
    missing = [n.name for n in param_nodes if n not in fixed]
    if missing:
        raise ValueError(f"plan_pinned needs every parameter pinned; free: {missing[:5]}")
    t = time.perf_counter()
    try:
        solution = solve(shadow, dataclasses.replace(opts, beam_width=max_states, exact=False), fixed, {},
                         param_nodes, search=_Propagation)
    except Unsettled as e:
        report = PropagationReport(False, reason=str(e), seconds=time.perf_counter() - t)
        return solve(shadow, opts, fixed, {}, param_nodes), report
    return solution, PropagationReport(True, solution.trace.max_states, seconds=time.perf_counter() - t)
