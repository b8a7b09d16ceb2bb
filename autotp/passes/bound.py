"""Branch and bound below a plan: prove the beam's plan optimal, or find the cheaper one it lost.

After the beam (:func:`autotp.passes.solve.solve`) finds a plan of cost ``U``, every plan that costs
less passes, at every step, through a partial plan whose paid cost plus its cost still to come is
below ``U``. :func:`search_below` runs the solver's frontier search again with no beam: it keeps
every partial plan whose paid cost plus ``to_go`` is below ``U`` and drops only those that cannot
beat ``U`` and those another state dominates (exact, ``_Search.dominates``). When its frontier
empties, no plan is cheaper than ``U`` (the plan is optimal: gap 0, proved); when complete plans
remain, the cheapest of them is the optimum. The solver runs it only where the certificate's linear
program (``autotp/passes/ilp.py``) leaves a gap: that program bounds the optimum, this search is what
replaces the plan by a cheaper one.

``to_go(position, state)`` must never exceed the state's exact cost still to come (*admissible*);
0 always is. The frontier is capped (``max_states``): past the cap the search gives up and returns
the least paid cost plus ``to_go`` on its frontier at that step, itself a lower bound of the
optimum (every cheaper plan passes through a frontier state or one a frontier state dominates), so
the caller keeps the larger of it and the beam's bound.

What it costs depends on ``to_go`` alone: the solver's module docstring ("Certificate") gives the
frontier sizes measured at real widths. With ``to_go = 0`` it finishes on small graphs only.

Repeated blocks are not replayed here (a block's recorded transitions are relative to its incoming
costs, while the cutoff is absolute), so the search costs one pass over every node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotp.errors import SolverError
from autotp.passes.solve import SolveTrace, State, _Search, _Step

#: an admissible bound on a state's cost still to come: (schedule position, state) -> cost
ToGo = Callable[[int, State], float]


@dataclass
class Below:
    """What :func:`search_below` found: ``states`` (complete plans cheaper than the incumbent,
    possibly none) when it finished, else ``None`` and ``bound``, a lower bound of the optimum;
    ``max_states``: the widest frontier it kept."""

    states: dict | None
    bound: float
    max_states: int


class _GiveUp(Exception):  # noqa: N818 (control flow, not an error)
    def __init__(self, bound: float) -> None:
        super().__init__(bound)
        self.bound = bound


class _BelowSearch(_Search):
    """The solver's frontier search with the beam replaced by a cutoff at the incumbent's cost."""

    def __init__(self, *args: Any, incumbent: float, to_go: ToGo, max_states: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incumbent, self.to_go, self.max_states = incumbent, to_go, max_states
        self.here = 0
        self.widest = 0

    def run(self) -> dict:
        states: dict = {((), frozenset()): (0.0, 0.0, 0.0, None)}
        for step in self.steps:
            states = self.advance(step, states)
        return states

    def advance(self, step: _Step, states: dict) -> dict:
        if not states:  # every partial plan was cut off: none beats the incumbent
            return states
        self.here = self.position[step.index]
        try:
            return super().advance(step, states)
        except SolverError:  # every partial plan died here: none beats the incumbent
            return {}

    def prune(self, states: dict) -> dict:
        here, to_go, cutoff = self.here, self.to_go, self.incumbent
        bounded = {key: value for key, value in states.items() if value[0] + to_go(here, key) < cutoff}
        survivors = self.undominated(bounded) if len(bounded) > 1 else list(bounded.items())
        self.widest = max(self.widest, len(survivors))
        if len(survivors) > self.max_states:
            raise _GiveUp(min(value[0] + to_go(here, key) for key, value in survivors))
        return dict(survivors)


def search_below(search: _Search, incumbent: float, to_go: ToGo | None = None, max_states: int = 4096) -> Below:
    """Search every plan cheaper than ``incumbent`` over the steps of ``search`` (a :class:`_Search`
    the beam ran; its inputs are reused, its trace is not touched). See the module docstring."""
    trace = SolveTrace()
    below = _BelowSearch(search.steps, search.position, search.last_use, search.fixed, search.free, search.params,
                         dataclasses.replace(search.opts, beam_width=0), trace, search.pinned_edges,
                         incumbent=incumbent, to_go=to_go or (lambda here, key: 0.0), max_states=max_states)
    try:
        states = below.run()
    except _GiveUp as stop:
        return Below(None, min(stop.bound, incumbent), below.widest)
    return Below(states, min((v[0] for v in states.values()), default=incumbent), below.widest)
