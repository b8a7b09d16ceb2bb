"""Solve: choose a placement for every tensor of the shadow graph, with the least communication.

Formulation
-----------
Variables: the output placement of every ATen node, and the storage placement of every free
parameter (``Replicate`` or ``Shard(d)`` for each dim that divides by the world size; a k/v
projection whose heads the ranks outnumber: ``Replicate`` or its ``GroupedShard``).
Constraints: each op node's placement is one of the candidates its rule returns for its inputs'
placements (no rule: every input must be ``R`` and the output is ``R`` — the op is replicated, and
the trace says so); marks copy their input; edges (tensors crossing a Dynamo-node boundary) may
change placement by a collective, except that a parameter is never redistributed (an edge from a
parameter keeps its storage placement), nor is a value its consumer writes in place
(``ShadowGraph.inplace_edges``) and graph outputs must be ``R`` — unless
``SolverOptions.sharded_outputs``, where an output may also stay ``Shard`` at no cost (the caller
keeps KV caches sharded and gathers what the user reads, paying the same gather there). A value that several edges
redistribute the same way pays for the collective once (the rewrite shares it).
Objective: lexicographic, in three tiers, because the units differ. Memory is paid once and is what
tensor parallelism is for; communication is paid on every token. So (1) shard every *large* parameter
(leave none replicated that a feasible plan can shard), then (2) communicate the least per token,
then (3) replicate the fewest *small* parameter bytes. A parameter is small when it holds at most
``SolverOptions.small_rows`` (1/16) of the rows of the graph's widest parameter, counting rows along
each parameter's longest dim (:func:`rows`: a norm weight or bias is 1 row, an MoE router one per
expert, a hidden x hidden matrix ``hidden``): its bytes are worth a few tokens' activations, and a
collective on every token never pays for them. Everything else is large. The tiers depend neither
on depth, vocabulary nor world size (a share-of-bytes budget did: a 250880-entry embedding made a
2-layer BLOOM's attention output projection "small" and replicated). The tiers are one scalar:
``W * large replicated bytes + C + eps * small replicated bytes``, where ``C`` is the communication
(below), ``W = (upper bound of C over all plans + 1) / the smallest large parameter's replicated
bytes`` and ``eps = 1 / (all small replicated bytes + 1)``. So replicating any large parameter costs
more than any difference in ``C`` between two plans, and all small-parameter memory together weighs
less than one communicated byte per token: the plan never trades per-token communication for a few
KB of memory (it did: Gemma-2's widths got every norm weight sharded on the hidden dim and an
all-gather before each consumer of the residual stream). Replicated bytes are a parameter's bytes
x (N-1)/N; ``memory_weight`` scales tiers 1 and 3 (0: memory is free, everything replicates).
A k/v projection with fewer heads than ranks (``ParamChoice.kv_heads``, ``autotp/ops/kv_heads.py``)
cannot hold less than ``1/kv_heads`` of itself per rank without cutting a head that attention
would gather back on every token, so its bytes up to that floor are tier 3 and only bytes beyond
it tier 1 (:func:`head_floor`): a multi-query projection replicated, or one kv head per rank
(``GroupedShard``), saves all that keeping heads whole can. Likewise a fused q|k|v projection whose
one k and v head every rank holds whole beside its split q heads (:func:`whole_segment_floor`).

``C = sum(comm_bytes(edge) / tokens + latency)`` over the collectives (in a training graph,
``SolverOptions.backward``, those of the backward too: each redistribution's gradient collective), with ring-model bytes from
``collectives.cost_bytes`` and ``latency`` = ``SolverOptions.latency_bytes`` (default
``LATENCY_BYTES``) per collective. Communication is normalised per token (``tokens`` = elements of
the first integer input, or leading elements of the first input) and the latency is not divided by
the tokens, so every term is independent of batch and sequence length and the plan does not flip
with them.

Sequence parallelism (``activation_weight > 0``; ``sequence_parallel=True`` at the entry points,
which first solve as above, then re-solve with every parameter pinned where that plan stored it)
adds ``activation_weight * sum(full-size activation bytes * (N-1)/N) / tokens``, where an
*activation* is a floating op output computed from a parameter (masks and position tables, which
depend on the inputs only, are not) and *full-size* means ``R`` or ``Partial``. The all-reduce after
a row-parallel matmul (``2(N-1)/N`` bytes per element) and a reduce-scatter into sequence shards
followed by an all-gather before the next column-parallel matmul (``(N-1)/N`` each) move the same
bytes, so this term (with ``latency_bytes=0`` in that second solve: the user asked to trade
collectives for memory) makes the solver keep the residual stream, norms and dropout on
``Shard(sequence)`` between blocks: Megatron's sequence parallelism, found rather than prescribed.

Search
------
Frontier dynamic programming in topological order, i.e. a breadth-first branch-and-bound: a
*state* is the placement of every *live* value (produced, still to be consumed) plus the
placements already paid for, the accumulated cost, and a back-pointer to the choices that led to
it. Each node expands every state by every candidate; states whose candidates are all infeasible
are abandoned (a *backtrack*: the search continues from the other partial plans, and the trace
records why); states with identical live placements merge, keeping the cheapest, so a cost that is
deferred (a ``Partial`` reduced later) is carried by its state until paid. Edge placements are
decided lazily, by the edge's first consumer, which tries every redistribution the edge allows;
graph-output edges are scheduled right after their producer so returned values (KV caches) leave
the frontier at once. When the frontier outgrows ``beam_width``, states another state dominates
go first (exact, :meth:`_Search.dominates`); then a beam keeps the ``beam_width`` cheapest states
and, for every placement any live value takes, the cheapest state with that placement (a *cover*:
a choice with few follow-up variants, such as an all-reduce, is not crowded out by one with many,
such as a reduce-scatter whose all-gather is still unpaid), and, for every *signature* (the
placements of the live values an op computed: no edge can change them before their Dynamo node's
later ops read them together), the cheapest state with it. The per-value cover alone lost every
feasible plan of T5's cache-free forward at a beam of 32: in the cross-attention's
``q @ k^T`` both projections arrive ``Partial``, the edge into the attention node decides each
(kept ``Partial`` for free, or reduced), and the cheapest states kept both free, so the beam
held a state with q's heads split and one with k's, never one with both; the ``bmm`` then took
only ``Partial`` scores, which the softmax rejects. States are ranked by the cost paid so
far; adding to that cost the reduction a live ``Partial`` still owes, and nothing for a live ``Shard``,
lost Megatron's plan in block 1 of a 4-layer Gemma-2-9B at tp=8 (its ``o_proj`` output
is ``Partial`` where the plan that gathers the attention output is not yet charged for it).
Where the certificate leaves a gap, the searches of the gap widening rank states whose costs
differ by no more than the weight of all of tier 3 together (``memory_weight``: small-parameter
memory, never a collective or a large parameter) by the reduction they still owe first, then by
cost (the first search does not: a plan it proves keeps its tie-breaks, and on four cases of the
real-width matrix, Llama-3-8B's widths at tp=4 among them, that ranking places one all-reduce a
view earlier at equal cost): ranked by cost alone, T5's beam filled up
with states that had sharded a norm weight's few KB along the hidden dim and so carried the
q/k/v projections as ``Partial`` sums, and dropped the state that kept the residual replicated.
T5-base's widths at tp=2 (cache-free forward) cost 108,545 at a beam of 32, 102,913 at 128 and
the optimum 86,017 only at 512 (11.6 of the plan's 16.6 CPU s, loaded machine); so ranked,
91,649 at 32 and 86,017 at 64; tiny T5 at tp=2 reaches its optimum (52,225) at 32 so ranked,
where it took 128 (69,121 at 32).
Where states merge, and among states of equal cost (within ``TIE``) in the beam's ranking, the
one that reduces its Partial values where they are first needed wins: a state is scored by the
reduction its live Partial values still owe (:meth:`_Search.owed`; a value already redistributed
once owes nothing more) plus what its last step read as Partial where a reduced copy was ready.
So a Llama block keeps Megatron's all-reduce of the embedding's partial sums before the first
norm, reused by the residual add, rather than the equal-cost plan that reduces the norm's float32
copy and carries the partial sums along the residual stream into block 0's attention all-reduce.
Pruning is reported in the trace.

Certificate: every state the beam drops has paid a cost that only grows on the way to a complete
plan (all costs are >= 0), so ``min(best plan found, cheapest dropped state)`` bounds the optimum
from below; without a dropped state the search was exhaustive and the gap is 0 by construction.
That bound is loose wherever the beam drops states, since a state dropped in block 0 has paid
little yet (Gemma-2-9B's widths, 2 layers, tp=2: plan 92,161, bound 18,432 at a beam of 32, 35,328
at 2,048). So there (``SolverOptions.certify``, on by default) the same objective is written as a
0/1 integer linear program (``autotp/passes/ilp.py``: a one-hot placement per value, one strategy
per op and rule candidate over its inputs' reachable placements, each redistribution of a value
paid once, every cost from this module's functions) and HiGHS solves its LP relaxation; where that
leaves a gap, the integer program itself, for at most ``CERTIFY_SECONDS`` (then the best bound it
proved). Every plan the beam can return is a solution of the program at the same cost or less (the
program shares a redistribution between edges wherever the beam does, and in a few places the beam
does not), so both optima bound the optimum from below; within ``TIE`` of the plan's cost the plan
is proved optimal (gap 0). ``Solution.lower_bound`` is the larger of the beam's bound and the
program's, and ``SolveTrace.certificate`` says how it was reached, the program's size and its CPU
time. Measured: on every case of the real-width plan matrix (``benchmarks/certificate_gap.py``),
and with decode graphs and sequence parallelism on the cases tried, the LP relaxation alone reaches
the plan's cost (gap 0, 63 of 63 cases), at 8-19% of the whole solve's CPU time (median 10%; the
larger shares on the smallest solves: a fixed cost of HiGHS); the whole solve is a median x1.12 of
the solver before the certificate (x1.04-x1.35, 6 of 60 cases above x1.20; x1.01 less the
certificate; quiet machine, commit 655322e, ``benchmarks/results/certificate_gap.json``). Since the
program's ``x`` became sums and HiGHS is called directly (``ilp``'s docstring): 4-11% (median
5.5%), the whole solve a median x1.06 (the smallest, BERT's widths at tp=4 and batch 2, x1.11; one
case above x1.20, Llama's widths at tp=4, x1.28, of which x1.22 is the rest of the solve: noise at
load 4-12; commit 9b25bd2, not the stored JSON). On small random
graphs the bound equals the optimum of an exhaustive search at beams 1 and 4, also where a beam of
1 misses that optimum (then the integer program finds it, below the plan: the plan is not
replaced, ``exact`` does that). Guaranteed: the bound never exceeds the optimum of this objective
(tested against exhaustive search). Not guaranteed: that the LP relaxation is tight (the integer
program is exact but NP-hard in general, hence its time limit), nor that the program is built at
all: an op with more than ``ilp.MAX_COMBINATIONS`` combinations of input placements, or a graph
shape it does not express, leaves the beam's bound (``SolveTrace.certificate``'s note says why).
The program covers the whole graph (repeated blocks are not reused as the beam reuses them), so it
grows with depth: 8 layers of Gemma-2-9B's widths at tp=2, gap 0, 13,156 columns and 0.25 s (measured
before the single choices were folded in, see ``ilp``'s docstring) against the beam's 1.5-1.8 s; 40 Llama
layers of hidden 64, 41,274 columns and 0.97 s against the beam's 1.3 s (``autotp/passes/ilp.py`` has
the breakdown). ``plan_model`` solves a shortened
stand-in of a deep model (``autotp/depth.py``), the backend the whole graph.

With ``SolverOptions.exact``, where a gap remains, a branch and bound (``autotp/passes/bound.py``)
searches again with no beam, keeping every partial plan whose paid cost plus a lower bound on its
cost still to come is below the plan's cost (less ``TIE``), and dropping the rest and the
dominated: when its frontier empties the plan is optimal (gap 0), when plans remain the cheapest is
the optimum and replaces the plan; past ``BELOW_STATES`` states it gives up and keeps the larger of
the two bounds. Its bound on the cost still to come is 0, which proves small graphs but gives up at
real widths: every bound that splits the rest of the graph into independent parts (blocks, values,
paths) loses at least an all-reduce per block, and the search is cheap only with a bound within a
few KB of each state's exact cost to go (at Gemma-2-9B's widths, 2 layers, tp=2, with the plan's
own remaining cost standing in for it: at most 234 states per node; with one all-reduce of slack
about 12,000; with none, more than 20,000 in block 0's attention).

Repeated blocks: :func:`find_segments` cuts the schedule into blocks that repeat, found from the
sequence of ops and shapes (never from module names). A block whose structure and incoming states
(placements and relative costs) equal an earlier block's replays that block's recorded
transitions instead of running the rules again (``reused_nodes`` in the trace); the result is the
same as solving it afresh. Values live across a block that it never reads (Gemma-2's mask of the
other attention kind, which alternates with the layer; a tied embedding waiting for the head) are
numbered by position, like the block's inputs, so blocks that carry different such values match.
Before a block's incoming states are compared, each state that a cheaper one dominates by copies
alone is dropped (:meth:`_Search.without_local_copies`): ``b`` goes where a state ``a`` holds every
live value as ``b`` does, lacks only copies ``b`` paid for earlier (ready placements, and those its
pending edges carry), each of which ``a`` can make by a local narrow (``R -> S(d)``, no forward
collective), and costs, with one narrow per missing copy and per pending edge lacking it, strictly
less than ``b`` (beyond ``TIE``). Sound: costs only grow along a partial plan, and wherever ``b``'s
plan reads such a copy for free ``a``'s plan narrows the value there (it is a Dynamo-node output
read only through edges that may redistribute it, or a pending edge), so every completion of ``b``
has a strictly cheaper one from ``a``: no optimum is lost. The prefill of the startup benchmark's
model (150m, 14 layers, tp=2) carried three such states into each block (the rotary ``sin`` narrowed
to ``S(2)`` beside the states holding it ``R``, 19,072-33,920 dearer), whose costs settled into a
period of 2 blocks only at block 3, so blocks 0-4 and the last (6 of 14) were searched afresh; now
blocks 0, 1 and the last (3 of 14), ``reused_nodes`` 2152 -> 2959 of 4009 (the decode step, every
parameter pinned, already searched 3, see ``dominates``; a 4-layer tiny Llama's and OLMo-2's
prefill now replay 269 and 321 nodes, before none). Only at block boundaries: a state dropped
changes what the beam keeps after it, so this can change which of two equal-cost plans the beam
returns, and everywhere in the search it did (tiny BERT's 4-layer prefill, with the rule in
:meth:`dominates` instead: the same cost to the last bit but one, a Partial carried through a
residual add with ``replicated_share`` instead of reduced first); at the boundaries it changes no
plan of the real-width matrix, the tiny models (4 layers, prefill and decode, sequence parallel) or
the 150m model at tp 2 and 4 (digests of every placement, local rewrite and parameter placement).
A block that meets other incoming states (or the same at other relative costs: a prefill's first
two blocks, the last block, where the values it leaves live die) is searched afresh, but every op
asks its rule once per distinct call (``_Step.twin``: the same target, arguments' specs and
constants and output spec, all the rule reads), so such a block reruns the search and not the rules.
The cyclic garbage collector is paused during the search (it creates no reference cycles, and the
collector's passes over the whole heap took a quarter of the time).

Complexity: ``O(V * S * C * I)`` for ``V`` ATen nodes, ``S <= beam_width + K`` states (``K``
distinct live (value, placement) pairs for the cover, a few dozen in a transformer block), ``C``
candidate combinations per node and ``I`` inputs per node; memory ``O(V * S)`` back-pointers.
Everything is iterative (no recursion in the graph size); repeated blocks cost one block each
after the frontier has settled (typically the first two or three).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx

from autotp.collectives import backward_kind_of, cost_bytes, kind_of
from autotp.errors import SolverError
from autotp.memory import cycle_collection_paused
from autotp.ops.registry import CONSTANT_VALUE, Candidate, OpCall, TensorSpec, lookup, reject
from autotp.passes.decompose import EDGE, MARK, SYMBOLIC_DIMS, ShadowGraph
from autotp.passes.hosts import hosted_tags, needs_host
from autotp.placement import (
    GroupedShard,
    HeadShard,
    Partial,
    Placement,
    R,
    Replicate,
    Shard,
    StridedShard,
    is_uneven,
    shard_candidates,
)

LATENCY_BYTES = 4096.0  # one collective's fixed cost, in byte-equivalents
SMALL_ROWS = 1 / 16  # a parameter with at most this share of the widest one's rows is "small"
#: costs within this relative difference are a tie (float sums in another order); the smallest real
#: difference, one small parameter's share of the memory tier, is orders of magnitude larger
TIE = 1e-9
MAX_WIDENING = 64  # the widest beam tried, as a multiple of SolverOptions.beam_width
GAP_WIDENING = 16  # the widest beam tried where the certificate leaves a gap, as such a multiple
BELOW_STATES = 4096  # the widest frontier of the search below a plan (SolverOptions.exact) before it gives up
CERTIFY_SECONDS = 10.0  # the most HiGHS time the integer program of the certificate may take
NARROW_EPSILON = 1e-6  # a collective-free R->S edge is preferred only when it is needed


@dataclass
class SolverOptions:
    world_size: int
    tokens: int = 1
    memory_weight: float = 1.0
    beam_width: int = 32
    #: graph outputs may keep a Shard placement (KV caches stay sharded); otherwise they must be R
    sharded_outputs: bool = False
    #: cost of one byte of a full-size (``R`` or ``Partial``) activation per rank, relative to one
    #: communicated byte per token; > 0 asks for sequence parallelism (see the module docstring)
    activation_weight: float = 0.0
    #: fixed cost of one collective, in communicated bytes per token (see the module docstring)
    latency_bytes: float = LATENCY_BYTES
    #: may a dim whose size is symbolic (``TensorSpec.symbolic``) be sharded? Only where the caller
    #: guarantees every size the graph meets divides by the world size (sequence parallelism)
    shard_symbolic_dims: bool = False
    #: a parameter with at most this share of the widest parameter's rows is "small" (tier 3 of the
    #: objective, :func:`memory_tiers`); everything else is "large" (tier 1)
    small_rows: float = SMALL_ROWS
    #: kv-head counts below the world size (``autotp/ops/kv_heads.py``): an ``R`` edge may narrow
    #: to a grouped shard of that many groups
    kv_groups: tuple[int, ...] = ()
    #: where the beam leaves a gap, search every plan cheaper than its plan (``autotp/passes/bound.py``):
    #: gap 0, proved, unless the search's frontier passes ``BELOW_STATES`` (then the bound it reached)
    exact: bool = False
    #: a backward pass follows (a training graph): each redistribution also costs the collective
    #: its backward issues (an ``R -> S`` narrow is free forward and an all-gather backward)
    backward: bool = False
    #: where the beam dropped states, bound the optimum with the objective's linear program
    #: (``autotp/passes/ilp.py``): its LP relaxation, then, where that leaves a gap, the integer program
    certify: bool = True


@dataclass
class ParamChoice:
    """Storage placements a parameter may take, each with the bytes per rank it fails to save
    (``nbytes * (N-1)/N`` for ``R``, 0 for a shard); :func:`solve` prices them by tier."""

    options: list[tuple[Placement, float]]
    #: the parameter's global shape (its tier, :func:`memory_tiers`)
    shape: tuple[int, ...] = ()
    #: the bytes it fails to save if replicated (what prices the tiers, whatever options an override
    #: leaves); 0: the largest option's
    replicated: float = 0.0
    #: a k/v projection with fewer heads than ranks (``autotp/ops/kv_heads.py``): no plan that keeps
    #: heads whole holds less than ``1/kv_heads`` of it per rank, so only bytes beyond that are tier 1
    kv_heads: int = 0

    def narrowed(self, options: list[tuple[Placement, float]]) -> ParamChoice:
        """The same parameter with fewer options (an override); it keeps its tier and prices."""
        return ParamChoice(options, self.shape, self.replicated or max((m for _, m in self.options), default=0.0),
                           self.kv_heads)


def rows(shape: tuple[int, ...]) -> int:
    """How many vectors of its longest dim one matrix of a parameter holds: its second-largest
    dim (1 for a norm weight or a bias, one per expert for an MoE router, ``hidden`` for a hidden x
    hidden matrix and for each expert of a stacked ``(E, I, H)`` weight). Its bytes are worth that
    many tokens' activations of that width, the unit communication is paid in."""
    sizes = sorted(shape, reverse=True)
    return sizes[1] if len(sizes) > 1 else 1


