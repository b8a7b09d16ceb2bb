"""The solver's certificate on the real-width plan matrix: each plan's cost, its lower bound, the gap
between them, and the solve time, here and (``--compare REV``) at another revision.

Question: is the plan proved optimal (``Solution.gap == 0``) at the widths users run, and what does
the certificate cost in solve time? (Issue 19's target: gap 0 on the whole matrix, solve time +20%
at most.)

Method: the matrix is tests/unit/test_plans_at_real_widths.py's (``CASES``: each architecture at a
public model's widths, 2 layers, every tp in 2, 4, 8 its sizes divide, and batch 2 where the
tree's matrix has it), read from the tree being measured. For each tree (this one; ``--compare REV`` also checks REV out in a throwaway git
worktree) and round, one fresh process plans every case once with
:func:`autotp.planner.plan_model` (meta device, forward only), keeps the exact solver inputs of its
graph, and solves them again ``--repeat`` times, each timed in process CPU seconds
(``time.process_time``: the machine may be shared, and other processes' time is not counted). The
trees alternate round by round, so drift on the machine hits both alike. Per case: the median solve
CPU time of each tree, their ratio, and each tree's cost, lower bound and gap (identical in every
repetition: the solver is deterministic), with the certificate that gave the bound
(``SolveTrace.certificate``: "lp" or "milp", the program's size and its CPU seconds, included in the
solve time; None where the beam dropped nothing, or on trees without it). With two trees, also the
ratio of this tree's solves less their own certificate's CPU (``ratio_without_certificate``: what
the rest of the solve costs against REV, i.e. the part of the ratio that is not the certificate) and
the certificate's share of this tree's solve; ``overall``: the median and range of each across the
cases and how many ratios exceed the target's x1.20. All of it is process CPU time, so other jobs
on a loaded machine are not counted, but they still slow these (shared caches, frequency): read
each ratio with the load averages in the provenance.

Output: one JSON line per (tree, round) on stdout, a table on stderr, and
``certificate_gap.json`` (``--name`` renames it) in ``--out`` (default ``benchmarks/results``).

    python benchmarks/certificate_gap.py [--compare main] [--cases gemma2-tp2 llama-tp4] [--rounds 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, stats, write_result  # noqa: E402
from _solve_timing import time_last_solve  # noqa: E402
from _trees import alternate, compared_trees, run_child  # noqa: E402


def child(cases: list[str], repeat: int) -> dict[str, Any]:
    """Every case of the matrix (or ``cases``) in this fresh process, with whichever autotp and
    tests ``PYTHONPATH`` selects."""
    from autotp.planner import plan_model
    from tests.unit.test_plans_at_real_widths import CASES, _config

    out: dict[str, Any] = {}
    for case in CASES:
        arch, tp, *batch = case.values  # (a tree whose matrix has a batch-2 column gives it third)
        name = case.id
        if cases and name not in cases:
            continue
        solutions: list[Any] = []
        solution, cpu = time_last_solve(
            functools.partial(plan_model, _config(arch), tp, decode=False, batch=batch[0] if batch else 1), repeat,
            solutions)
        # each timed solve's certificate CPU (included in its time; none where the tree has no certificate)
        certificates = [s.trace.certificate["cpu_s"] for s in solutions if getattr(s.trace, "certificate", None)]
        certificates = certificates if len(certificates) == len(cpu) else []
        certificate = getattr(solution.trace, "certificate", None)  # (None on trees without it)
        out[name] = {"solve_cpu_s": cpu, "certificate_cpu_s": certificates, "cost": solution.cost, "lower_bound": solution.lower_bound,
                     "gap": solution.gap, "pruned_states": solution.trace.pruned_states, "certificate": certificate}
    return out


def run_tree(tree: Path, cases: list[str], repeat: int) -> dict[str, Any]:
    return run_child(tree, __file__, ["--child", "--repeat", str(repeat), "--cases", *cases])


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per case: each tree's median solve CPU, certificate, and (with two trees) the time ratio."""
    names = list(runs)
    out: dict[str, Any] = {}
    for case in runs[names[0]][0]:
        entry: dict[str, Any] = {}
        for name in names:
            if case not in runs[name][-1]:  # that tree's matrix lacks the case
                continue
            last = runs[name][-1][case]
            entry[name] = {"solve_cpu_s": stats([t for r in runs[name] for t in r[case]["solve_cpu_s"]]),
                           **{k: last.get(k) for k in ("cost", "lower_bound", "gap", "pruned_states", "certificate")}}
        if len(entry) == 2 == len(names):
            this, base = (entry[name]["solve_cpu_s"]["median"] for name in names)
            entry["ratio"] = this / base
            certified = [t for r in runs[names[0]] for t in r[case].get("certificate_cpu_s", [])]
            if certified:  # the same solves less their certificate's CPU: what the rest of the solve costs
                entry["ratio_without_certificate"] = statistics.median(
                    t - c for r in runs[names[0]] for t, c in zip(r[case]["solve_cpu_s"], r[case]["certificate_cpu_s"],
                                                                  strict=True)) / base
                entry["certificate_share"] = statistics.median(certified) / this
        out[case] = entry
    return out


def overall(results: dict[str, Any]) -> dict[str, Any]:
    """Across the cases compared: the median and range of the solve-time ratio, how many exceed the
    target's x1.20, and the same for the ratio less the certificate's CPU; the median certificate share."""
    out: dict[str, Any] = {}
    for key in ("ratio", "ratio_without_certificate", "certificate_share"):
        values = [entry[key] for entry in results.values() if key in entry]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
            if key != "certificate_share":
                out[key]["above_1.20"] = sum(v > 1.20 for v in values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--cases", nargs="*", default=[], help="only these cases (e.g. gemma2-tp2); default all")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per tree")
    parser.add_argument("--repeat", type=int, default=3, help="solves per case and process")
    parser.add_argument("--name", default="certificate_gap", help="the JSON file name (without suffix)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.cases, args.repeat)), flush=True)
        return 0

    provenance = Provenance.start(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with compared_trees(args.compare, "autotp-certificate-") as trees:
        runs = alternate(trees, args.rounds, lambda name, tree: run_tree(tree, args.cases, args.repeat))
    results = summarize(runs)
    for case, entry in results.items():
        cells = [f"{name}: gap {entry[name]['gap']:.1f}, solve {statistics.median(entry[name]['solve_cpu_s']['all']):.3f} s"
                 for name in trees if name in entry]
        ratio = f" (x{entry['ratio']:.2f})" if "ratio" in entry else ""
        print(f"{case:14s} " + "; ".join(cells) + ratio, file=sys.stderr)
    summary = overall(results)
    for key, value in summary.items():
        print(f"{key}: median {value['median']:.3f} ({value['min']:.2f}-{value['max']:.2f}, {value['n']} cases"
              + (f", {value['above_1.20']} above 1.20)" if "above_1.20" in value else ")"), file=sys.stderr)
    write_result(out / f"{args.name}.json", {"compare": args.compare, "rounds": args.rounds, "repeat": args.repeat,
                                             "overall": summary, "cases": results}, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
