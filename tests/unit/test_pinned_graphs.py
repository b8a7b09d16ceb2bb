"""Pinned graphs: a graph whose parameters an earlier graph placed.

Sequence parallelism solves a pinned graph once, not twice (the first, pure-communication solve
decided nothing the second reads): the plan equals the two solves' exactly. In one process on the
meta device (``plan_model``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import autotp.backend as backend
from autotp.passes.solve import LATENCY_BYTES, Solution, solve
from tests._tiny import tiny_config


def _solves(monkeypatch: pytest.MonkeyPatch, config: Any, **options: Any) -> list[tuple]:
    """Every solve ``plan_model(config, 2, **options)`` runs (warm-up, prefill, decode step), as
    ``(shadow, opts, fixed, free, param_nodes, solution)``."""
    from autotp.planner import plan_model

    calls: list[tuple] = []
    original = backend.solve

    def recording(shadow: Any, opts: Any, fixed: Any, free: Any, param_nodes: Any) -> Solution:
        solution = original(shadow, opts, fixed, free, param_nodes)
        calls.append((shadow, opts, fixed, free, param_nodes, solution))
        return solution

    monkeypatch.setattr(backend, "solve", recording)
    plan_model(config, 2, **options)
    return calls


def test_sequence_parallelism_solves_a_pinned_graph_once_with_the_plan_of_two_solves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    solves = _solves(monkeypatch, tiny_config("llama"), seq_len=8, sequence_parallel=True, full_depth=True)
    pinned = [c for c in solves if not c[3]]
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


def test_a_pinned_decode_graph_replays_its_blocks_with_the_plan_of_the_search_that_replays_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step of a 4-layer Llama has every parameter pinned by the prefill. Its search
    compares states that hold a value ready differently (``_Search.dominates``), so the blocks after
    the first reach the same frontier and replay (``reused_nodes``); the search that does not
    compare them keeps two frontier states whose costs drift apart block by block, replays nothing,
    and returns the same plan: same cost, placements and local rewrites."""
    import autotp.passes.solve as solve_module

    pinned = [c for c in _solves(monkeypatch, tiny_config("llama", num_hidden_layers=4), full_depth=True) if not c[3]]
    assert len(pinned) == 1  # the decode step
    shadow, opts, fixed, free, param_nodes, replayed = pinned[0]
    assert replayed.trace.reused_nodes > 0

    init = solve_module._Search.__init__

    def without_ready_dominance(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.pinned = False

    monkeypatch.setattr(solve_module._Search, "__init__", without_ready_dominance)
    searched = solve(shadow, opts, fixed, free, param_nodes)
    assert searched.trace.reused_nodes == 0
    assert replayed.cost == searched.cost
    assert {n.name: str(p) for n, p in replayed.placements.items()} == \
        {n.name: str(p) for n, p in searched.placements.items()}
    assert {n.name: t for n, t in replayed.local.items()} == {n.name: t for n, t in searched.local.items()}


def test_a_prefill_replays_its_blocks_once_states_that_differ_by_local_copies_alone_are_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill of a 4-layer Llama (every parameter free) carries, into each block, states that
    equal a cheaper one but for a copy of a value paid for earlier (the rotary tables narrowed to
    heads) that the cheaper one can make by a local narrow. At a block boundary the solver drops
    them (``_Search.without_local_copies``), so the later blocks meet the frontier an earlier block
    met and replay (``reused_nodes``); the search that keeps them, whose costs drift block by block,
    replays nothing and returns the same plan: same placements and local rewrites, the same cost
    up to float summation order (a replayed block adds its costs as one delta)."""
    import autotp.passes.solve as solve_module

    solves = _solves(monkeypatch, tiny_config("llama", num_hidden_layers=4), full_depth=True)
    prefill = [c for c in solves if c[3]]
    assert len(prefill) == 1
    shadow, opts, fixed, free, param_nodes, replayed = prefill[0]
    assert replayed.trace.reused_nodes > 0

    monkeypatch.setattr(solve_module._Search, "without_local_copies", lambda self, states: states)
    searched = solve(shadow, opts, fixed, free, param_nodes)
    assert searched.trace.reused_nodes == 0
    assert replayed.cost == pytest.approx(searched.cost, rel=solve_module.TIE)
    assert {n.name: str(p) for n, p in replayed.placements.items()} == \
        {n.name: str(p) for n, p in searched.placements.items()}
    assert {n.name: t for n, t in replayed.local.items()} == {n.name: t for n, t in searched.local.items()}