def memory_tiers(shapes: dict[Any, tuple[int, ...]], small_rows: float) -> set[Any]:
    """The *small* parameters of tier 3 of the objective: those with at most ``small_rows`` x the
    :func:`rows` of the graph's widest parameter (vectors, routers); the rest are *large* (tier 1).
    Depends neither on depth nor on the vocabulary nor on the world size."""
    widest = max((rows(s) for s in shapes.values()), default=0)
    return {key for key, shape in shapes.items() if rows(shape) <= small_rows * widest}


def _comm_upper_bound(steps: list[_Step], opts: SolverOptions) -> float:
    """More than any plan's communication term: every edge an all-reduce of its tensor, and every
    op's own collectives (a sharded softmax's statistics, a vocab-parallel loss) at most two
    all-reduces of the largest tensor it reads or writes."""
    def nbytes(spec: Any) -> float:
        if isinstance(spec, tuple):
            return sum(nbytes(s) for s in spec)
        return float(spec.nbytes) if isinstance(spec, TensorSpec) else 0.0

    by_index = {s.index: s for s in steps}
    total = 0.0
    for s in steps:
        if s.kind == "edge":
            total += collective_cost(2.0 * nbytes(s.spec), opts)
        elif s.kind == "op":
            biggest = max([nbytes(s.spec)] + [nbytes(by_index[j].spec) for j in s.inputs if j in by_index])
            total += 2 * collective_cost(2.0 * biggest, opts)
    return total


