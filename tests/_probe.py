"""A measuring aid for the suite's cost: with ``AUTOTP_TEST_PROBE_LOG=<file>`` set, every rank that
``tests/_dist.py: run_ranks`` starts appends one JSON line saying what it spent (:class:`RankProbe`),
and ``--cpu-per-file`` (``tests/conftest.py``) appends one line per test with its CPU seconds.
``python -m tests._probe <file>`` sums them per test file.

A rank's line: the test and rank function, the rank and world size, its CPU seconds (user + sys,
from its fork to its result) and wall seconds, how many graphs Dynamo traced in it, each graph's
plan-cache outcome (``hit``, ``miss``, ...), the decompose and solve CPU seconds of each graph it
solved, and each model's stored-graph outcome and key (model class, config digest, options). What
the suite spends is mostly these cold compiles: one Dynamo trace per graph on every rank, one solve
per graph on rank 0, for every distinct model, config, options and world size; a launch whose model
hits the stored graphs spends ~0.5 CPU-s a rank.

Off (the variable unset) nothing is recorded and nothing is patched. On, the probe wraps three
functions of autotp for the rank's life (``PlanCache._record``, ``backend._solve_summary``,
``GraphStore.__init__``) to read what they see; it changes nothing they do.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["PROBE_LOG", "RankProbe", "process_cpu_s", "summary"]

#: the environment variable naming the log file (JSON lines, appended)
PROBE_LOG = "AUTOTP_TEST_PROBE_LOG"


def process_cpu_s() -> float:
    """This process's CPU seconds (user + sys)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class RankProbe:
    """What one rank compiled, solved, found in the plan cache and the stored graphs, and spent;
    :meth:`write` appends it to the log."""

    def __init__(self, path: str, fn: Callable[..., Any], rank: int, world_size: int) -> None:
        from autotp import backend, plan_cache, stored_graphs

        self.path, self.start, self.cpu = path, time.perf_counter(), process_cpu_s()
        self.stores: list[Any] = []
        self.line: dict[str, Any] = {"fn": f"{fn.__module__}.{fn.__qualname__}", "rank": rank, "world": world_size,
                                     "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                     "plan_cache": [], "solves": []}
        record, summary, init = plan_cache.PlanCache._record, backend._solve_summary, stored_graphs.GraphStore.__init__

        def _record(cache: Any, lookup: Any) -> Any:
            self.line["plan_cache"].append(lookup.outcome.status)
            return record(cache, lookup)

        def _solve_summary(*args: Any) -> Any:
            timings = args[-1]  # (solution, shadow, opts, timings)
            self.line["solves"].append({k: round(v, 2) for k, v in timings.items() if k.endswith("cpu_s")})
            return summary(*args)

        def _init(store: Any, *args: Any, **kwargs: Any) -> None:
            init(store, *args, **kwargs)
            self.stores.append(store)

        plan_cache.PlanCache._record = _record
        backend._solve_summary = _solve_summary
        stored_graphs.GraphStore.__init__ = _init

    def write(self) -> None:
        from torch._dynamo.utils import counters

        self.line["dynamo_graphs"] = counters["stats"]["unique_graphs"]
        self.line["stored"] = [s.outcome.status for s in self.stores]
        self.line["stored_keys"] = [f"{s.key['model'].rsplit('.', 1)[-1]}:{s.key['config'][:8]}:{s.key['options']}"
                                    for s in self.stores]
        self.line["cpu_s"] = round(process_cpu_s() - self.cpu, 2)
        self.line["wall_s"] = round(time.perf_counter() - self.start, 2)
        with open(self.path, "a") as f:
            f.write(json.dumps(self.line) + "\n")


def log_test(nodeid: str, cpu_s: float) -> None:
    """Append a test's CPU seconds (``--cpu-per-file``'s figure) to the log, where one is set."""
    if os.environ.get(PROBE_LOG):
        with open(os.environ[PROBE_LOG], "a") as f:
            f.write(json.dumps({"test": nodeid, "test_cpu_s": round(cpu_s, 2)}) + "\n")


def summary(lines: list[dict[str, Any]]) -> list[str]:
    """Per test file: its tests' CPU seconds, its launches' rank CPU seconds, Dynamo graphs traced,
    plan-cache misses / lookups, stored-graph misses / models, and the CPU of ranks other than 0."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in lines:
        f = files[line["test"].split("::")[0]]
        if "test_cpu_s" in line:
            f["test_cpu_s"] += line["test_cpu_s"]
            continue
        f["rank_cpu_s"] += line["cpu_s"]
        f["other_ranks_cpu_s"] += line["cpu_s"] if line["rank"] else 0.0
        f["graphs"] += line["dynamo_graphs"]
        f["plan_misses"] += line["plan_cache"].count("miss")
        f["plan_lookups"] += len(line["plan_cache"])
        f["solve_cpu_s"] += sum(sum(s.values()) for s in line["solves"])
        f["stored_misses"] += line["stored"].count("miss")
        f["stored"] += len(line["stored"])
    out = [f"{'test CPU-s':>10} {'rank CPU-s':>10} {'ranks>0':>8} {'solve':>6} {'graphs':>6} {'plan miss':>10} "
           f"{'stored miss':>11}  file"]
    for name, f in sorted(files.items(), key=lambda item: -item[1]["test_cpu_s"]):
        out.append(f"{f['test_cpu_s']:10.1f} {f['rank_cpu_s']:10.1f} {f['other_ranks_cpu_s']:8.1f} "
                   f"{f['solve_cpu_s']:6.1f} {f['graphs']:6.0f} {f['plan_misses']:4.0f}/{f['plan_lookups']:<5.0f} "
                   f"{f['stored_misses']:5.0f}/{f['stored']:<5.0f}  {name}")
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as log:
        print("\n".join(summary([json.loads(line) for line in log if line.strip()])))
