"""Time the solver alone on the inputs a real plan gives it (shared by ``solver_scaling.py
--compare`` and ``certificate_gap.py``, which run it in fresh processes against whichever autotp
``PYTHONPATH`` selects)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_last_solve(plan: Callable[[], Any], repeat: int, solutions: list[Any] | None = None
                    ) -> tuple[Any, list[float]]:
    """Run ``plan()`` (a ``plan_model`` call) with the backend's solver watched, then solve its last
    graph again ``repeat`` times from the same inputs: the last solution and each solve's CPU
    seconds (``solutions``, where given, receives every timed solve's solution). Every revision's
    backend calls the solver through the ``autotp.backend.solve`` module global, so the watch works
    on older trees too."""
    import autotp.backend as backend

    solve = backend.solve
    calls: list[tuple[tuple, dict]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return solve(*args, **kwargs)

    backend.solve = spy
    try:
        plan()
    finally:
        backend.solve = solve
    args, kwargs = calls[-1]
    cpu, solution = [], None
    for _ in range(repeat):
        start = time.process_time()
        solution = solve(*args, **kwargs)
        cpu.append(time.process_time() - start)
        if solutions is not None:
            solutions.append(solution)
    return solution, cpu
