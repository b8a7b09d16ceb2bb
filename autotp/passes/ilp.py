"""The solver's objective as an integer linear program: a lower bound of the optimum, and the optimum.

The beam (:func:`autotp.passes.solve.solve`) minimizes one scalar over every plan the rules allow.
:func:`certify` writes the same choices and the same costs as a 0/1 program and hands it to HiGHS
(``scipy.optimize.linprog`` for its LP relaxation, ``milp`` for the integer program). Every cost
and every candidate comes from the solver's own functions (``_Search.rule``, ``edge_targets``,
``edge_cost``, ``_Search.internal_cost``, ``_Search.activation_cost``, the priced ``ParamChoice``
options): the program holds no cost formula of its own.

Formulation, over the solver's steps (its inputs, ``_Search``):

* ``x[v, p]``: value ``v`` (a step's output, a placeholder, a free parameter) has placement ``p``;
  one per value, over the placements it can reach (computed forward in schedule order from the
  pinned placeholders and the parameters' options). A free parameter's ``x`` costs its option's
  priced memory (the objective's tiers 1 and 3).
* ``s[n, k]``: op ``n`` reads its distinct inputs in the placements of combination ``k`` and takes
  one candidate the rule returns for them, at ``internal_cost + activation_cost``; enumerated by
  calling the rule on every combination of its inputs' reachable placements. For each input and
  placement, the strategies that read the input in that placement sum to its ``x`` (so exactly one
  strategy runs), and those that give output ``o`` sum to ``x[n, o]``. A combination with no
  candidate has no strategy: the program forbids exactly the partial plans the beam abandons.
  Where one input decides the combination (every other input has one placement, so its ``x`` is 1)
  and its placement ``p`` has exactly one candidate, that strategy runs exactly when ``x[input, p]``
  is 1: it is no column of its own, its cost is added to ``x[input, p]``'s (HiGHS's presolve
  removes such columns too; folded here, they are neither built nor handed over); likewise an
  edge's move that is the only one from ``p``. The rows of the inputs with one placement are left out:
  the other rows imply them.
* an edge (a tensor crossing a Dynamo-node boundary) ``e`` from value ``m``: ``t[e, p, q]`` moves it
  from ``p`` to ``q`` (``edge_targets``; ``q = p`` free), with marginals ``x[m, p]`` and
  ``x[e, q]``. The collective is paid once per value and redistribution however many edges ask for
  it (the rewrite shares it): on ``t`` where one edge reads ``m``, else on a column
  ``y[m, p, q] >= t[e, p, q]`` of every edge ``e`` of ``m``. A parameter's edge and an
  in-place edge keep the value's placement; a graph output must be ``R`` (or keep its shard with
  ``SolverOptions.sharded_outputs``); a mark copies its input, a getitem takes its item.

Faithfulness. Every plan the beam can return is a solution of the program, at the same cost or
less: the beam also pays a shared redistribution once, but only while the producer is live and only
for an edge scheduled after the first one is resolved, and a graph-output gather never shares
(``_Search.edge_options``); the program shares always. So the program's optimum, and its LP
relaxation's, are lower bounds of the beam's objective over all plans: where either reaches the
beam's cost (within ``TIE``), the plan is optimal, proved. Tested against exhaustive search on small
graphs (tests/unit/test_solver.py): the integer program's optimum is the exhaustive optimum, also
where the beam misses it. The program does not rebuild a plan: it certifies or bounds the beam's.
The bound is HiGHS's floating-point optimum, exact up to its tolerances (1e-7 on feasibility; on the
real-width matrix the LP optimum and the beam's cost agree within 1e-6, of costs near 1e5).
What it cannot express it refuses (``Certificate.reason``): an op with more than
``MAX_COMBINATIONS`` combinations of input placements, a free parameter an op reads without an
edge, an edge without a producer.

Size and cost: one column per reachable (value, placement) and per (op, input combination,
candidate) and (edge, move) that is not one of those single choices; the rule calls are those the
beam already cached, mostly, and each distinct edge move is priced once. The relaxation goes
through ``scipy.optimize.linprog`` (HiGHS's simplex, as ``milp`` with no integers, with less of
scipy's per-column work around it). Measured in process CPU, best of 5, on a loaded 2-core machine
(benchmarks/certificate_gap.py has the matrix): at 2 layers of Gemma-2-9B's widths, tp=2: 2,742
columns and 1,913 rows, 0.014 s to build and 0.027 s in HiGHS (it was 3,634 and 2,854, 0.027 s and
0.039 s, before the single choices were folded in and the moves priced once; the beam takes
~0.45 s); the integer program, where the LP leaves a gap, ~0.08 s. It grows with the graph, not
with the number of distinct blocks: 40 Llama layers of hidden 64 at tp=2, whole graph: 41,274
columns, 0.22 s to build and 0.75 s in HiGHS, against the beam's 1.3 s (the beam replays repeated
blocks; this program does not).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import LinearConstraint, linprog, milp
from scipy.sparse import coo_array

from autotp.passes.solve import _Search, edge_cost, edge_targets
from autotp.placement import GroupedShard, HeadShard, Placement, R, Shard, StridedShard

#: the most input combinations one op's rule is called on; past it the program is not built
MAX_COMBINATIONS = 20_000


@dataclass
class Certificate:
    """What :func:`certify` found: ``bound``, a lower bound of the optimum (``-inf``: none);
    ``optimal``: whether HiGHS proved the program's optimum (then ``bound`` is it); the program's
    size and the seconds spent building and solving it; ``reason`` where it was not solved."""

    bound: float = float("-inf")
    optimal: bool = False
    relaxed: bool = False
    variables: int = 0
    constraints: int = 0
    build_s: float = 0.0
    solve_s: float = 0.0
    reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


class _Program:
    """Columns (0/1 variables with a cost) and sparse rows ``lower <= sum(val * column) <= upper``,
    collected as flat lists and handed to HiGHS as one sparse matrix."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def var(self, cost: float = 0.0) -> int:
        self.cost.append(cost)
        return len(self.cost) - 1

    def row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        r = len(self.lower)
        self.rows.extend([r] * len(terms))
        for col, val in terms:
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lower)
        self.upper.append(upper)

    def sum_row(self, total: int | None, cols: list[int], rhs: float = 0.0) -> None:
        """``sum(cols) - total == rhs`` (no ``total``: ``sum(cols) == rhs``)."""
        r = len(self.lower)
        if total is not None:
            self.cols.append(total)
            self.vals.append(-1.0)
        self.cols.extend(cols)
        self.vals.extend([1.0] * len(cols))
        self.rows.extend([r] * (len(cols) + (total is not None)))
        self.lower.append(rhs)
        self.upper.append(rhs)


