"""Rank 0's planning of a cold launch, in CPU seconds: decompose and solve of each graph the startup
benchmark compiles, here and (``--compare REV``) at another revision.

Question: what do the planning passes on the critical path of a cold ``parallelize_model`` launch
cost per graph (rank 0 plans, the other ranks wait for its plan), and does a change make them
cheaper without changing a plan?

Method: in a fresh process per tree and round, :func:`autotp.planner.plan_model` plans the startup
benchmark's model (``benchmarks/_checkpoint.py``'s ``--size``: its config, on the meta device, no
weights, at ``--tp`` over a simulated group) as ``parallelize_model`` compiles it: the warm-up
prefill (every parameter free) and the decode step (every parameter pinned by the prefill). Each
graph's Dynamo graph and example inputs (copied before lowering edits them) and its exact solver
inputs are kept, then decompose and solve run again ``--repeat`` times each, timed in process CPU
seconds (``time.process_time``: other processes on a shared machine are not counted, though they
still slow these). The trees alternate round by round. Per graph and tree: the CPU of each
decompose, each solve and its certificate, the plan's cost and bound, and a digest of every
placement, local rewrite and parameter placement, which must be equal between the trees (the
same plan; the costs equal within the solver's ``TIE``, 1e-9 relative: a tree that replays more
repeated blocks sums the same costs in another order). The plan-cache lookup and store are not
included (~0.01-0.05 s per graph).

Output: one JSON line per (tree, round) on stdout, a table on stderr, and ``cold_plan.json`` in
``--out`` (default ``benchmarks/results``).

    python benchmarks/cold_plan.py [--compare main] [--tp 2] [--rounds 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, stats, write_result  # noqa: E402
from _trees import alternate, compared_trees, run_child  # noqa: E402


def _digest(solution: Any) -> str:
    """Every placement, local rewrite and parameter placement of a plan, hashed."""
    text = json.dumps([sorted((n.name, str(p)) for n, p in solution.placements.items()),
                       sorted((n.name, str(t)) for n, t in solution.local.items()),
                       sorted((n.name, str(p)) for n, p in solution.params.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def child(size: str, tp: int, repeat: int) -> dict[str, Any]:
    """Plan the model once with the backend watched, then decompose and solve each graph again."""
    import transformers
    from _checkpoint import SIZES

    import autotp.backend as backend
    from autotp.passes.decompose import decompose
    from autotp.passes.solve import solve
    from autotp.planner import plan_model

    plan_graph, graphs = backend.plan_graph, []

    def watched(gm: Any, example_inputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        original = copy.deepcopy(gm)  # (lowering rewrites gm)
        plan = plan_graph(gm, example_inputs, *args, **kwargs)
        graphs.append((original, list(example_inputs), plan.record))
        return plan

    backend.plan_graph = watched
    try:
        plan_model(transformers.LlamaConfig(**SIZES[size]), tp, full_depth=True)
    finally:
        backend.plan_graph = plan_graph
    out: dict[str, Any] = {}
    for name, (gm, example_inputs, record) in zip(("prefill", "decode"), graphs, strict=False):
        decompose_cpu, solve_cpu, certificate_cpu = [], [], []
        for _ in range(repeat):
            gc.collect()
            start = time.process_time()
            decompose(gm, example_inputs)
            decompose_cpu.append(time.process_time() - start)
            gc.collect()
            start = time.process_time()
            solution = solve(record.shadow, record.opts, record.fixed, record.free, record.param_nodes)
            solve_cpu.append(time.process_time() - start)
            certificate_cpu.append((solution.trace.certificate or {}).get("cpu_s", 0.0))
        out[name] = {"decompose_cpu_s": decompose_cpu, "solve_cpu_s": solve_cpu, "certificate_cpu_s": certificate_cpu,
                     "cost": solution.cost, "lower_bound": solution.lower_bound, "plan": _digest(solution),
                     "aten_nodes": len(record.shadow.aten.graph.nodes), "reused_nodes": solution.trace.reused_nodes}
    return out


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    return run_child(tree, __file__, ["--child", "--size", args.size, "--tp", str(args.tp), "--repeat", str(args.repeat)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--size", default="150m", help="benchmarks/_checkpoint.py's size (default 150m)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per tree")
    parser.add_argument("--repeat", type=int, default=5, help="decomposes and solves per graph and process")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.size, args.tp, args.repeat)), flush=True)
        return 0

    provenance = Provenance.start(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with compared_trees(args.compare, "autotp-cold-plan-") as trees:
        runs = alternate(trees, args.rounds, lambda name, tree: run_tree(tree, args))
    results: dict[str, Any] = {}
    for graph in runs["this"][0]:
        entry: dict[str, Any] = {}
        for name in trees:
            last = runs[name][-1][graph]
            entry[name] = {key: stats([t for r in runs[name] for t in r[graph][key]])
                           for key in ("decompose_cpu_s", "solve_cpu_s", "certificate_cpu_s")}
            entry[name].update({k: last[k] for k in ("cost", "lower_bound", "plan", "aten_nodes", "reused_nodes")})
        if len(trees) == 2:
            this, other = (entry[name] for name in trees)
            # (costs within the solver's TIE: a replayed block adds its costs as one delta, so the sums
            # of a tree that replays more blocks differ in the last bits)
            entry["same_plan"] = this["plan"] == other["plan"] and math.isclose(this["cost"], other["cost"],
                                                                                 rel_tol=1e-9)
            entry["solve_ratio"] = this["solve_cpu_s"]["median"] / other["solve_cpu_s"]["median"]
            entry["decompose_ratio"] = this["decompose_cpu_s"]["median"] / other["decompose_cpu_s"]["median"]
        results[graph] = entry
        cells = [f"{name}: decompose {entry[name]['decompose_cpu_s']['median']:.3f} s, solve "
                 f"{entry[name]['solve_cpu_s']['median']:.3f} s (certificate {entry[name]['certificate_cpu_s']['median']:.3f})"
                 for name in trees]
        extra = f" | same plan: {entry['same_plan']}, solve x{entry['solve_ratio']:.2f}" if len(trees) == 2 else ""
        print(f"{graph:8s} " + "; ".join(cells) + extra, file=sys.stderr)
    write_result(out / "cold_plan.json", {"compare": args.compare, "size": args.size, "tp": args.tp,
                                          "rounds": args.rounds, "repeat": args.repeat, "graphs": results}, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