def head_floor(replicated: float, kv_heads: int, world_size: int) -> float:
    """Of a parameter's unsaved bytes, those no plan keeping its kv heads whole can save: a k/v
    projection of ``kv_heads < N`` heads holds ``1/kv_heads`` of its bytes per rank at the least,
    ``nbytes * (1/kv_heads - 1/N)`` more than a shard (0 for other parameters)."""
    if not kv_heads or kv_heads >= world_size or world_size < 2:
        return 0.0
    nbytes = replicated * world_size / (world_size - 1)
    return nbytes * (1.0 / kv_heads - 1.0 / world_size)


def whole_segment_floor(choice: ParamChoice) -> float:
    """Of a fused projection's unsaved bytes, those its layout with whole segments keeps
    (``StridedShard.whole``: Falcon's one k and one v head on every rank beside its split q heads):
    no plan keeping those heads whole saves them, as with :func:`head_floor` (0 without one)."""
    return min((m for p, m in choice.options if isinstance(p, StridedShard) and p.shared), default=0.0)


def _price_memory(free: dict[int, ParamChoice], steps: list[_Step], opts: SolverOptions) -> dict[int, ParamChoice]:
    """Turn each option's unsaved bytes into the objective's tiers (see the module docstring). A
    k/v projection's bytes up to its head floor (:func:`head_floor`) are tier 3, whatever its size:
    replicating a multi-query projection, or holding one kv head of a grouped-query one, saves all
    that keeping heads whole can, and sharding it finer would gather it back on every token."""
    replicated = {j: c.replicated or max((m for _, m in c.options), default=0.0) for j, c in free.items()}
    if not opts.memory_weight or not any(replicated.values()):
        return {j: ParamChoice([(p, 0.0) for p, _ in c.options], c.shape, replicated[j], c.kv_heads)
                for j, c in free.items()}
    floor = {j: max(head_floor(replicated[j], c.kv_heads, opts.world_size), whole_segment_floor(c))
             for j, c in free.items()}
    small = memory_tiers({j: c.shape for j, c in free.items()}, opts.small_rows)
    large = [m - floor[j] for j, m in replicated.items() if j not in small and m - floor[j] > 0]
    weight = (_comm_upper_bound(steps, opts) + 1.0) / min(large) if large else 0.0
    epsilon = 1.0 / (sum(m if j in small else floor[j] for j, m in replicated.items()) + 1.0)

    def price(j: int, m: float) -> float:
        if j in small:
            return m * epsilon
        above = max(m - floor[j], 0.0)
        return above * weight + (m - above) * epsilon

    return {j: ParamChoice([(p, opts.memory_weight * price(j, m)) for p, m in c.options],
                           c.shape, replicated[j], c.kv_heads) for j, c in free.items()}


@dataclass
class Decision:
    node: str
    target: str
    owner: str
    inputs: tuple
    chosen: Any
    local: str | None
    candidates: list[str]
    note: str = ""


@dataclass
class SolveTrace:
    backtracks: list[dict] = field(default_factory=list)
    backtrack_count: int = 0
    pruned_states: int = 0
    #: the cheapest cost of any dropped state (the certificate's lower bound, with the best plan)
    pruned_min: float = float("inf")
    #: states dropped because another state dominates them (no plan lost)
    dominated_states: int = 0
    max_states: int = 0
    reused_nodes: int = 0
    widened_to: int | None = None
    #: the widest beam searched again because the certificate left a gap (None: not needed)
    gap_widened_to: int | None = None
    #: the widest frontier of the search below the plan (``SolverOptions.exact``); None: not run
    below_states: int | None = None
    #: the linear program's certificate (``SolverOptions.certify``): how it was solved ("lp" or
    #: "milp"), its bound, size and CPU seconds; None: not run (the beam dropped nothing)
    certificate: dict[str, Any] | None = None
    unknown_ops: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: what writes :attr:`decisions` when first read (None: written, or nothing to write)
    decide: Callable[[], list[Decision]] | None = field(default=None, repr=False, compare=False)
    _decisions: list[Decision] = field(default_factory=list, repr=False)

    @property
    def decisions(self) -> list[Decision]:
        """Each op's inputs, candidates and chosen placement, in schedule order: written on first
        read (a trace folder, an explanation), since most solves are never asked (a cold launch's
        backend keeps no solver record), and writing them was ~4% of a solve."""
        if self.decide is not None:
            self._decisions, self.decide = self.decide(), None
        return self._decisions


@dataclass
class Solution:
    placements: dict[torch.fx.Node, Any]
    local: dict[torch.fx.Node, str]
    params: dict[torch.fx.Node, Placement]
    cost: float
    comm_cost: float
    memory_cost: float
    trace: SolveTrace
    #: the certificate: no plan costs less (see the module docstring)
    lower_bound: float = 0.0
    #: parameter bytes per rank the plan leaves replicated (beyond 1/N of each)
    replicated_bytes: float = 0.0

    @property
    def gap(self) -> float:
        """How much cheaper than this plan the optimum could be (0: proved optimal)."""
        return max(self.cost - self.lower_bound, 0.0)


class _Hist:
    """Persistent back-pointer list: one (node index, placement, local tag) per step."""

    __slots__ = ("parent", "index", "placement", "local", "param")

    def __init__(self, parent: _Hist | None, index: int, placement: Any, local: str | None,
                 param: tuple[int, Placement] | None) -> None:
        self.parent, self.index, self.placement, self.local, self.param = parent, index, placement, local, param


def _spec(value: Any, symbolic: Any = None, constant: tuple[int, ...] | None = None) -> Any:
    """The TensorSpec of a node's value; ``symbolic``: its ``SYMBOLIC_DIMS`` meta, if any;
    ``constant``: its ``CONSTANT_VALUE`` meta, if any."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(int(s) for s in value.shape), value.dtype, frozenset(symbolic or ()), constant)
    if isinstance(value, (tuple, list)):
        dims = symbolic if isinstance(symbolic, tuple) else (None,) * len(value)
        return tuple(_spec(v, d) for v, d in zip(value, dims, strict=False))
    return None


def _shards_symbolic_dim(out: Any, spec: Any) -> bool:
    """True if placement ``out`` shards a dim that ``spec`` marks symbolic."""
    if isinstance(out, tuple) and isinstance(spec, tuple):
        return any(_shards_symbolic_dim(o, s) for o, s in zip(out, spec, strict=False))
    if isinstance(out, (GroupedShard, HeadShard)):
        return isinstance(spec, TensorSpec) and out.dim in spec.symbolic
    return isinstance(out, Shard) and isinstance(spec, TensorSpec) and not spec.shardable(out.dim, out)


def _tensor_spec(value: Any, specs: dict[int, Any]) -> Any:
    """``_spec(value)``, once per value object (``specs``, by id): decompose copies one trace per
    repeated Dynamo node, whose copies share their fake values."""
    if not isinstance(value, torch.Tensor):
        return _spec(value)
    spec = specs.get(id(value))
    if spec is None:
        spec = specs[id(value)] = _spec(value)
    return spec


def _arg_specs(arg: Any, specs: dict[int, Any]) -> Any:
    """``arg`` with each Node replaced by its value's spec (``specs``: see :func:`_tensor_spec`)."""
    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            constant = a.meta.get(CONSTANT_VALUE)
            val = a.meta.get("val")
            return _spec(val, constant=constant) if constant is not None else _tensor_spec(val, specs)
        return a

    return torch.fx.node.map_aggregate(arg, conv)


