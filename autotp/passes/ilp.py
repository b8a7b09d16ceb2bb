"""The solver's objective as an integer linear program: a lower bound of the optimum, and the optimum.

The beam (:func:`autotp.passes.solve.solve`) minimizes one scalar over every plan the rules allow.
:func:`certify` writes the same choices and the same costs as a 0/1 program and hands it to HiGHS
(its LP relaxation to the dual simplex through scipy's bindings, :func:`autotp.compat.highs_lp`, or
``scipy.optimize.linprog`` where those are missing; the integer program to ``milp``). Every cost
and every candidate comes from the solver's own functions (``_Search.rule``, ``edge_targets``,
``edge_cost``, ``_Search.internal_cost``, ``_Search.activation_cost``, the priced ``ParamChoice``
options): the program holds no cost formula of its own.

Formulation, over the solver's steps (its inputs, ``_Search``):

* ``x[v, p]``: value ``v`` (a step's output, a placeholder, a free parameter) has placement ``p``;
  one per value, over the placements it can reach (computed forward in schedule order from the
  pinned placeholders and the parameters' options). A free parameter's ``x`` is a column that costs
  its option's priced memory (the objective's tiers 1 and 3). Any other ``x`` is no column of its
  own: it is the sum of the columns below that give ``v`` placement ``p`` (its producer's
  strategies, its edge's moves), and every row that names ``x[v, p]`` names those columns (a
  column and an equality row per value and placement less: 107 of 543 columns at BERT's widths, tp=4,
  batch 2). Where ``v`` has one placement (a pinned placeholder, a parameter with one option)
  ``x[v, p]`` is the constant 1 (``ONE``): it moves to the rows' bounds, and its cost to the
  objective's constant. No ``x`` needs a bound of its own: each op's strategies sum to any one
  input's ``x`` and each edge's moves to its source's, so a value's columns sum to 1.
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

Size and cost: one column per free parameter's option and per (op, input combination, candidate)
and (edge, move) that is not one of those single choices; the rule calls are those the beam already
cached, mostly (14 of 401 are new at BERT's widths, tp=4, batch 2), and each distinct edge move is
priced once. HiGHS solves the relaxation with its dual simplex and no presolve, called through
scipy's bindings (:func:`autotp.compat.highs_lp`): ``linprog``'s wrapper walks the basis column by
column in Python, and on these programs HiGHS's presolve costs more than it removes; the two were
half the certificate on the smallest graphs. Measured in process CPU, median of 100 builds and
solves of the same inputs in one process, on a loaded 2-core machine, before -> after the ``x``
became sums and HiGHS was called directly: BERT's widths at tp=4, batch 2 (the matrix's smallest
solve, ~0.035 s): 543 -> 391 columns, 406 -> 254 rows, 7.4 -> 3.7 ms (build 3.0 -> 2.2, HiGHS
4.3 -> 1.4; the build is ~1.5 ms since single-input steps skip the per-input bookkeeping); 2 layers
of Gemma-2-9B's widths at tp=4 (median of 3): 2,698 -> 2,152 columns, 41 -> 28 ms (HiGHS 32 ->
9); the beam takes ~0.45 s. The integer program, where the LP leaves a gap, ~0.08 s. It grows with
the graph, not with the number of distinct blocks: 40 Llama layers of hidden 64 at tp=2, whole
graph: 39,792 -> 32,197 columns, 0.16 -> 0.13 s to build and 0.48 -> 0.30 s in HiGHS, against the
beam's ~1.3 s (the beam replays repeated blocks; this program does not). In the solver, on the
real-width matrix (``benchmarks/certificate_gap.py``, a machine at load 4-12, commit 9b25bd2) the
certificate is 4.0-10.9% of the solve's CPU, median 5.5% (it was 7.7-19.5%, median 10%, before).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import LinearConstraint, linprog, milp
from scipy.sparse import csr_array

from autotp.compat import highs_lp
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


#: the constant 1 in a column list: the placement of a value with one placement (no column)
ONE = -1


class _Program:
    """Columns (0/1 variables with a cost), a constant ``offset`` of the objective, and sparse rows
    ``lower <= sum(val * column) <= upper``, collected as flat lists (row ``r``'s terms are
    ``cols[starts[r]:starts[r + 1]]``, no column twice) and handed to HiGHS as one sparse matrix. A
    row is written over column lists, each standing for the sum of its columns (``ONE`` in one: the
    constant 1, moved to the row's bounds or the offset)."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.offset = 0.0
        self.starts: list[int] = [0]
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def var(self, cost: float = 0.0) -> int:
        self.cost.append(cost)
        return len(self.cost) - 1

    def pay(self, cols: list[int], price: float) -> None:
        """Add ``price`` to the cost of ``sum(cols)``."""
        cost = self.cost
        for col in cols:
            if col == ONE:
                self.offset += price
            else:
                cost[col] += price

    def row(self, plus: list[int], minus: list[int] = (), lower: float = 0.0, upper: float = 0.0) -> None:
        """``lower <= sum(plus) - sum(minus) <= upper``."""
        shift = 0
        if ONE in plus:
            shift += plus.count(ONE)
            plus = [col for col in plus if col != ONE]
        if ONE in minus:
            shift -= minus.count(ONE)
            minus = [col for col in minus if col != ONE]
        self.cols += plus
        self.cols += minus
        self.vals += [1.0] * len(plus)
        self.vals += [-1.0] * len(minus)
        self.starts.append(len(self.cols))
        self.lower.append(lower - shift)
        self.upper.append(upper - shift)


class _Unsupported(Exception):  # noqa: N818 (control flow: the program cannot be built)
    pass


def _build(search: _Search) -> tuple[_Program, dict[str, int]]:
    prog = _Program()
    opts = search.opts
    # value -> placement -> the columns whose sum is x[value, placement] ([ONE]: its only placement)
    x: dict[int, dict[Any, list[int]]] = {}

    def values(j: int, reading_edge: bool = False) -> dict[Any, list[int]]:
        if j not in x:
            if j in search.free and not reading_edge:  # the beam reads it as unplaced (None)
                raise _Unsupported(f"parameter {j} is read by an op, not through an edge")
            if j in search.free and len(search.free[j].options) > 1:
                x[j] = {p: [prog.var(m)] for p, m in search.free[j].options}
                prog.row([cols[0] for cols in x[j].values()], (), 1.0, 1.0)
            elif j in search.free:
                (p, m), = search.free[j].options
                x[j] = {p: [ONE]}
                prog.offset += m
            elif j in search.fixed:
                x[j] = {search.fixed[j]: [ONE]}
            else:
                raise _Unsupported(f"value {j} is read before it is placed")
        return x[j]

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

    rule, internal, activation = search.rule, search.internal_cost, search.activation_cost
    weighted = bool(opts.activation_weight)

    def cost_of(step: Any, cand: Any) -> float:
        """What one candidate of ``step`` costs: its internal collectives and its activations."""
        out = internal(cand) if cand.collectives else 0.0
        return out + activation(step, cand.output) if weighted else out

    def single(i: int) -> Any:
        """The placement of ``i`` where it has one (else None)."""
        domain = x[i]
        return next(iter(domain)) if len(domain) == 1 else None

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
        groups: dict[Any, list[int]] = {}  # x[j, p]: the columns that give j placement p
        if step.kind == "mark":
            x[j] = values(step.inputs[0])
            continue
        if step.kind == "getitem":
            for p, c in values(step.inputs[0]).items():
                groups.setdefault(p[step.node.args[1]] if isinstance(p, tuple) else p, []).extend(c)
        elif step.kind == "edge":
            if not step.inputs:
                raise _Unsupported(f"edge {step.node.name} has no producer")
            m = step.inputs[0]
            src = values(m, reading_edge=True)
            here = search.position[j]
            if m in search.params:  # never redistributed; an output edge that decides it keeps it R
                if step.is_output_edge and m in search.free and m not in first_edge:
                    prog.row([col for p, c in src.items() if p != R for col in c])
                first_edge.add(m)
                x[j] = src
                continue
            if j in search.pinned_edges or step.spec is None or (
                    not step.is_output_edge and search.last_use.get(j, -1) <= here):
                x[j] = src
                continue
            shared = moved[m] > 1
            spec, output = step.spec, step.is_output_edge
            for p, c in src.items():
                if not isinstance(p, Placement):
                    raise _Unsupported(f"edge {step.node.name} moves a {p!r}")
                moves = moves_from(p, spec, output)
                if not moves:  # p cannot leave the graph: x[m, p] = 0
                    prog.row(c)
                    continue
                if len(moves) == 1:  # the move is taken exactly where m has p: its columns are x[m, p]'s
                    (q, price), = moves.items()
                    t = {q: c}
                    if price and not shared:
                        prog.pay(c, price)
                else:
                    t = {q: [prog.var(0.0 if shared else price)] for q, price in moves.items()}
                    prog.row([cols[0] for cols in t.values()], c)
                for q, cols in t.items():
                    groups.setdefault(q, []).extend(cols)
                    if shared and p != q and moves[q] > 0.0:
                        key = (m, p, q, moves[q])
                        if key not in copies:
                            copies[key] = prog.var(moves[q])
                        prog.row(cols, [copies[key]], -np.inf, 0.0)
        else:  # an op: one strategy per combination of its inputs' placements and candidate
            distinct = list(dict.fromkeys(step.inputs)) if len(step.inputs) > 1 else step.inputs
            domains = [values(i) for i in distinct]
            varying = [k for k, d in enumerate(domains) if len(d) > 1]
            if step.inputs and len(varying) <= 1:
                # one input decides the combination (the others have one placement each, x = 1):
                # a strategy is x[lead, p] itself where p has one candidate
                lead = distinct[varying[0] if varying else 0]
                if len(step.inputs) == 1:
                    ins, slots = [None], (0,)
                else:
                    ins = [None if i == lead else single(i) for i in step.inputs]
                    slots = [k for k, i in enumerate(step.inputs) if i == lead]
                combinations += len(x[lead])
                for p, c in x[lead].items():
                    for k in slots:
                        ins[k] = p
                    cands = rule(step, tuple(ins))
                    if len(cands) == 1:
                        cand = cands[0]
                        if cand.collectives or weighted:
                            prog.pay(c, cost_of(step, cand))
                        groups.setdefault(cand.output, []).extend(c)
                        continue
                    cols = []
                    for cand in cands:
                        cols.append(col := prog.var(cost_of(step, cand)))
                        groups.setdefault(cand.output, []).append(col)
                    prog.row(cols, c)
            else:
                size = math.prod(len(d) for d in domains)
                if size > MAX_COMBINATIONS:
                    raise _Unsupported(f"op {step.node.name} has {size} input combinations")
                combinations += size
                reads: dict[tuple[int, Any], list[int]] = {}
                for combo in itertools.product(*domains):
                    placed = dict(zip(distinct, combo, strict=True))
                    for cand in rule(step, tuple(placed[i] for i in step.inputs)):
                        col = prog.var(cost_of(step, cand))
                        groups.setdefault(cand.output, []).append(col)
                        for i, p in placed.items():
                            reads.setdefault((i, p), []).append(col)
                for i, domain in zip(distinct, domains, strict=True):
                    for p, c in domain.items():
                        prog.row(reads.get((i, p), []), c)
                if not step.inputs:
                    prog.row([col for cols in groups.values() for col in cols], (), 1.0, 1.0)
        x[j] = groups
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
    matrix = csr_array((prog.vals, prog.cols, prog.starts), shape=(len(prog.lower), n))
    cost, lower, upper = np.asarray(prog.cost), np.asarray(prog.lower), np.asarray(prog.upper)
    out.variables, out.constraints = n, len(prog.lower)
    out.build_s = time.process_time() - start
    start = time.process_time()
    if relax:
        # HiGHS's dual simplex without presolve, called directly where scipy's bindings allow
        # (compat.highs_lp), else through linprog; either way nothing but an optimum is a bound
        if not n:  # nothing to choose (HiGHS calls it empty): the rows hold at 0 or never
            solved = (0.0 if bool(np.all(lower <= 0.0) and np.all(upper >= 0.0)) else None), "no columns"
        else:
            solved = highs_lp(cost, matrix, lower, upper)
        if solved is None:
            equal = lower == upper  # every other row is ``-inf <= row <= upper``
            bounded = None if equal.all() else (matrix[~equal], upper[~equal])
            result = linprog(cost, *(bounded or (None, None)), A_eq=matrix[equal], b_eq=lower[equal],
                             bounds=(0.0, 1.0), method="highs-ds", options={"presolve": False})
            solved = (float(result.fun) if result.status == 0 else None), result.message
        out.solve_s = time.process_time() - start
        optimum, out.reason = solved
        if optimum is not None:
            out.bound, out.optimal = optimum + prog.offset, True
        return out
    options: dict[str, Any] = {"mip_rel_gap": 0.0}
    if time_limit is not None:
        options["time_limit"] = time_limit
    result = milp(cost, constraints=LinearConstraint(matrix, lower, upper), integrality=np.ones(n),
                  bounds=(0.0, 1.0), options=options)
    out.solve_s = time.process_time() - start
    dual = getattr(result, "mip_dual_bound", None)  # what HiGHS proved (the same as fun when optimal)
    dual = float(dual) if dual is not None and np.isfinite(dual) else None
    if result.status == 0:
        out.bound, out.optimal = float(result.fun) if dual is None else min(float(result.fun), dual), True
    elif dual is not None:
        out.bound = dual
    out.bound += prog.offset
    out.reason = result.message
    return out