class _Unsupported(Exception):  # noqa: N818 (control flow: the program cannot be built)
    pass


def _build(search: _Search) -> tuple[_Program, dict[str, int]]:
    prog = _Program()
    opts = search.opts
    cost = prog.cost
    x: dict[int, dict[Any, int]] = {}  # value -> placement -> column

    def values(j: int, reading_edge: bool = False) -> dict[Any, int]:
        if j not in x:
            if j in search.free and not reading_edge:  # the beam reads it as unplaced (None)
                raise _Unsupported(f"parameter {j} is read by an op, not through an edge")
            if j in search.free:
                x[j] = {p: prog.var(m) for p, m in search.free[j].options}
            elif j in search.fixed:
                x[j] = {search.fixed[j]: prog.var()}
            else:
                raise _Unsupported(f"value {j} is read before it is placed")
            prog.sum_row(None, list(x[j].values()), 1.0)
        return x[j]

    def define(j: int, groups: dict[Any, list[int]]) -> None:
        """``x[j, p] = sum(groups[p])``: the placement of ``j`` is what those columns give (the
        column itself where there is one)."""
        x[j] = out = {}
        for p, cols in groups.items():
            if len(cols) == 1:
                out[p] = cols[0]
            else:
                out[p] = col = prog.var()
                prog.sum_row(col, cols)

    priced: dict[tuple, dict[Any, float]] = {}

    def moves_from(p: Placement, spec: Any, output: bool) -> dict[Any, float]:
        """Where an edge of ``spec`` may move ``p`` and at what cost (computed once per distinct
        edge: repeated blocks repeat their edges)."""
        key = (p, spec, output)
        try:
            return priced[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable spec (a constant's values): not kept
            key = None
        if output:
            moves = {}
            if not isinstance(p, StridedShard):
                moves[R] = edge_cost(p, R, spec, opts)
                if opts.sharded_outputs and isinstance(p, (Shard, GroupedShard, HeadShard)):
                    moves[p] = 0.0
        else:
            moves = {q: edge_cost(p, q, spec, opts) for q in edge_targets(p, spec, opts.world_size, opts.kv_groups)}
        if key is not None:
            priced[key] = moves
        return moves

    # values redistributed by more than one edge: their collectives are columns of their own, shared
    moved: dict[int, int] = {}
    for step in search.steps:
        if step.kind == "edge" and step.inputs:
            moved[step.inputs[0]] = moved.get(step.inputs[0], 0) + 1

    copies: dict[tuple, int] = {}  # (value, p, q, cost) -> the shared collective's column
    first_edge: set[int] = set()
    combinations = 0
    for step in search.steps:
        j = step.index
        if step.kind == "mark":
            x[j] = values(step.inputs[0])
        elif step.kind == "getitem":
            groups: dict[Any, list[int]] = {}
            for p, c in values(step.inputs[0]).items():
                groups.setdefault(p[step.node.args[1]] if isinstance(p, tuple) else p, []).append(c)
            define(j, groups)
        elif step.kind == "edge":
            if not step.inputs:
                raise _Unsupported(f"edge {step.node.name} has no producer")
            m = step.inputs[0]
            src = values(m, reading_edge=True)
            here = search.position[j]
            if m in search.params:  # never redistributed; an output edge that decides it keeps it R
                if step.is_output_edge and m in search.free and m not in first_edge:
                    prog.row([(c, 1.0) for p, c in src.items() if p != R], 0.0, 0.0)
                first_edge.add(m)
                x[j] = src
                continue
            if j in search.pinned_edges or step.spec is None or (
                    not step.is_output_edge and search.last_use.get(j, -1) <= here):
                x[j] = src
                continue
            shared = moved[m] > 1
            groups = {}
            for p, c in src.items():
                if not isinstance(p, Placement):
                    raise _Unsupported(f"edge {step.node.name} moves a {p!r}")
                moves = moves_from(p, step.spec, step.is_output_edge)
                if not moves:  # p cannot leave the graph: x[m, p] = 0
                    prog.sum_row(None, [c])
                    continue
                if len(moves) == 1:  # the move is taken exactly where m has p: its column is x[m, p]
                    (q, price), = moves.items()
                    t = {q: c}
                    if not shared:
                        cost[c] += price
                else:
                    t = {q: prog.var(0.0 if shared else price) for q, price in moves.items()}
                    prog.sum_row(c, list(t.values()))
                for q, col in t.items():
                    groups.setdefault(q, []).append(col)
                    if shared and p != q and moves[q] > 0.0:
                        key = (m, p, q, moves[q])
                        if key not in copies:
                            copies[key] = prog.var(moves[q])
                        prog.row([(col, 1.0), (copies[key], -1.0)], -np.inf, 0.0)
            define(j, groups)
        else:  # an op: one strategy per combination of its inputs' placements and candidate
            distinct = list(dict.fromkeys(step.inputs))
            domains = [values(i) for i in distinct]
            varying = [k for k, d in enumerate(domains) if len(d) > 1]
            groups = {}
            if step.inputs and len(varying) <= 1:
                # one input decides the combination (the others have one placement each, x = 1):
                # a strategy's column is x[lead, p] itself where p has one candidate
                lead = varying[0] if varying else 0
                placed = [next(iter(d)) for d in domains]
                combinations += len(domains[lead])
                for p, c in domains[lead].items():
                    placed[lead] = p
                    by_input = dict(zip(distinct, placed, strict=True))
                    cands = search.rule(step, tuple(by_input[i] for i in step.inputs))
                    if len(cands) == 1:
                        cost[c] += search.internal_cost(cands[0]) + search.activation_cost(step, cands[0].output)
                        groups.setdefault(cands[0].output, []).append(c)
                        continue
                    cols = []
                    for cand in cands:
                        cols.append(col := prog.var(search.internal_cost(cand) + search.activation_cost(step, cand.output)))
                        groups.setdefault(cand.output, []).append(col)
                    prog.sum_row(c, cols)
                define(j, groups)
                continue
            size = int(np.prod([len(d) for d in domains])) if domains else 1
            if size > MAX_COMBINATIONS:
                raise _Unsupported(f"op {step.node.name} has {size} input combinations")
            combinations += size
            reads: dict[tuple[int, Any], list[int]] = {}
            items = [list(d.items()) for d in domains]
            for combo in itertools.product(*items):
                placed = {i: p for i, (p, _) in zip(distinct, combo, strict=True)}
                for cand in search.rule(step, tuple(placed[i] for i in step.inputs)):
                    col = prog.var(search.internal_cost(cand) + search.activation_cost(step, cand.output))
                    groups.setdefault(cand.output, []).append(col)
                    for i, (p, _) in zip(distinct, combo, strict=True):
                        reads.setdefault((i, p), []).append(col)
            for i, domain in zip(distinct, domains, strict=True):
                for p, c in domain.items():
                    prog.sum_row(c, reads.get((i, p), []))
            if not step.inputs:
                prog.sum_row(None, [col for cols in groups.values() for col in cols], 1.0)
            define(j, groups)
    return prog, {"values": len(x), "copies": len(copies), "combinations": combinations}


def certify(search: _Search, relax: bool = False, time_limit: float | None = None) -> Certificate:
    """A lower bound of the optimum of the objective ``search`` (a :class:`_Search` the beam ran)
    minimizes: the program's optimum, or (``relax``) its LP relaxation's. See the module docstring."""
    out = Certificate(relaxed=relax)
    start = time.process_time()
    try:
        prog, out.stats = _build(search)
    except _Unsupported as why:
        out.reason = str(why)
        out.build_s = time.process_time() - start
        return out
    n = len(prog.cost)
    matrix = coo_array((prog.vals, (prog.rows, prog.cols)), shape=(len(prog.lower), n)).tocsr()
    cost, lower, upper = np.asarray(prog.cost), np.asarray(prog.lower), np.asarray(prog.upper)
    out.variables, out.constraints = n, len(prog.lower)
    out.build_s = time.process_time() - start
    start = time.process_time()
    if relax:  # linprog: the same HiGHS, with less of scipy's per-column work around it than milp
        equal = lower == upper  # every other row is ``-inf <= row <= upper``
        bounded = None if equal.all() else (matrix[~equal], upper[~equal])
        result = linprog(cost, *(bounded or (None, None)), A_eq=matrix[equal], b_eq=lower[equal],
                         bounds=(0.0, 1.0), method="highs")
    else:
        options: dict[str, Any] = {"mip_rel_gap": 0.0}
        if time_limit is not None:
            options["time_limit"] = time_limit
        result = milp(cost, constraints=LinearConstraint(matrix, lower, upper), integrality=np.ones(n),
                      bounds=(0.0, 1.0), options=options)
    out.solve_s = time.process_time() - start
    dual = getattr(result, "mip_dual_bound", None)  # what HiGHS proved (the same as fun when optimal)
    dual = float(dual) if dual is not None and np.isfinite(dual) and not relax else None
    if result.status == 0:
        out.bound, out.optimal = float(result.fun) if dual is None else min(float(result.fun), dual), True
    elif dual is not None:
        out.bound = dual
    out.reason = result.message
    return out