def _tensor_input_nodes(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The Node arguments that are tensors, in pytree order over (args, kwargs)."""
    out: list[torch.fx.Node] = []

    def visit(a: Any) -> Any:
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
        return a

    torch.fx.node.map_aggregate((n.args, n.kwargs), visit)
    return out


def edge_targets(p: Placement, spec: TensorSpec, world_size: int, kv_groups: tuple[int, ...] = ()
                 ) -> list[Placement]:
    """Placements an edge may move a tensor to from ``p`` (identity first); never a shard of a
    symbolic dim (``TensorSpec.symbolic``). ``R`` may also narrow to a grouped shard of the graph's
    kv-head groups (an empty KV cache meeting this call's grouped keys)."""
    out: list[Placement] = [p]
    if isinstance(p, StridedShard):  # a fused layout is consumed in place, never redistributed
        return out
    if isinstance(p, HeadShard):  # heads no tp divides: kept, or gathered (never moved to another split)
        return [*out, R]
    if isinstance(p, GroupedShard):  # kv heads: narrowed to a plain shard of their dim, or gathered
        if p.inner is not None:  # spread over its query heads: merged by the next view, never moved
            return out
        plain = Shard(p.dim)
        if spec.shape[p.dim] % world_size == 0 and spec.shardable(p.dim):
            out.append(plain)
        return [*out, R]
    floating = spec.dtype.is_floating_point or spec.dtype.is_complex
    shards = [s for s in shard_candidates(spec.shape, world_size) if spec.shardable(s.dim)]
    if isinstance(p, Partial):
        out.append(R)
        out.extend(s for s in shards if floating)
    elif isinstance(p, Replicate):
        out.extend(shards)
        out.extend(GroupedShard(d, g) for g in kv_groups for d, size in enumerate(spec.shape)
                   if size % g == 0 and size >= g and spec.shardable(d))
    elif isinstance(p, Shard):
        out.append(R)
        if not is_uneven(spec.shape[p.dim], world_size):  # an uneven shard (a vocabulary) is only gathered
            out.extend(s for s in shards if s != p)
    return out


#: a collective kind -> one (src, dst) pair that issues it, to price a backward collective by kind
_ISSUED_BY = {"all_reduce": (Partial(), R), "all_gather": (Shard(0), R), "reduce_scatter": (Partial(), Shard(0)),
              "all_to_all": (Shard(0), Shard(1))}


def edge_cost(src: Placement, dst: Placement, spec: TensorSpec, opts: SolverOptions) -> float:
    """A redistribution's forward collective (``NARROW_EPSILON`` for a local narrow) plus, in a
    training graph (``SolverOptions.backward``), the collective its backward issues on the gradient."""
    if src == dst:
        return 0.0
    kind = kind_of(src, dst)
    cost = NARROW_EPSILON if kind is None else collective_cost(cost_bytes(src, dst, spec.nbytes, opts.world_size), opts)
    if opts.backward and spec.dtype.is_floating_point:
        back = backward_kind_of(src, dst)
        if back is not None:
            cost += collective_cost(cost_bytes(*_ISSUED_BY[back], spec.nbytes, opts.world_size), opts)
    return cost


def collective_cost(nbytes: float, opts: SolverOptions) -> float:
    """One collective moving ``nbytes`` per rank: its bytes per token plus a fixed latency per
    token. The latency is not spread over the tokens, so the cost is the same at every batch and
    sequence length and so is the plan (a latency spread over a long prefill made extra collectives
    almost free: reduce-scatter/all-to-all/all-gather chains saving a few bytes per token won over
    Megatron's one all-reduce per region, and the first call's length decided the plan)."""
    return nbytes / max(opts.tokens, 1) + opts.latency_bytes


class _Step:
    """Static facts about one ATen node, computed once."""

    __slots__ = ("index", "node", "kind", "inputs", "opcall", "rule", "spec", "is_output_edge", "owner", "hosts",
                 "twin")

    def __init__(self, index: int, node: torch.fx.Node, kind: str, inputs: list[int], opcall: OpCall | None,
                 rule: Any, spec: Any, is_output_edge: bool, owner: str, hosts: frozenset[str] = frozenset(),
                 twin: int | None = None) -> None:
        self.index, self.node, self.kind, self.inputs = index, node, kind, inputs
        self.opcall, self.rule, self.spec, self.is_output_edge, self.owner = opcall, rule, spec, is_output_edge, owner
        #: the function-replacing local rewrites the owning Dynamo node can carry out (passes/hosts.py)
        self.hosts = hosts
        #: an op: the index of the first op whose rule sees the same call (target, arguments' specs and
        #: constants, output spec: the ``OpCall``, all a rule reads), so repeated blocks share their
        #: rule calls (:meth:`_Search.rule`) and compare their ops by it (:meth:`_Search.signature`)
        self.twin = index if twin is None else twin


def solve(shadow: ShadowGraph, opts: SolverOptions, fixed: dict[torch.fx.Node, Placement],
          free_params: dict[torch.fx.Node, ParamChoice], param_nodes: set[torch.fx.Node]) -> Solution:
    """Find the cheapest placement of every tensor in ``shadow.aten`` (see the module docstring).

    ``fixed`` pins ATen placeholders (user inputs, buffers, parameters a previous graph placed);
    ``free_params`` lists the parameters whose storage placement this solve decides;
    ``param_nodes`` are all parameter placeholders (free or pinned): they are never redistributed.
    """
    t0 = time.perf_counter()
    trace = SolveTrace()
    nodes = list(shadow.aten.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    output_dyn = len(shadow.dynamo_nodes) - 1
    dyn_names = [n.name for n in shadow.dynamo_nodes]

    steps: list[_Step] = []
    last_use: dict[int, int] = {}
    calls: dict[tuple, int] = {}  # an op's rule call -> the first op making it (``_Step.twin``)
    hosting: dict[int, frozenset[str]] = {}  # Dynamo node index -> its hosted_tags
    specs: dict[int, Any] = {}  # id of a node's value -> its TensorSpec (:func:`_tensor_spec`)
    for n in nodes:
        if n.op != "call_function":
            continue
        i = index[n]
        ins = [index[a] for a in _tensor_input_nodes(n)]
        if n.target is operator.getitem:
            ins = [index[n.args[0]]]
        symbolic = None if opts.shard_symbolic_dims else n.meta.get(SYMBOLIC_DIMS)
        spec = _tensor_spec(n.meta.get("val"), specs) if symbolic is None else _spec(n.meta.get("val"), symbolic)
        owner = dyn_names[shadow.owner[n]] if n in shadow.owner else "?"
        dyn = shadow.owner.get(n)
        if dyn is None:
            hosts = frozenset()
        elif (hosts := hosting.get(dyn)) is None:
            hosts = hosting[dyn] = hosted_tags(shadow.dynamo_nodes[dyn])
        twin = None
        if n.target is EDGE:
            kind, opcall, rule = "edge", None, None
        elif n.target is MARK:
            kind, opcall, rule = "mark", None, None
        elif n.target is operator.getitem:
            kind, opcall, rule = "getitem", None, None
        else:
            kind = "op"
            opcall = OpCall(n.target, _arg_specs(n.args, specs), _arg_specs(n.kwargs, specs), spec, opts.world_size)
            rule = lookup(n.target)
            if rule is None:
                trace.unknown_ops[str(n.target)] = trace.unknown_ops.get(str(n.target), 0) + 1
            twin = calls.setdefault((n.target, repr(opcall.args), repr(opcall.kwargs), repr(spec)), i)
        is_out = kind == "edge" and n.args[1] == output_dyn
        steps.append(_Step(i, n, kind, ins, opcall, rule, spec, is_out, owner, hosts, twin))

    steps = _schedule(steps)
    position = {s.index: k for k, s in enumerate(steps)}
    for k, s in enumerate(steps):
        for j in s.inputs:
            last_use[j] = max(last_use.get(j, -1), k)

    fixed_idx = {index[n]: p for n, p in fixed.items()}
    free_idx = _price_memory({index[n]: c for n, c in free_params.items()}, steps, opts)
    param_idx = {index[n] for n in param_nodes} | set(free_idx)
    pinned_edges = {index[n] for n in shadow.inplace_edges}
    for n in nodes:
        if n.op in ("placeholder", "get_attr") and index[n] not in fixed_idx and index[n] not in free_idx:
            fixed_idx[index[n]] = R

    with cycle_collection_paused():  # the states form no garbage cycles (autotp/memory.py)
        search, states = _search_widening(steps, position, last_use, fixed_idx, free_idx, param_idx, opts, trace,
                                          pinned_edges)

    best_cost, best_comm, best_mem, hist = min(states.values(), key=lambda v: v[0])
    placements: dict[torch.fx.Node, Any] = {}
    local: dict[torch.fx.Node, str] = {}
    params: dict[torch.fx.Node, Placement] = {}
    while hist is not None:
        n = nodes[hist.index]
        placements.setdefault(n, hist.placement)
        if hist.local:
            local[n] = hist.local
        if hist.param is not None:
            params[nodes[hist.param[0]]] = hist.param[1]
        hist = hist.parent
    for j, p in fixed_idx.items():
        placements[nodes[j]] = p
    for n, p in params.items():
        placements[n] = p
    # (copies: written when first read, of the plan as solved)
    trace.decide = functools.partial(_decisions, steps, dict(placements), dict(local), fixed_idx, search.rule)
    trace.seconds = time.perf_counter() - t0
    replicated = sum(dict(free_params[nodes[j]].options).get(R, 0.0) for j in free_idx
                     if params.get(nodes[j]) == R)
    return Solution(placements, local, params, best_cost, best_comm, best_mem, trace,
                    lower_bound=min(best_cost, trace.pruned_min), replicated_bytes=replicated)


def _search_widening(steps: list[_Step], position: dict[int, int], last_use: dict[int, int],
                     fixed_idx: dict[int, Placement], free_idx: dict[int, ParamChoice], param_idx: set[int],
                     opts: SolverOptions, trace: SolveTrace, pinned_edges: set[int]) -> tuple[_Search, dict]:
    """Run the search, widening the beam (x8, up to ``MAX_WIDENING``) where it lost every feasible
    plan, and (x2, up to ``GAP_WIDENING``, see below) where the certificate leaves a gap, keeping the cheapest
    plan found; with ``SolverOptions.exact``, where a gap remains, search below its plan
    (:func:`autotp.passes.bound.search_below`); the search that found the plan and the final states.

    The gap widening is what makes the certificate change a plan, not only report on it: T5's
    hidden-64 forward at batch 2 (tp=2, pinned by its batch-1 warm-up) cost 64,592 at a beam of
    32 (a reduce-scatter, a normed batch shard and two all-gathers at the encoder's end) against the
    certificate's 60,496, and a beam of 128 found that plan (Megatron's all-reduce); T5-base's
    widths at tp=2 and 4 (cache-free forward and prefill) cost up to 91,649 / 110,849 at 32 and
    reach the certificate's bound at 64. The gap widening's searches rank near-equal states by what
    they owe (``near``, module docstring): the first at the width asked for, then x2 each. x2
    steps, not x4: a search costs about its width, so stopping at the first width that closes the
    gap saves more (T5-base: 32, 32 ranked so, and 64, ~2 CPU s, where x4 ran 32, 128 and 512)
    than the extra steps cost where a gap needs the widest beam. Where the certificate proves the
    plan optimal, which is every other case of the real-width matrix, nothing is searched again."""
    def search_at(width: int, near: bool = False) -> _Search:
        """A fresh search at beam ``width``, recording into ``trace`` (its counts reset); ``near``:
        ranking states whose costs differ by tier 3 alone by what they owe (:meth:`_Search.rank`)."""
        trace.pruned_states, trace.pruned_min = 0, float("inf")
        search = _Search(steps, position, last_use, fixed_idx, free_idx, param_idx,
                         dataclasses.replace(opts, beam_width=width), trace, pinned_edges)
        search.rank_within = opts.memory_weight if near else 0.0
        return search

    width = opts.beam_width
    while True:  # a beam can lose every feasible plan: widen it
        search = search_at(width)
        try:
            states = search.run()
        except SolverError:
            if trace.pruned_states == 0 or width >= opts.beam_width * MAX_WIDENING:
                raise
            width *= 8
            trace.widened_to = width
            continue
        break
    best = min(v[0] for v in states.values())
    if opts.certify and trace.pruned_min < best:
        _certify(search, best, trace)
        # a gap the program leaves says the beam may have dropped a cheaper plan (the beam's own
        # bound, where no program was built, is too loose to say so): search again with a wider
        # beam (x2 each time, up to GAP_WIDENING x the width asked for) until the plan meets the
        # bound; the certificate's bound holds for every search, each wider search's own bound (its
        # cheapest dropped state, or its plan) may raise it
        bound = trace.pruned_min
        built = bool(trace.certificate and trace.certificate["variables"])
        near = False
        while built and bound < best - TIE * max(1.0, abs(best)) and width < opts.beam_width * GAP_WIDENING:
            width *= 2 if near else 1  # (first the same width, ranked by what near-equal states owe)
            near = True
            wider = search_at(width, near=True)
            try:
                found = wider.run()
            except SolverError:
                break
            trace.gap_widened_to = width
            cost = min(v[0] for v in found.values())
            bound = max(bound, min(cost, trace.pruned_min))
            if cost < best:
                search, states, best = wider, found, cost
        trace.pruned_min = float("inf") if bound >= best - TIE * max(1.0, abs(best)) else bound
    if opts.exact and trace.pruned_min < best:
        from autotp.passes.bound import search_below  # (it builds on _Search)

        # plans within TIE of the best are ties (another order of float sums): not worth a new plan
        below = search_below(search, best - TIE * max(1.0, abs(best)), max_states=BELOW_STATES)
        trace.below_states = below.max_states
        if below.states is None:  # gave up: two lower bounds, the larger holds too
            trace.pruned_min = max(trace.pruned_min, below.bound)
        else:  # no plan is cheaper than the one it returns: proved optimal
            trace.pruned_min = float("inf")
            states = below.states or states
    return search, states


def _certify(search: _Search, best: float, trace: SolveTrace) -> None:
    """Bound the optimum with the objective's LP relaxation and, where it leaves a gap, with the
    integer program (``autotp/passes/ilp.py``; at most ``CERTIFY_SECONDS`` of HiGHS): a bound within
    ``TIE`` of the plan's cost proves the plan optimal (``trace.pruned_min`` becomes ``inf``), a
    lower one raises the beam's bound."""
    from autotp.passes.ilp import certify  # (it builds on _Search)

    start = time.process_time()
    tie = TIE * max(1.0, abs(best))
    found = certify(search, relax=True)
    if found.bound < best - tie and found.variables:
        found = certify(search, relax=False, time_limit=CERTIFY_SECONDS)
    trace.certificate = {"method": "lp" if found.relaxed else "milp", "bound": found.bound,
                         "variables": found.variables, "constraints": found.constraints,
                         "cpu_s": time.process_time() - start, "build_cpu_s": found.build_s,
                         "highs_cpu_s": found.solve_s, "note": found.reason}
    if found.bound >= best - tie:
        trace.pruned_min = float("inf")
    else:
        trace.pruned_min = max(trace.pruned_min, found.bound)


@dataclass(frozen=True)
class Pending:
    """An edge whose placement its first consumer decides (lazy redistribution). ``ready`` are the
    placements the producer already has at no further cost (an earlier edge paid for them)."""

    src: Any
    ready: frozenset = frozenset()


@dataclass
class _Option:
    out: Any
    cost: float = 0.0
    mem: float = 0.0
    local: str | None = None
    param: tuple[int, Placement] | None = None
    resolved: tuple[tuple[int, Placement], ...] = ()


State = tuple[tuple, frozenset]  # (sorted (index, placement) of live values, (producer, placement) paid for)


class _Search:
    """The frontier DP of :func:`solve` (see the module docstring).

    A state is ``(live, ready)``: the placement of each live value, and the extra placements some
    live values already have because an earlier edge paid for the collective (a second consumer
    that needs the same redistribution of the same value reuses it for free; the rewrite shares
    the collective).
    """

    def __init__(self, steps: list[_Step], position: dict[int, int], last_use: dict[int, int],
                 fixed: dict[int, Placement], free: dict[int, ParamChoice], params: set[int],
                 opts: SolverOptions, trace: SolveTrace, pinned_edges: set[int] = frozenset()) -> None:
        self.steps, self.position, self.last_use = steps, position, last_use
        self.pinned_edges = pinned_edges  # edges into in-place writes: never redistributed
        self.fixed, self.free, self.params, self.opts, self.trace = fixed, free, params, opts, trace
        self.spec_of = {s.index: s.spec for s in steps}
        self.producer = {s.index: s.inputs[0] for s in steps if s.kind == "edge" and s.inputs}
        self.rule_cache: dict[tuple[int, tuple], list[Candidate]] = {}
        #: (an op's ``_Step.twin``, its inputs' placements) -> what the rule returned: one call for
        #: the same op in every repeated block
        self.rule_calls: dict[tuple[int, tuple], list[Candidate]] = {}
        #: op nodes computed from a parameter (what sequence parallelism prices when replicated)
        self.activations = _downstream(steps, params) if opts.activation_weight else set()
        #: Dynamo-node outputs (marks) read only through edges that may redistribute them: a state
        #: may differ from another in their placement and still be matched later (``dominates``)
        step_of = {s.node: s.index for s in steps}
        self.movable = {s.index for s in steps if s.kind == "mark"
                        and all(u.target is EDGE and step_of.get(u) is not None and step_of[u] not in pinned_edges
                                for u in s.node.users)}
        #: op outputs: no edge lies between them and the ops of their Dynamo node that read them
        self.computed = {s.index for s in steps if s.kind in ("op", "getitem")}
        #: (value, placement in a, in b[, ready in a, ready in b]) -> :meth:`conversion`
        self.conversions: dict[tuple, float] = {}
        #: value -> its position in the live tuples of the states :meth:`undominated` compares
        #: (every state of one step holds the same live values), for :meth:`dominates`
        self.live_at: dict[int, int] = {}
        #: every parameter placed by an earlier graph: :meth:`dominates` also compares states that
        #: hold values ready differently (that costs a search with free parameters more than it
        #: saves: 2x the CPU of tiny T5's, when its beam widened to 256)
        self.pinned = not free
        #: id of a state :meth:`undominated` compares -> its ready and live (value, placement) pairs
        self.covers: dict[int, frozenset] = {}
        self.redistribution_cache: dict[tuple[int, Pending], list[tuple[Placement, float]]] = {}
        #: (op step, its inputs' placements) -> its options (:meth:`op_options`)
        self.option_cache: dict[tuple[int, tuple], tuple[list[_Option], str | None]] = {}
        #: value -> the reduction it owes when Partial (:meth:`owed`)
        self.owed_by: dict[int, float] = {}
        #: :meth:`rank` orders states whose costs lie within this of each other by what they owe
        #: (0: exact ties only; the gap widening's searches: ``memory_weight``, all of tier 3)
        self.rank_within = 0.0

    def run(self) -> dict[State, tuple[float, float, float, _Hist | None]]:
        states: dict[State, tuple[float, float, float, _Hist | None]] = {((), frozenset()): (0.0, 0.0, 0.0, None)}
        segments = dict(find_segments(self.steps, self.last_use, self.position))
        memo: dict[tuple, list] = {}
        k = 0
        while k < len(self.steps):
            end = segments.get(k)
            if end is None:
                states = self.advance(self.steps[k], states)
                k += 1
                continue
            states = self.run_segment(k, end, states, memo)
            k = end
        return states

    # -- repeated blocks ------------------------------------------------------------------------

    def run_segment(self, k0: int, k1: int, states: dict, memo: dict) -> dict:
        """Advance over steps ``[k0, k1)``; reuse the transitions of an earlier identical segment
        that saw the same incoming states (same placements, same relative costs)."""
        states = self.without_local_copies(states)
        sig, externals = self.signature(k0, k1)
        # values live across the segment that it never reads (Gemma-2's mask of the other attention
        # kind, a tied embedding waiting for the head) are numbered after the externals, in index
        # order: two segments that carry different such values alike are the same segment
        first_live = dict(next(iter(states))[0])  # every state of one step holds the same live values
        through = sorted(set(first_live) - set(externals))
        externals = externals + through
        ext_id = {j: n for n, j in enumerate(externals)}
        canon = sorted(((self.canon_state(key, ext_id, k0), key, val) for key, val in states.items()),
                       key=lambda t: repr(t[0]))
        base = min(v[0] for _, _, v in canon)
        carried = tuple((repr(self.spec_of.get(j)), j in self.movable, j in self.params) for j in through)
        memo_key = (sig, carried, tuple((c, round(v[0] - base, 6)) for c, _, v in canon))
        if memo_key in memo:
            self.trace.reused_nodes += k1 - k0
            rows, dropped = memo[memo_key]
            self.trace.pruned_min = min(self.trace.pruned_min, base + dropped)
            return self.replay(rows, canon, externals, k0)
        incoming = {id(v[3]): n for n, (_, _, v) in enumerate(canon)}
        before, self.trace.pruned_min = self.trace.pruned_min, float("inf")
        out = states
        for k in range(k0, k1):
            out = self.advance(self.steps[k], out)
        # the states this segment dropped, relative to its incoming states (replays drop the same)
        memo[memo_key] = (self.record(out, canon, incoming, ext_id, k0, k1), self.trace.pruned_min - base)
        self.trace.pruned_min = min(before, self.trace.pruned_min)
        return out

    def without_local_copies(self, states: dict) -> dict:
        """``states`` (a block's incoming frontier) less each state that another one dominates by
        copies alone: ``b`` goes where a cheaper state ``a`` holds every live value as ``b`` does
        and lacks only copies ``b`` paid for (``ready``, and the copies its pending edges carry)
        that ``a`` can make by a local narrow, no collective (:meth:`local_copies_cost`), and ``a``'s
        cost plus every such narrow is strictly below ``b``'s (beyond ``TIE``). Sound: wherever
        ``b``'s plan reads such a copy for free, ``a``'s plan narrows the value there (the edge may
        redistribute it: the value is movable, or the edge is pending), and pays each narrow at most
        once per copy and pending edge, so every completion of ``b`` has a cheaper one from ``a``.
        Only at block boundaries, where it decides what the memo of repeated blocks compares
        (:meth:`run_segment`); see the module docstring for what it changes and what not."""
        if len(states) < 2:
            return states
        kept: dict[tuple, list[tuple[State, float]]] = {}  # live placements less pending copies -> states
        dropped = set()
        for key, value in sorted(states.items(), key=lambda kv: kv[1][0]):
            live, ready = key
            plain = tuple([(j, p.src if isinstance(p, Pending) else p) for j, p in live])
            rivals = kept.setdefault(plain, [])
            if ready and any(ready_a < ready and cost_a + self.local_copies_cost((live_a, ready_a), key) < value[0]
                             - TIE * max(1.0, abs(value[0])) for (live_a, ready_a), cost_a in rivals):
                dropped.add(key)
                continue
            rivals.append((key, value[0]))
        if not dropped:
            return states
        self.trace.dominated_states += len(dropped)
        return {k: v for k, v in states.items() if k not in dropped}

    def local_copies_cost(self, a: State, b: State) -> float:
        """What ``a`` (the same live placements as ``b`` up to its pending edges' copies, and fewer
        ready copies) pays at most to make every copy ``b`` holds and ``a`` does not, each by a
        local narrow (``inf`` where one is not a narrow, or its value may not be redistributed):
        one narrow per missing ready copy (for the value's later edges) and one per pending edge
        that lacks it (:meth:`without_local_copies`)."""
        (live_a, ready_a), (live_b, ready_b) = a, b
        placed = dict(live_a)
        narrows = []  # (summed exactly: a set's order is its placements' ids, which differ between runs)
        for j, q in ready_b - ready_a:
            p = placed.get(j)
            if p is None or j not in self.movable:
                return float("inf")
            narrows.append(self.narrow_cost(j, p, q))
        for (j, pa), (_, pb) in zip(live_a, live_b, strict=True):
            if pa is pb or pa == pb:
                continue
            if not isinstance(pa, Pending) or not isinstance(pb, Pending):
                return float("inf")
            for q in pb.ready - pa.ready:  # (pending from the same source: what the caller compared)
                narrows.append(self.narrow_cost(j, pa.src, q))
        return math.fsum(narrows)

    def narrow_cost(self, j: int, p: Any, q: Any) -> float:
        """The cost of moving value ``j`` from ``p`` to ``q`` where that is a local narrow (no
        forward collective; a training graph's backward one included), else ``inf``."""
        spec = self.spec_of.get(j)
        if not isinstance(spec, TensorSpec) or not isinstance(p, Placement) or kind_of(p, q) is not None \
                or q not in edge_targets(p, spec, self.opts.world_size, self.opts.kv_groups):
            return float("inf")
        return edge_cost(p, q, spec, self.opts)

    def where(self, j: int, ext_id: dict[int, int], k0: int, k1: int) -> tuple:
        pos = self.position.get(j)
        if pos is not None and k0 <= pos < k1:
            return ("s", pos - k0)
        if j in ext_id:
            return ("e", ext_id[j])
        return ("p", j)

    def signature(self, k0: int, k1: int) -> tuple[tuple, list[int]]:
        """Structure of a segment with its external inputs numbered by first use."""
        externals: list[int] = []
        seen: set[int] = set()
        parts = []
        for k in range(k0, k1):
            step = self.steps[k]
            refs = []
            for j in step.inputs:
                pos = self.position.get(j)
                if pos is not None and k0 <= pos < k1:
                    refs.append(("s", pos - k0))
                    continue
                if j not in seen:
                    seen.add(j)
                    externals.append(j)
                refs.append(("e", externals.index(j), j in self.params, repr(self.free[j].options) if j in self.free
                             else None, repr(self.fixed.get(j)), self.relative_use(j, k0, k1)))
            # an op by its rule call (``_Step.twin``: the same target, arguments and output spec)
            body = (step.kind, step.twin) if step.kind == "op" else (step.kind, str(step.node.target), repr(step.spec))
            body += (step.is_output_edge, step.index in self.pinned_edges)
            if step.kind == "getitem":
                body += (step.node.args[1],)
            parts.append((body, tuple(refs), self.relative_use(step.index, k0, k1)))
        return tuple(parts), externals

    def relative_use(self, j: int, k0: int, k1: int) -> int | str:
        lu = self.last_use.get(j, -1)
        if lu < k0:
            return "none"
        return lu - k0 if lu < k1 else "after"

    def canon_state(self, key: State, ext_id: dict[int, int], k0: int) -> tuple:
        live, ready = key
        k1 = k0  # nothing inside the segment is live yet
        return (tuple(sorted(((self.where(j, ext_id, k0, k1), p) for j, p in live), key=repr)),
                tuple(sorted(((self.where(j, ext_id, k0, k1), q) for j, q in ready), key=repr)))

    def record(self, out: dict, canon: list, incoming: dict[int, int], ext_id: dict[int, int], k0: int,
               k1: int) -> list:
        rows = []
        for (live, ready), (cost, comm, mem, hist) in out.items():
            entries = []
            h = hist
            while h is not None and id(h) not in incoming:
                param = (self.where(h.param[0], ext_id, k0, k1), h.param[1]) if h.param else None
                entries.append((self.where(h.index, ext_id, k0, k1), h.placement, h.local, param))
                h = h.parent
            src = incoming[id(h)] if h is not None else next(
                n for n, (_, _, v) in enumerate(canon) if v[3] is None)
            _, _, v = canon[src]
            okey = (tuple((self.where(j, ext_id, k0, k1), p) for j, p in live),
                    tuple((self.where(j, ext_id, k0, k1), q) for j, q in ready))
            rows.append((okey, src, cost - v[0], comm - v[1], mem - v[2], tuple(reversed(entries))))
        return rows

    def replay(self, rows: list, canon: list, externals: list[int], k0: int) -> dict:
        def index(w: tuple) -> int:
            if w[0] == "s":
                return self.steps[k0 + w[1]].index
            if w[0] == "e":
                return externals[w[1]]
            return w[1]

        out: dict[State, tuple[float, float, float, _Hist | None]] = {}
        for okey, src, dcost, dcomm, dmem, entries in rows:
            _, _, (cost, comm, mem, h) = canon[src]
            for w, placement, local, param in entries:
                h = _Hist(h, index(w), placement, local, (index(param[0]), param[1]) if param else None)
            live = tuple(sorted(((index(w), p) for w, p in okey[0]), key=lambda kv: kv[0]))
            ready = frozenset((index(w), q) for w, q in okey[1])
            out[(live, ready)] = (cost + dcost, comm + dcomm, mem + dmem, h)
        return out

    def alive_after(self, j: int, here: int) -> bool:
        return self.last_use.get(j, -1) > here

    def advance(self, step: _Step, states: dict) -> dict:
        here = self.position[step.index]
        new_states: dict[State, tuple[float, float, float, _Hist | None]] = {}
        # on a tie in cost, the state whose parent owed the least reduction, and whose step read
        # the fewest Partial inputs where a reduced copy would do, wins: among equal plans, the one
        # that reduces its Partial values where they are first needed (Megatron's: an all-reduce
        # right after the row-parallel matmul or the vocab-parallel embedding, whose result the
        # residual add reuses, not the Partial carried along the residual stream to be reduced
        # with the next one at the same cost). Scored only when a tie happens: each state keeps
        # the parent and resolutions that made it.
        # (keyed by the id of the state's value tuple, alive in new_states while it is looked up:
        # hashing a state key hashes every placement in it, and this saves one such hash per option)
        made_by: dict[int, tuple[tuple, frozenset, tuple]] = {}
        last_use = self.last_use
        dying = {j for j in step.inputs if last_use.get(j, -1) <= here}  # inputs last read here
        out_alive = last_use.get(step.index, -1) > here
        for (key, ready), (cost, comm, mem, hist) in states.items():
            live = dict(key)
            options, reason = self.options(step, live, ready, here)
            if not options:
                self.trace.backtrack_count += 1
                if len(self.trace.backtracks) < 200:
                    self.trace.backtracks.append({
                        "node": step.node.name, "target": str(step.node.target), "owner": step.owner,
                        "inputs": [str(self.placement(live, j)) for j in step.inputs], "reason": reason,
                    })
                continue
            staying = {j: p for j, p in key if j not in dying}
            still_ready = frozenset(r for r in ready if last_use.get(r[0], -1) > here)
            for o in options:
                nlive = dict(staying)
                nready = still_ready
                h = hist
                for j, p in o.resolved:
                    if j not in dying:
                        nlive[j] = p
                    if p != live[j].src and last_use.get(self.producer[j], -1) > here:
                        nready = nready | {(self.producer[j], p)}
                    h = _Hist(h, j, p, None, None)
                if o.param is not None and last_use.get(o.param[0], -1) > here:
                    nlive[o.param[0]] = o.param[1]
                if out_alive:
                    nlive[step.index] = o.out
                nkey = (tuple(sorted(nlive.items())), nready)  # (indices are distinct: only they are compared)
                total = cost + o.cost + o.mem
                prev = new_states.get(nkey)
                if prev is not None and total >= prev[0]:
                    if total > prev[0] + TIE * max(1.0, abs(total)) \
                            or self.tie_score(key, ready, o.resolved) >= self.tie_score(*made_by[id(prev)]):
                        continue
                if not isinstance(o.out, Pending):
                    h = _Hist(h, step.index, o.out, o.local, o.param)
                value = new_states[nkey] = (total, comm + o.cost, mem + o.mem, h)
                made_by[id(value)] = (key, ready, o.resolved)
        if not new_states:
            raise _no_plan(step, self.trace)
        if len(new_states) > self.opts.beam_width:
            new_states = self.prune(new_states)
        self.trace.max_states = max(self.trace.max_states, len(new_states))
        return new_states

    def prune(self, states: dict) -> dict:
        """Bound the frontier. First drop every state another state *dominates* (exact: no plan is
        lost, see :meth:`dominates`); then, if more than ``beam_width`` remain, keep the
        ``beam_width`` best-ranked states, plus, for every placement some live value takes in any
        state, the best-ranked state that has it. Without that cover a placement with few variants
        is crowded out by one with many (a reduce-scatter whose all-gather is still to come spawns
        more partial plans than the all-reduce it competes with, and looks cheaper until the
        all-gather is paid), and the beam loses the cheaper plan for good. The same for every
        :meth:`signature_of` some state shows: a cover of single placements does not keep the
        combinations that a later op reads together (the module docstring's T5 case). The
        cheapest state the beam drops bounds the optimum from below (the certificate)."""
        survivors = self.undominated(states)
        if len(survivors) <= self.opts.beam_width:
            return dict(survivors)
        return self.rank(survivors)

    def undominated(self, states: dict) -> list[tuple[State, tuple]]:
        """The states no other state dominates (:meth:`dominates`), cheapest first."""
        survivors: list[tuple[State, tuple]] = []
        # ``a`` can dominate ``b`` only if it places every value it cannot move the way ``b`` does,
        # except where ``b``'s edge is still pending (:meth:`dominates`). So the survivors are
        # indexed, for each set of pending values a state shows, by their placements of the other
        # unmovable values: a state is compared with the few survivors that can dominate it
        # instead of all of them (the pairwise scan was most of the solve time at real widths).
        # Exactly the same states survive.
        indexes: dict[frozenset, dict[tuple, list[tuple[State, tuple]]]] = {}
        self.live_at = {j: i for i, (j, _) in enumerate(next(iter(states))[0])} if states else {}

        def project(fixed: tuple, pending: frozenset) -> tuple:
            return tuple(item for item in fixed if item[0] not in pending)

        covers = self.covers = {}

        def cover(k: State) -> frozenset:
            """The placements state ``k`` holds its values in, ready or live (:meth:`dominates`)."""
            out = covers[id(k)] = k[1] | frozenset(k[0])
            return out

        movable, dominates = self.movable, self.dominates
        for key, value in sorted(states.items(), key=lambda kv: kv[1][0]):
            fixed = tuple([item for item in key[0] if item[0] not in movable])
            pending = frozenset([j for j, p in fixed if isinstance(p, Pending)])
            index = indexes.get(pending)
            if index is None:
                index = indexes[pending] = {}
                for survivor in survivors:
                    s_fixed = tuple([item for item in survivor[0][0] if item[0] not in movable])
                    index.setdefault(project(s_fixed, pending), []).append(survivor)
            rivals = index.get(project(fixed, pending) if pending else fixed, ())
            # where a rival can differ: the values this state may move, and its pending edges
            loose = [i for i, (j, p) in enumerate(key[0]) if j in movable or j in pending]
            ready = key[1]
            if ready and rivals:  # (dominates' first test, without a call per rival: most fail it)
                rivals = [(k, v) for k, v in rivals if ready <= k[1]] if not self.pinned else \
                    [(k, v) for k, v in rivals if ready <= (covers.get(id(k)) or cover(k))]
            cost = value[0]
            for k, v in rivals:
                if dominates(k, v[0], key, cost, loose):
                    break
            else:
                survivors.append((key, value))
                for other, other_index in indexes.items():
                    other_index.setdefault(project(fixed, other) if other else fixed, []).append((key, value))
        self.trace.dominated_states += len(states) - len(survivors)
        return survivors

    def rank(self, survivors: list[tuple[State, tuple]]) -> dict:
        """The beam's cut of the undominated states (see :meth:`prune`)."""
        # by cost paid (see the module docstring); among equal costs, the state that owes the least
        # reduction first: it wins ties when states merge (an all-reduce right after a row-parallel
        # matmul, not a Partial carried through a residual add with its R/N shares)
        ranked = sorted(survivors, key=lambda kv: kv[1][0])
        # (runs of costs within the weight of tier 3: states that differ in small-parameter memory
        # alone are ranked by the reduction they owe, see the module docstring)
        for start, end in _runs_of_near_cost(ranked, self.rank_within):
            ranked[start:end] = sorted(ranked[start:end], key=lambda kv: self.owed(*kv[0]))
        kept = dict(ranked[: self.opts.beam_width])
        covered = {item for key in kept for item in key[0]}
        for key, value in ranked[self.opts.beam_width:]:
            new = [item for item in key[0] if item not in covered]
            if new:
                kept[key] = value
                covered.update(new)
        signatures = {self.signature_of(key) for key in kept}
        for key, value in ranked[self.opts.beam_width:]:
            if key not in kept and (sig := self.signature_of(key)) not in signatures:
                kept[key] = value
                signatures.add(sig)
        self.trace.pruned_states += len(ranked) - len(kept)
        dropped = min((v[0] for k, v in ranked[self.opts.beam_width:] if k not in kept), default=float("inf"))
        self.trace.pruned_min = min(self.trace.pruned_min, dropped)
        return kept

    def signature_of(self, key: State) -> tuple:
        """The placements of ``key``'s live op outputs (:attr:`computed`): fixed until the later
        ops of their Dynamo node read them, which may accept only some combinations of them
        (``bmm`` needs q and k split alike), so :meth:`rank` keeps the cheapest state of each.
        Parameters and Dynamo-node outputs are left out: the per-placement cover keeps theirs,
        and their combinations would multiply the states (at most a few dozen extra states on
        the real-width plan matrix as it is)."""
        return tuple(item for item in key[0] if item[0] in self.computed)

    def dominates(self, a: State, cost_a: float, b: State, cost_b: float,
                  loose: list[int] | None = None) -> bool:
        """True if every completion of state ``b`` has a completion of ``a`` that costs no more.

        Both states cover the same step, so the same values are live. Where they place a value
        differently, that value must be *movable* (a Dynamo-node output read only through edges
        that may redistribute it, or a pending edge): ``a``'s plan can then follow ``b``'s by
        redistributing the value at its edges to whatever ``b``'s plan uses there, which costs
        at most :meth:`conversion` more. Placements ``b`` already holds a value in because an
        earlier edge paid for them (``ready``) and ``a`` does not are priced the same way: ``a``
        pays that redistribution at the later edge that reads it (the edge redistributed the value
        in ``b``'s plan, so it may in ``a``'s). ``a`` dominates if its cost plus those conversions
        does not exceed ``b``'s. ``loose``: the positions in the live tuples where the two may
        differ, when the caller knows they agree everywhere else (:meth:`prune`'s index).

        Only in a pinned graph (``pinned``), only where ``a`` holds each such value itself in the
        one placement ``b`` paid beyond ``a``'s, and only strictly below ``b``'s cost (ties stay
        with the beam's tie-break); elsewhere ``b``'s ready placements must be ready in ``a`` too.
        Requiring that in a pinned graph as well (as this did) kept, in a decode graph whose
        parameters the prefill pinned, a state that gathered the rotary tables once besides the
        one that kept them replicated: their costs drifted apart block by block, so no block
        matched an earlier one (``reused_nodes`` 0, 2.2 s CPU for 14 layers of the startup
        benchmark's model) where the prefill's blocks replay."""
        if cost_a > cost_b:
            return False
        (live_a, ready_a), (live_b, ready_b) = a, b
        if len(live_a) != len(live_b):
            return False
        unready: set[int] = set()  # values b holds ready in a placement a does not, not yet priced
        extra_ready = bool(ready_b) and not ready_b <= ready_a
        if extra_ready:
            if not self.pinned:
                return False
            # b holds values ready in placements a does not: a decides only where a holds each such
            # value itself in that placement (b paid a redistribution a never needs) and may move
            # it (the conversion below prices what b holds ready); any other pair of states is left
            # undecided, cheaply: most of them differ by more than their costs do
            cover = self.covers.get(id(a))
            if cover is None:  # (this, a C-level subset test, rejects nearly every such pair)
                cover = self.covers[id(a)] = ready_a | frozenset(live_a)
            if not ready_b <= cover:
                return False
            at = self.live_at
            for j, q in ready_b - ready_a:
                i = at.get(j)
                if i is None or j in unready or j not in self.movable or live_a[i] != (j, q):
                    return False
                unready.add(j)
        slack = cost_b - cost_a
        movable, conversions = self.movable, self.conversions
        for i in range(len(live_b)) if loose is None else loose:
            (j, pa), (jb, pb) = live_a[i], live_b[i]
            if j != jb:
                return False
            if pa is pb or pa == pb:
                continue
            if j not in movable and not isinstance(pb, Pending):
                return False
            if unready and j in unready:  # b's ready placements of j priced too (a's count for a)
                readies = (_ready_of(ready_a, j), _ready_of(ready_b, j))
                unready.discard(j)
                conversion = conversions.get((j, pa, pb, *readies))
                slack -= self.conversion(j, pa, pb, *readies) if conversion is None else conversion
            else:  # b holds j ready nowhere a does not: pricing neither's ready placements is an upper bound
                conversion = conversions.get((j, pa, pb))
                slack -= self.conversion(j, pa, pb) if conversion is None else conversion
            if slack < 0:
                return False
        if extra_ready and slack <= TIE * max(1.0, abs(cost_b)):
            return False  # a tie: left to the beam's tie-break (which reduces Partial values first)
        return not unready

    def conversion(self, j: int, pa: Any, pb: Any, ready_a: frozenset = frozenset(),
                   ready_b: frozenset = frozenset()) -> float:
        """An upper bound of what a plan pays more for value ``j`` starting from placement ``pa``
        (and the placements ``ready_a`` an earlier edge paid for) than from ``pb`` (``ready_b``)
        whatever the later edges ask for: the sum, over every placement ``q`` ``pb`` can reach
        or holds, of ``max(0, cost(pa -> q) - cost(pb -> q))`` (each redistribution of a value to
        one placement is paid once and shared). ``inf`` where ``pa`` cannot reach a placement
        ``pb`` reaches (a fused layout, ``R -> P``)."""
        key = (j, pa, pb, ready_a, ready_b) if ready_a or ready_b else (j, pa, pb)
        cached = self.conversions.get(key)
        if cached is not None:
            return cached
        spec = self.spec_of.get(j)
        src_a, free_a = (pa.src, pa.ready | {pa.src}) if isinstance(pa, Pending) else (pa, frozenset([pa]))
        src_b, free_b = (pb.src, pb.ready | {pb.src}) if isinstance(pb, Pending) else (pb, frozenset([pb]))
        free_a, free_b = free_a | ready_a, free_b | ready_b
        if not isinstance(spec, TensorSpec) or not isinstance(src_a, Placement) or not isinstance(src_b, Placement):
            total = float("inf")
        else:
            reach_a = set(edge_targets(src_a, spec, self.opts.world_size, self.opts.kv_groups))

            def cost_a(q: Placement) -> float:
                if q in free_a:
                    return 0.0
                return edge_cost(src_a, q, spec, self.opts) if q in reach_a else float("inf")

            def cost_b(q: Placement) -> float:
                return 0.0 if q in free_b else edge_cost(src_b, q, spec, self.opts)

            targets = set(edge_targets(src_b, spec, self.opts.world_size, self.opts.kv_groups)) | free_b
            # (summed exactly: the set's order is the placements' ids, which differ between runs)
            total = math.fsum(max(0.0, cost_a(q) - cost_b(q)) for q in targets)
        self.conversions[key] = total
        return total

    def owed(self, key: tuple, ready: frozenset = frozenset()) -> float:
        """The reductions a state's live ``Partial`` values still owe (each at least a
        reduce-scatter of its size); one-element Partials (mostly zero constants,
        ``where(mask, partial, 0)``, never reduced) are left out, and so are values already
        redistributed once (``ready``: the reduction is paid, a later edge reuses it). A
        tie-breaker, never a cost."""
        total, paid, by_value = 0.0, None, self.owed_by_value
        for j, p in key:
            if isinstance(p, Pending):
                p = p.src
            if isinstance(p, Partial):
                if ready and paid is None:
                    paid = {m for m, _ in ready}
                if not paid or j not in paid:
                    total += by_value(j, p)
        return total

    def tie_score(self, key: tuple, ready: frozenset, resolved: tuple) -> float:
        """Among states of equal cost, lower wins: what the parent (``key``, ``ready``) still owed,
        plus what the step read as Partial (``resolved``) where a reduced copy would have done."""
        return self.owed(key, ready) + sum(self.owed_by_value(j, p) for j, p in resolved)

    def owed_by_value(self, j: int, p: Any) -> float:
        """The reduction value ``j`` owes in placement ``p`` (0 unless ``p`` is Partial)."""
        if isinstance(p, Pending):
            p = p.src
        if not isinstance(p, Partial):
            return 0.0
        owed = self.owed_by.get(j)
        if owed is None:
            spec = self.spec_of.get(j)
            owed = edge_cost(p, Shard(0), spec, self.opts) if isinstance(spec, TensorSpec) and spec.numel > 1 else 0.0
            self.owed_by[j] = owed
        return owed

    def placement(self, live: dict, j: int) -> Any:
        return live[j] if j in live else self.fixed.get(j)

    def resolve_cost(self, j: int, pend: Pending, q: Placement) -> float:
        if q == pend.src or q in pend.ready:
            return 0.0
        return edge_cost(pend.src, q, self.spec_of[j], self.opts)

    def options(self, step: _Step, live: dict, ready: frozenset, here: int) -> tuple[list[_Option], str | None]:
        if step.kind == "edge":
            return self.edge_options(step, live, ready, here), None
        if step.kind == "mark":
            j = step.inputs[0]
            src = self.placement(live, j)
            if isinstance(src, Pending):  # a node that is the identity in ATen
                qs = edge_targets(src.src, self.spec_of[j], self.opts.world_size, self.opts.kv_groups)
                return [_Option(q, cost=self.resolve_cost(j, src, q), resolved=((j, q),)) for q in qs], None
            return [_Option(src)], None
        if step.kind == "getitem":
            src = self.placement(live, step.inputs[0])
            item = src[step.node.args[1]] if isinstance(src, tuple) else src
            return [_Option(item)], None
        return self.op_options(step, live)

    def edge_options(self, step: _Step, live: dict, ready: frozenset, here: int) -> list[_Option]:
        src_idx = step.inputs[0] if step.inputs else None
        src = self.placement(live, src_idx) if src_idx is not None else R
        if src_idx in self.params:
            if src is not None:
                return [_Option(src)]
            return [_Option(p, mem=m, param=(src_idx, p)) for p, m in self.free[src_idx].options
                    if not (step.is_output_edge and p != R)]
        if step.index in self.pinned_edges:
            return [_Option(src)]
        paid = frozenset(q for (m, q) in ready if m == src_idx)
        if step.is_output_edge:
            if step.spec is None:
                return [_Option(src)]
            if isinstance(src, StridedShard):
                return []  # a fused layout cannot be gathered in order
            gathered = _Option(R, cost=0.0 if R in paid else edge_cost(src, R, step.spec, self.opts))
            if self.opts.sharded_outputs and isinstance(src, (Shard, GroupedShard, HeadShard)):
                return [_Option(src), gathered]
            return [gathered]
        if step.spec is None or not self.alive_after(step.index, here):
            return [_Option(src)]
        return [_Option(Pending(src, paid))]

    def op_options(self, step: _Step, live: dict) -> tuple[list[_Option], str | None]:
        """Candidates of an op node. Inputs arriving through a pending edge are tried as they are
        and, when they are sharded or partial, also replicated (an early reduction can save a
        later, larger one); only when none of that is feasible are all redistributions tried."""
        ins = [self.placement(live, j) for j in step.inputs]
        key = (step.index, tuple(ins))  # the options depend on the inputs' placements only
        cached = self.option_cache.get(key)
        if cached is not None:
            return cached
        pending = sorted({j for j, p in zip(step.inputs, ins, strict=True) if isinstance(p, Pending)})
        if not pending:
            cands = self.rule(step, tuple(ins))
            out = [_Option(c.output, cost=self.internal_cost(c), mem=self.activation_cost(step, c.output),
                           local=c.local) for c in cands], getattr(cands, "reason", None)
        else:
            out = self.combos(step, ins, pending, [self.redistributions(j, live[j]) for j in pending], skip=None)
        self.option_cache[key] = out
        return out

    def redistributions(self, j: int, pend: Pending) -> list[tuple[Placement, float]]:
        """Every placement pending value ``j`` may take at its consumer, with what it costs."""
        key = (j, pend)
        out = self.redistribution_cache.get(key)
        if out is None:
            out = [(q, self.resolve_cost(j, pend, q))
                   for q in edge_targets(pend.src, self.spec_of[j], self.opts.world_size, self.opts.kv_groups)]
            self.redistribution_cache[key] = out
        return out

    def combos(self, step: _Step, ins: list, pending: list[int], choices: list[list[tuple[Placement, float]]],
               skip: list[list[tuple[Placement, float]]] | None) -> tuple[list[_Option], str | None]:
        out: list[_Option] = []
        reason = None
        tried = set(itertools.product(*[[q for q, _ in c] for c in skip])) if skip else set()
        for combo in itertools.product(*choices):
            if tuple(q for q, _ in combo) in tried:
                continue
            chosen = dict(zip(pending, combo, strict=True))
            trial = tuple(chosen[j][0] if j in chosen else p for j, p in zip(step.inputs, ins, strict=True))
            cands = self.rule(step, trial)
            if not cands:
                reason = reason or getattr(cands, "reason", None)
                continue
            extra = sum(c for _, c in combo)
            resolved = tuple((j, chosen[j][0]) for j in pending)
            out.extend(_Option(c.output, cost=extra + self.internal_cost(c), mem=self.activation_cost(step, c.output),
                               local=c.local, resolved=resolved) for c in cands)
        return out, reason

    def activation_cost(self, step: _Step, out: Any) -> float:
        """Memory cost of the full-size activations an op leaves on every rank (sequence
        parallelism, ``SolverOptions.activation_weight``; 0 when that weight is 0)."""
        weight = self.opts.activation_weight
        if not weight or step.index not in self.activations:
            return 0.0
        specs = step.spec if isinstance(step.spec, tuple) else (step.spec,)
        outs = out if isinstance(out, tuple) else (out,)
        world = self.opts.world_size
        return sum(weight * spec.nbytes * (world - 1) / world / max(self.opts.tokens, 1)
                   for spec, p in zip(specs, outs, strict=False)
                   if isinstance(spec, TensorSpec) and isinstance(p, (Replicate, Partial))
                   and spec.dtype.is_floating_point and spec.numel > 1)

    def internal_cost(self, c: Candidate) -> float:
        """The cost of the collectives a candidate's local rewrite issues itself (all-reduces)."""
        return sum(collective_cost(cost_bytes(Partial(), R, nbytes, self.opts.world_size), self.opts)
                   for _, nbytes in c.collectives)

    def rule(self, step: _Step, ins: tuple) -> list[Candidate]:
        key = (step.index, ins)
        cands = self.rule_cache.get(key)
        if cands is None:
            cands = _candidates(step, ins, self.rule_calls)
            self.rule_cache[key] = cands
        return cands


def _ready_of(ready: frozenset, j: int) -> frozenset:
    """The placements a state holds value ``j`` in besides its own (an earlier edge paid for them)."""
    return frozenset(q for m, q in ready if m == j)


def _runs_of_near_cost(ranked: list[tuple[State, tuple]], within: float) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of two or more states in a list sorted by cost whose costs lie
    at most ``within`` above the run's first (``within`` 0: exactly equal costs). With
    ``within = memory_weight``, the weight of all of tier 3 of the objective together, a run holds
    states whose costs differ by small-parameter memory (or by less than one communicated byte per
    token), never by a collective or a large parameter."""
    runs, start = [], 0
    for k in range(1, len(ranked) + 1):
        if k == len(ranked) or ranked[k][1][0] - ranked[start][1][0] > within:
            if k - start > 1:
                runs.append((start, k))
            start = k
    return runs


def _downstream(steps: list[_Step], sources: set[int]) -> set[int]:
    """Indices of the steps that depend on any of ``sources`` (steps are in topological order)."""
    reached = set(sources)
    for s in steps:
        if any(j in reached for j in s.inputs):
            reached.add(s.index)
    return reached - set(sources)


def find_segments(steps: list[_Step], last_use: dict[int, int], position: dict[int, int],
                  min_length: int = 24) -> list[tuple[int, int]]:
    """Cut the schedule into repeated blocks, found from the graph's structure (never from names).

    The period ``L`` is the shift at which the sequence of (kind, target, shape) agrees with itself
    most often; the repeated region is the longest run where ``step[k] ~ step[k+L]``; the cut phase
    inside a period is where the fewest values are live. Returns ``(start, end)`` step positions of
    consecutive segments of length ``L``.
    """
    n = len(steps)
    if n < 2 * min_length:
        return []
    codes: dict[tuple, int] = {}
    # (numpy, not torch: a comparison per shift, ~n/2 of them, where torch's per-op overhead was most of the cost)
    seq = np.array([codes.setdefault((s.kind, str(s.node.target), repr(s.spec)), len(codes)) for s in steps])
    best_len, best_hits = 0, 0
    for shift in range(min_length, n // 2 + 1):
        hits = int(np.count_nonzero(seq[shift:] == seq[:-shift]))
        if hits > best_hits * 1.05 or (best_len and hits > best_hits and shift % best_len):
            best_len, best_hits = shift, hits
    if best_len == 0 or best_hits < best_len:
        return []
    same = (seq[best_len:] == seq[:-best_len]).tolist()
    run_start, run_len, cur_start, cur_len = 0, 0, 0, 0
    for k, ok in enumerate(same):
        if ok:
            if cur_len == 0:
                cur_start = k
            cur_len += 1
            if cur_len > run_len:
                run_start, run_len = cur_start, cur_len
        else:
            cur_len = 0
    region_end = run_start + run_len + best_len
    if region_end - run_start < 2 * best_len:
        return []
    live = [0] * (n + 1)
    for k, s in enumerate(steps):
        lu = last_use.get(s.index, -1)
        if lu > k:
            live[k + 1] += 1
            live[lu + 1] -= 1
    for k in range(1, n + 1):
        live[k] += live[k - 1]
    phase = min(range(best_len), key=lambda f: live[run_start + f])
    cuts = list(range(run_start + phase, region_end - best_len + 1, best_len))
    return [(a, a + best_len) for a in cuts if a + best_len <= region_end]


def _schedule(steps: list[_Step]) -> list[_Step]:
    """Processing order: topological, but each graph-output edge right after its producer, so a
    value that is only returned (a KV-cache tensor, say) leaves the frontier at once instead of
    staying live, and multiplying states, until the end of the graph."""
    late = [s for s in steps if s.is_output_edge]
    by_input: dict[int, list[_Step]] = {}
    for s in late:
        by_input.setdefault(s.inputs[0] if s.inputs else -1, []).append(s)
    order = list(by_input.pop(-1, []))
    for s in steps:
        if s.is_output_edge:
            continue
        order.append(s)
        order.extend(by_input.pop(s.index, []))
    for rest in by_input.values():  # outputs that are placeholders
        order[:0] = rest
    return order


def _candidates(step: _Step, ins: tuple, calls: dict[tuple[int, tuple], list[Candidate]]) -> list[Candidate]:
    """The rule's candidates for ``step`` with inputs placed ``ins``, less those this step cannot
    take (a symbolic dim sharded, a local rewrite its Dynamo node cannot carry out); ``calls``
    caches the rule's own answers by ``(step.twin, ins)``."""
    if step.rule is None:
        if all(p is None or isinstance(p, Replicate) for p in ins):
            out = tuple(R if s is not None else None for s in step.spec) if isinstance(step.spec, tuple) else R
            return [Candidate(out)]
        return reject(f"no rule for {step.node.target}: replicated, so every input must be R")
    key = (step.twin, ins)
    cands = calls.get(key)
    if cands is None:
        cands = calls[key] = step.rule(step.opcall, ins)
    if cands and any(_shards_symbolic_dim(c.output, step.spec) for c in cands):
        kept = [c for c in cands if not _shards_symbolic_dim(c.output, step.spec)]
        if not kept:
            return reject(f"every candidate shards a dim of symbolic size {step.spec}: the graph runs at "
                          "sizes that may not divide by the world size")
        cands = kept
    if not any(needs_host(c.local) and c.local not in step.hosts for c in cands):
        return cands
    kept = [c for c in cands if not needs_host(c.local) or c.local in step.hosts]
    if kept:
        return kept
    tags = sorted({c.local for c in cands})
    return reject(f"needs the local rewrite {tags}, which Dynamo node {step.owner} cannot carry out")


def _decisions(steps: list[_Step], placements: dict, local: dict, fixed_idx: dict[int, Placement],
               rule: Any) -> list[Decision]:
    """Each op's decision (``SolveTrace.decisions``); ``rule``: the search's (cached) :meth:`_Search.rule`."""
    node_of = {s.index: s.node for s in steps}
    out: list[Decision] = []
    for step in steps:
        if step.kind != "op":
            continue
        ins = tuple(placements.get(node_of.get(j)) if j in node_of else fixed_idx.get(j) for j in step.inputs)
        cands = rule(step, ins)
        out.append(Decision(
            node=step.node.name, target=str(step.node.target), owner=step.owner,
            inputs=tuple(str(p) for p in ins), chosen=str(placements.get(step.node)),
            local=local.get(step.node), candidates=[str(c.output) for c in cands],
            note="no rule: replicated" if step.rule is None else getattr(cands, "reason", ""),
        ))
    return out


def _no_plan(step: _Step, trace: SolveTrace) -> SolverError:
    origin = step.node.meta.get("stack_trace") or ""
    line = origin.strip().splitlines()[-2:] if origin else []
    tried = trace.backtracks[-5:]
    return SolverError(
        f"no valid placement plan: every partial plan died at ATen node {step.node.name} "
        f"({step.node.target}) from Dynamo node {step.owner}.\n"
        f"  source: {' | '.join(x.strip() for x in line) or 'unknown'}\n"
        f"  last attempts: {tried}\n"
        "This is an autotp bug or an op whose rule is too strict; please report it with the trace "
        "(pass trace_dir=...)."
    )
