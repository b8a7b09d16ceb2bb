"""Pinned graphs: a graph whose parameters an earlier graph placed.

Propagation (``autotp/passes/propagate.py``) plans such a graph by the exact frontier (dominance
pruning only, no beam); where it settles, its plan costs what the beam search's costs and issues
the same collectives, on the tiny models' pinned decode graphs at tp=2 and on their
sequence-parallel solves. Sequence parallelism solves a pinned graph once, not twice (the first,
pure-communication solve decided nothing the second reads). In one process on the meta device
(``plan_model``); costs compared within the solver's tie tolerance.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

import autotp.backend as backend
from autotp.collectives import kind_of
from autotp.passes.decompose import EDGE
from autotp.passes.propagate import plan_pinned
from autotp.passes.solve import LATENCY_BYTES, TIE, Solution, solve
from tests._tiny import tiny_config

#: a frontier this wide settles the tiny models' pinned decode graphs (at most 192 states at once)
STATES = 512


def _pinned_solves(monkeypatch: pytest.MonkeyPatch, arch: str, sequence_parallel: bool) -> list[tuple]:
    """Every solve ``plan_model`` runs for the tiny ``arch`` at tp=2 (warm-up, prefill, decode step),
    as ``(shadow, opts, fixed, free, param_nodes, solution)``."""
    from autotp.planner import plan_model

    calls: list[tuple] = []
    original = backend.solve

    def recording(shadow: Any, opts: Any, fixed: Any, free: Any, param_nodes: Any) -> Solution:
        solution = original(shadow, opts, fixed, free, param_nodes)
        calls.append((shadow, opts, fixed, free, param_nodes, solution))
        return solution

    monkeypatch.setattr(backend, "solve", recording)
    plan_model(tiny_config(arch), 2, seq_len=8, sequence_parallel=sequence_parallel, full_depth=True)
    return calls


def _collectives(solution: Solution) -> Counter:
    """The collectives a plan puts on the shadow graph's edges, by kind."""
    counts: Counter = Counter()
    for node, placement in solution.placements.items():
        if node.target is EDGE and node.args and node.args[0] in solution.placements:
            kind = kind_of(solution.placements[node.args[0]], placement)
            if kind is not None:
                counts[kind] += 1
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_a_settled_propagation_plans_a_pinned_graph_as_the_search_does(monkeypatch: pytest.MonkeyPatch, arch: str,
                                                                       sequence_parallel: bool) -> None:
    pinned = [c for c in _pinned_solves(monkeypatch, arch, sequence_parallel) if not c[3]]
    assert pinned, "the decode step (and, with sequence parallelism, every second solve) is pinned"
    settled = 0
    for shadow, opts, fixed, _, param_nodes, searched in pinned:
        propagated, report = plan_pinned(shadow, opts, fixed, param_nodes, max_states=STATES)
        assert propagated.cost <= searched.cost + TIE * max(1.0, searched.cost)  # never costlier
        if report.settled:
            settled += 1
            assert propagated.cost == pytest.approx(searched.cost, rel=TIE)
            assert propagated.gap == 0
            assert _collectives(propagated) == _collectives(searched)
        else:  # the search decided, as before
            assert propagated.cost == searched.cost
        for node in param_nodes:  # nothing pinned moved
            assert propagated.placements[node] == fixed[node]
    assert settled, "propagation settled no pinned graph"


def test_sequence_parallelism_solves_a_pinned_graph_once_with_the_plan_of_two_solves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = [c for c in _pinned_solves(monkeypatch, "llama", True) if not c[3]]
    assert pinned and all(c[1].activation_weight > 0 for c in pinned)  # only the sequence-parallel solve ran
    for shadow, sp_opts, fixed, _, param_nodes, once in pinned:
        # the pure-communication solve this graph had before, then the sequence-parallel one
        plain = dataclasses.replace(sp_opts, activation_weight=0.0, latency_bytes=LATENCY_BYTES,
                                    shard_symbolic_dims=False)
        first = solve(shadow, plain, fixed, {}, param_nodes)
        twice, _ = backend._sequence_parallel(shadow, plain, fixed, first, param_nodes)
        assert twice.cost == once.cost
        assert {n.name: str(p) for n, p in twice.placements.items()} == \
            {n.name: str(p) for n, p in once.placements.items()}
