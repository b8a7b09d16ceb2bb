"""How planning time grows with depth: Dynamo trace, decompose and solve time against layer count.

Question: does ``autotp plan`` stay linear in the number of decoder layers (the solver reuses the
solution of repeated blocks), so that a Llama-3-70B-shaped model (80 layers) plans in about 80/32
of the 8B-shaped time?

Method: for each layer count (default 8, 16, 32, 80) a fresh Python process builds a
Llama-3-8B-shaped config (hidden 4096, 32 heads / 8 kv heads, MLP 14336, vocab 128256, bf16) with
that many layers and runs :func:`autotp.planner.plan_model` at ``--tp`` (default 8) on the meta
device, forward only unless ``--decode``. A fresh process per point keeps Dynamo's caches and the
allocator out of the comparison. Each child reports the planner's phase timings (wall seconds)
and its own CPU seconds (``time.process_time``): on a shared machine the wall clock also counts
time other processes took, CPU seconds do not. ``--extra llama3-70b mixtral-8x7b`` adds the real
70B shape (hidden 8192, 64 heads, MLP 28672, 80 layers) and a Mixtral-8x7B shape.

The plot shows CPU seconds per phase (and the whole process's CPU and wall time).

Since ``autotp/depth.py`` a deep model is planned from a shortened stand-in. ``--full-depth``
also plans each point tracing every layer and records whether the two reports are equal
(``PlanReport.plan_json`` digests); ``--label`` keeps a note (such as how loaded the machine was) in
the JSON; ``--shape`` picks the shape ``--layers`` varies.

``--cached`` times the command a user runs instead: each point's config is saved to a folder
(``config.json`` only) and ``python -m autotp plan FOLDER --tp N --json`` runs in a fresh process
with a fresh ``AUTOTP_CACHE_DIR``, empty, then again with the report it stored
(``autotp/report_cache.py``): the wall time of the whole command (interpreter start to exit) and
its CPU seconds (``RUSAGE_CHILDREN``), and the digest of its plan (the JSON less timings, solver
cost, ``depth`` and the folder's name). ``--tree DIR`` runs the command from another checkout (its ``PYTHONPATH``),
so two trees are timed by one script under the same conditions:

    python benchmarks/solver_scaling.py --shape llama3-70b --layers 32 80 --decode --cached [--tree /other/checkout]

Output: one JSON line per point on stdout, ``solver_scaling.json`` (all points plus the machine;
``--name`` renames it) and ``solver_scaling.png`` (matplotlib, if installed; otherwise a message
says it was skipped) in ``--out`` (default ``benchmarks/results``).

    python benchmarks/solver_scaling.py [--layers 8 16 32 80] [--tp 8] [--decode] [--extra llama3-70b]
        [--full-depth] [--cached] [--label TEXT] [--name NAME]

``--compare REV`` times the solver alone against another revision instead: the revision is checked
out in a throwaway git worktree, and for each ``--shapes`` entry (default ``gemma2-9b``, the widths
of tests/unit/test_plans_at_real_widths.py: fp32, tied, eager attention) at ``--tp`` with the first
``--layers`` value, a fresh process per tree and round (the trees alternate, ``--rounds`` times)
plans the model once, keeps the exact solver inputs of its graph, and solves them again
``--repeat`` times, each timed in process CPU seconds (``time.process_time``: the machine may be
shared). The medians over all repetitions, their ratio, each tree's cost and certificate
(``lower_bound``, ``gap``, where the revision has them) go to ``solver_compare.json``:

    python benchmarks/solver_scaling.py --compare e39f0a3^ --layers 8 --tp 2 [--shapes gemma2-9b llama3-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, pyplot, write_result  # noqa: E402
from _solve_timing import time_last_solve  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        cls="LlamaConfig",
        arch="LlamaForCausalLM",
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        num_hidden_layers=32,
    ),
    "llama3-70b": dict(
        cls="LlamaConfig",
        arch="LlamaForCausalLM",
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        num_hidden_layers=80,
    ),
    "mixtral-8x7b": dict(
        cls="MixtralConfig",
        arch="MixtralForCausalLM",
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=32,
    ),
    # the widths the real-width plan tests use (fp32, tied embeddings, eager attention)
    "gemma2-9b": dict(
        cls="Gemma2Config",
        arch="Gemma2ForCausalLM",
        hidden_size=3584,
        num_attention_heads=16,
        head_dim=256,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=256000,
        num_hidden_layers=42,
        test_widths=True,
    ),
}


def make_config(shape: str, layers: int | None = None) -> Any:
    import transformers

    spec = dict(SHAPES[shape])
    cls, arch, test_widths = spec.pop("cls"), spec.pop("arch"), spec.pop("test_widths", False)
    if layers is not None:
        spec["num_hidden_layers"] = layers
    if test_widths:
        config = getattr(transformers, cls)(**spec)
        config._attn_implementation = "eager"  # Gemma-2's soft-capping needs it
    else:
        config = getattr(transformers, cls)(**spec, dtype="bfloat16", tie_word_embeddings=False)
    config.architectures = [arch]
    return config


def child(shape: str, layers: int | None, tp: int, decode: bool, full_depth: bool = False) -> dict[str, Any]:
    """One point, in this (fresh) process."""
    import hashlib

    cpu0, wall0 = time.process_time(), time.perf_counter()
    from autotp.planner import plan_model

    import_s = time.perf_counter() - wall0
    config = make_config(shape, layers)
    report = plan_model(config, tp, decode=decode, full_depth=full_depth)
    plan = json.dumps(report.plan_json(), sort_keys=True, default=str)
    return {
        "shape": shape,
        "layers": config.num_hidden_layers,
        "tp": tp,
        "decode": decode,
        "full_depth": full_depth,
        "depth": report.depth,
        "cache_dir": os.environ.get("AUTOTP_CACHE_DIR"),
        # equal digests: equal reports, less how they were computed (PlanReport.plan_json)
        "plan_digest": hashlib.sha256(plan.encode()).hexdigest(),
        "timings": report.timings,
        "import_s": import_s,
        "process_wall_s": time.perf_counter() - wall0,
        "process_cpu_s": time.process_time() - cpu0,
        "collectives": report.collectives,
        "collectives_per_token": report.decode.collectives if report.decode else None,
        "decode_note": report.decode_note,
        "block_collectives": sorted(
            {json.dumps(v, sort_keys=True) for blocks in report.block_collectives().values() for v in blocks.values()}
        ),
        "param_bytes_per_rank": report.param_bytes_per_rank,
    }


def child_resolve(shape: str, layers: int, tp: int, repeat: int) -> dict[str, Any]:
    """Plan once, then time ``repeat`` solves of the same solver inputs (in this fresh process,
    with whichever autotp ``PYTHONPATH`` selects)."""
    import inspect

    from autotp.planner import plan_model

    # every layer traced and solved in every tree (a tree with autotp/depth.py would otherwise
    # solve a shortened stand-in and time a smaller graph)
    whole = {"full_depth": True} if "full_depth" in inspect.signature(plan_model).parameters else {}
    solution, cpu = time_last_solve(lambda: plan_model(make_config(shape, layers), tp, decode=False, **whole),
                                    repeat)
    return {"shape": shape, "layers": layers, "tp": tp, "solve_cpu_s": cpu, "cost": solution.cost,
            "lower_bound": getattr(solution, "lower_bound", None), "gap": getattr(solution, "gap", None),
            "reused_nodes": solution.trace.reused_nodes, "pruned_states": solution.trace.pruned_states}


def compare(rev: str, shapes: list[str], layers: int, tp: int, rounds: int, repeat: int, out: Path,
            provenance: Provenance) -> int:
    """Solver CPU time of this tree against revision ``rev`` (see the module docstring)."""
    import statistics

    from _record import stats
    from _trees import alternate, compared_trees, run_child

    results: dict[str, Any] = {}
    with compared_trees(rev, "autotp-compare-") as trees:
        for shape in shapes:
            args = ["--child-resolve", shape, str(layers), "--tp", str(tp), "--repeat", str(repeat)]
            runs = alternate(trees, rounds, lambda name, tree, args=args, shape=shape:
                             run_child(tree, __file__, args, label=f"{name} {shape}"))
            entry = {name: {"solve_cpu_s": stats([t for r in rs for t in r["solve_cpu_s"]]),
                            **{k: rs[-1][k] for k in ("cost", "lower_bound", "gap", "reused_nodes", "pruned_states")}}
                     for name, rs in runs.items()}
            entry["ratio"] = statistics.median(entry["this"]["solve_cpu_s"]["all"]) / statistics.median(
                entry[rev]["solve_cpu_s"]["all"])
            results[shape] = entry
            print(f"{shape} layers={layers} tp={tp}: solve CPU median {entry['this']['solve_cpu_s']['median']:.3f} s "
                  f"here, {entry[rev]['solve_cpu_s']['median']:.3f} s at {rev} (x{entry['ratio']:.2f})", flush=True)
    write_result(out / "solver_compare.json", {"rev": rev, "layers": layers, "tp": tp, "rounds": rounds,
                                               "repeat": repeat, "shapes": results}, provenance)
    return 0


#: what ``autotp plan --json`` holds about how the plan was computed (``PlanReport.plan_json`` drops it)
_COMPUTATION = ("timings", "solver", "depth")
_COMPUTATION_PER_GRAPH = ("timings", "cost", "lower_bound", "extra_cost_of_overrides")


def run_command(shape: str, layers: int | None, tp: int, decode: bool, timeout: float, cache_dir: str,
                tree: Path) -> dict[str, Any]:
    """``python -m autotp plan`` of the point's config folder, from ``tree``, timed from outside."""
    import hashlib
    import resource

    folder = Path(cache_dir) / "model"
    if not folder.exists():
        make_config(shape, layers).save_pretrained(folder)
    cmd = [sys.executable, "-m", "autotp", "plan", os.fspath(folder), "--tp", str(tp), "--json"] + (
        [] if decode else ["--no-decode"])
    env = dict(os.environ, AUTOTP_CACHE_DIR=os.fspath(Path(cache_dir) / "cache"), PYTHONPATH=os.fspath(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tree)
    except subprocess.TimeoutExpired:
        return {"shape": shape, "layers": layers, "tp": tp, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        return {"shape": shape, "layers": layers, "tp": tp, "error": proc.stderr.strip()[-2000:],
                "command_wall_s": wall}
    report = json.loads(proc.stdout)
    timings, depth = report.get("timings", {}), report.get("depth")
    report.pop("model")  # the point's temporary folder
    for key in _COMPUTATION:
        report.pop(key, None)
    for graph in report.get("graphs", []):
        for key in _COMPUTATION_PER_GRAPH:
            graph.pop(key, None)
    return {
        "shape": shape, "layers": layers or SHAPES[shape]["num_hidden_layers"], "tp": tp, "decode": decode,
        "full_depth": False, "tree": os.fspath(tree), "command": " ".join(cmd[1:]),
        "tree_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                                      text=True).stdout.strip() or None,
        "command_wall_s": wall,
        "command_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "timings": timings, "depth": depth,
        "plan_digest": hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest(),
        "collectives": report["collectives"], "collectives_per_token": report["collectives_per_token"],
    }


def run_point(shape: str, layers: int | None, tp: int, decode: bool, timeout: float, full_depth: bool = False
              ) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", shape, str(layers or 0), "--tp", str(tp)] + (
        ["--decode"] if decode else []
    ) + (["--full-depth"] if full_depth else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"shape": shape, "layers": layers, "tp": tp, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"shape": shape, "layers": layers, "tp": tp, "error": " | ".join(tail), "command_wall_s": wall}
    point = json.loads(lines[-1])
    point["command_wall_s"] = wall
    return point


def _compare_depths(points: list[dict[str, Any]]) -> None:
    """Mark each stand-in point with whether its report equals the full-depth point's."""
    full = {(p["shape"], p["layers"]): p.get("plan_digest") for p in points if p.get("full_depth") and "error" not in p}
    for p in points:
        key = (p["shape"], p["layers"])
        if not p.get("full_depth") and key in full and "error" not in p:
            p["same_plan_as_full_depth"] = p["plan_digest"] == full[key]


def plot(points: list[dict[str, Any]], path: Path) -> str:
    plt = pyplot()
    if plt is None:
        return "no PNG written"
    if not points:
        return "no point to plot"
    ok = sorted(
        (p for p in points if "process_cpu_s" in p and p["shape"] == points[0]["shape"]), key=lambda p: p["layers"]
    )
    if not ok:
        return "no successful point to plot"
    xs = [p["layers"] for p in ok]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("trace", "Dynamo trace"), ("decompose", "decompose"), ("solve", "solve")):
        ax.plot(xs, [p["timings"][f"{key}_cpu_s"] for p in ok], marker="o", label=f"{label} (CPU)")
    ax.plot(xs, [p["process_cpu_s"] for p in ok], marker="s", linestyle="--", label="whole process (CPU)")
    ax.plot(xs, [p["process_wall_s"] for p in ok], marker="x", linestyle=":", label="whole process (wall)")
    ax.set_xlabel(f"decoder layers ({ok[0]['shape']} shape)")
    ax.set_ylabel("seconds")
    ax.set_title(f"autotp plan time against depth, tp={ok[0]['tp']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 80])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES), help="the shape --layers varies")
    parser.add_argument(
        "--decode", action="store_true", help="also plan a decode step (two graphs per point)"
    )
    parser.add_argument(
        "--extra",
        nargs="*",
        default=[],
        choices=[s for s in SHAPES if s != "llama3-8b"],
        help="also plan these full-size shapes",
    )
    parser.add_argument(
        "--full-depth", action="store_true", help="also plan every point tracing every layer (no stand-in), "
        "and say whether its report equals the stand-in's (PlanReport.plan_json)"
    )
    parser.add_argument(
        "--cached", action="store_true", help="time the command (python -m autotp plan FOLDER --json) for "
        "every point twice with a fresh AUTOTP_CACHE_DIR: empty, then again with what the first run stored"
    )
    parser.add_argument("--tree", default=None, help="--cached: run the command from this checkout "
                        "(default: the one holding this script)")
    parser.add_argument("--label", default="", help="a note kept in the JSON (e.g. 'machine loaded by others')")
    parser.add_argument("--name", default="solver_scaling", help="the JSON / PNG file name (without suffix)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    parser.add_argument("--compare", metavar="REV", help="time the solver alone against git revision REV")
    parser.add_argument("--shapes", nargs="+", default=["gemma2-9b"], choices=list(SHAPES),
                        help="shapes --compare solves")
    parser.add_argument("--rounds", type=int, default=3, help="--compare: fresh processes per tree")
    parser.add_argument("--repeat", type=int, default=3, help="--compare: solves per process")
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "LAYERS"), help=argparse.SUPPRESS)
    parser.add_argument("--child-resolve", nargs=2, metavar=("SHAPE", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        shape, layers = args.child[0], int(args.child[1]) or None
        print(json.dumps(child(shape, layers, args.tp, args.decode, args.full_depth)), flush=True)
        return 0
    if args.child_resolve:
        shape, layers = args.child_resolve[0], int(args.child_resolve[1])
        print(json.dumps(child_resolve(shape, layers, args.tp, args.repeat)), flush=True)
        return 0

    provenance = Provenance.start(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        return compare(args.compare, args.shapes, args.layers[0], args.tp, args.rounds, args.repeat, out, provenance)
    points = []
    todo = [(args.shape, n) for n in args.layers] + [(s, None) for s in args.extra]
    tree = Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parent.parent
    for shape, layers in todo:
        if args.cached:
            folder = tempfile.mkdtemp(prefix="autotp-plan-cache-")
            for cache_state in ("empty", "cached"):
                point = run_command(shape, layers, args.tp, args.decode, args.timeout, folder, tree)
                point["plan_cache"] = cache_state
                print(json.dumps(point), flush=True)
                points.append(point)
        runs = [dict(full_depth=False)] * (not args.cached) + [dict(full_depth=True)] * args.full_depth
        for run in runs:
            point = run_point(shape, layers, args.tp, args.decode, args.timeout, **run)
            point["plan_cache"] = None
            print(json.dumps(point), flush=True)
            points.append(point)
    _compare_depths(points)
    write_result(out / f"{args.name}.json", {"tp": args.tp, "label": args.label, "points": points}, provenance)
    print(plot([p for p in points if not p.get("full_depth") and p.get("plan_cache") != "cached"],
               out / f"{args.name}.png"))
    return 0 if all("error" not in p for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
