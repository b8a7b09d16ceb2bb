"""The whole job as a user waits for it: start the process, import, load, greedily generate 16 new
tokens from a 16-token prompt, exit.

    python benchmarks/startup.py --tp 2 --rounds 3 \\
        --out benchmarks/results/startup_tp2_fp32.json [--png startup.png]
    python benchmarks/startup.py --plot benchmarks/results/startup_tp2_fp32.json   # its PNG beside it
    python benchmarks/startup.py --size small --rounds 1   # smoke run of the script
    python benchmarks/startup.py --engines autotp_cold,autotp_warm --plain-call   # + a plain call

``AUTOTP_BENCH_PROFILE=<folder>`` runs each launched rank under cProfile and writes
``<folder>/<engine>-rank<r>.prof`` (the timings then include the profiler's overhead).

``--plain-call`` adds one plain ``model(input_ids=prompt)`` call between the load and the generate
(``plain_s``): under ``parallelize_model`` it reuses the warm-up's graph (``autotp/prefill_call.py``).

Same checkpoint for every engine (``benchmarks/_checkpoint.py``; ``--size small`` is a
6M-parameter one for checking the script, which proves nothing about speed). Engines, each its
own process tree, timed by the parent from before the launch to after the exit (so the
interpreter's start, the imports, torch's elastic launcher and the teardown all count):

* ``autotp_cold``: ``parallelize_model`` on ``--tp`` ranks with an empty plan cache (a fresh
  ``AUTOTP_CACHE_DIR`` per round): every graph is decomposed and solved;
* ``autotp_warm``: the same with the cache the round's ``autotp_cold`` launch left: every graph
  should hit (the JSON has each rank-0 graph's outcome);
* ``autotp_nocache`` (only when named in ``--engines``): the same with ``AUTOTP_CACHE=0``, no plan
  cache and no stored graphs (plain ``torch.compile``): what a cold launch pays for filling them;
* ``transformers_tp``: ``from_pretrained(..., tp_plan="auto")`` on ``--tp`` ranks (gloo, CPU);
* ``one_process``: plain transformers in one process.

Launches alternate ``autotp_cold autotp_warm transformers_tp one_process`` for ``--rounds`` rounds
(the warm launch must follow the cold one that fills its cache), so drift on a shared machine hits
all engines alike. Reported per engine: every wall time, the median, min, max and spread (max -
min), and rank 0's own phases (``import_s``: torch + transformers + autotp; ``load_s``;
``generate_s``; ``exit_s``: from rank 0's report, written after its generate, to the end of the
launch as the parent saw it, so the group's teardown, the ranks' interpreter exits and the
launcher's; ``cpu_s``: its CPU seconds, steadier than the wall on a loaded machine; for autotp
``phases``: per compiled graph Dynamo's trace, the backend and the guards, and what rank 0's
planning cost, see ``_compile_phases`` and ``_planning_phases``), plus ratios of medians against ``transformers_tp`` and ``one_process``, whether
all engines produced the same tokens, each engine's peak RSS and anonymous memory, and the run's
provenance (``benchmarks/_record.py``: commit, date, command, versions, machine, load averages). Each rank uses ``cores // ranks`` threads unless ``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, checkpoint_name, launch, memory, pyplot, stats, write_result  # noqa: E402

ENGINES = ("autotp_cold", "autotp_warm", "transformers_tp", "one_process")
#: engines that run only when ``--engines`` names them
OPTIONAL_ENGINES = ("autotp_nocache",)
PROMPT_TOKENS = 16
NEW_TOKENS = 16


def _worker(engine: str, folder: str, result: str, dtype_name: str, plain_call: bool = False) -> None:
    """One launch: import, load with ``engine``, (with ``plain_call``: one plain ``model(input_ids=...)``
    call of the prompt,) generate; rank 0 writes its phases as JSON."""
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    import transformers

    if engine.startswith("autotp"):
        from autotp import parallelize_model
    import_s = time.perf_counter() - t0

    transformers.logging.set_verbosity_error()
    distributed = engine != "one_process"
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    dtype = getattr(torch, dtype_name)
    t = time.perf_counter()
    if engine.startswith("autotp"):
        model = parallelize_model(folder, tp_size=world, dtype=dtype, progress=False)
    elif engine == "transformers_tp":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    ids = (torch.arange(PROMPT_TOKENS) * 7919 % (vocab - 1) + 1).unsqueeze(0)  # (1, 16), deterministic
    plain_s = None
    if plain_call:
        t = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids)
        plain_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    generate_s = time.perf_counter() - t
    if rank == 0:
        report: dict[str, Any] = {
            "engine": engine,
            "world_size": world,
            "threads": torch.get_num_threads(),
            "import_s": import_s,
            "load_s": load_s,
            "generate_s": generate_s,
            "plain_s": plain_s,
            "tokens": out[0, PROMPT_TOKENS:].tolist(),
            "memory": memory(),
        }
        if engine.startswith("autotp"):
            report["graphs_compiled"] = model.autotp.context.graphs_compiled
            report["plan_cache"] = [o.as_dict() for o in model.autotp.context.plan_cache.outcomes]
            stored = model.autotp.context.stored_graphs
            report["stored_graphs"] = stored.as_dict() if stored is not None else None
            report["phases"] = _compile_phases()
        report["cpu_s"] = time.process_time()  # rank 0's CPU from its start (the parent times the wall)
        report["done_at"] = time.time()  # the parent times the exit from here (exit_s)
        Path(result).write_text(json.dumps(report))
    if distributed:
        dist.destroy_process_group()


#: Dynamo's compile-time metrics (``torch._dynamo.utils.compilation_time_metrics``, seconds per
#: compiled frame) that split a graph's compile into Dynamo's own trace, autotp's backend and guards
DYNAMO_PHASES = {"compile_s": "_compile.compile_inner", "bytecode_tracing_s": "bytecode_tracing",
                 "backend_s": "OutputGraph.call_user_compiler", "build_guards_s": "build_guards"}


def _compile_phases() -> dict[str, Any]:
    """Rank 0's Dynamo metrics per compiled graph, in compile order (:data:`DYNAMO_PHASES`; Dynamo's
    own trace is ``compile_s - backend_s``). The planning phases are read by the parent after the
    launch (:func:`_planning_phases`), so that parsing the plan entries costs the job nothing."""
    out: dict[str, Any] = {}
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # another torch: no Dynamo phases
        compilation_time_metrics = {}
    for name, metric in DYNAMO_PHASES.items():
        out[name] = [round(v, 3) for v in compilation_time_metrics.get(metric, [])]
    return out


def _planning_phases(outcomes: list[dict[str, Any]], cache: Path) -> list[dict[str, Any]]:
    """For each graph rank 0 planned in the launch (a plan cache miss), the planning phases its
    plan-cache entry in ``cache`` stores (``decompose_s``, ``solve_s`` and their CPU seconds,
    ``annotate_s``; the other ranks wait for rank 0's plan meanwhile); an empty dict for any other
    graph. With :func:`_compile_phases`: what a cold launch spends where, without a profiler."""
    planning = []
    for o in outcomes:
        summary = None
        if o.get("status") == "miss" and o.get("entry"):
            try:
                summary = json.loads((cache / "plans" / o["entry"]).read_text())["payload"]["solve"]
            except (OSError, ValueError, KeyError, TypeError):
                summary = None
        planning.append({k: round(v, 3) for k, v in (summary or {}).items()
                         if k in ("decompose_s", "decompose_cpu_s", "solve_s", "solve_cpu_s", "annotate_s")})
    return planning


def _launch(
    engine: str, folder: Path, args: argparse.Namespace, result: Path, cache_dir: Path
) -> dict[str, Any]:
    ranks = 1 if engine == "one_process" else args.tp
    env = dict(os.environ)
    env["AUTOTP_CACHE_DIR"] = os.fspath(cache_dir)
    env.pop("AUTOTP_CACHE", None)
    if engine == "autotp_nocache":
        env["AUTOTP_CACHE"] = "0"
    worker = [
        os.fspath(Path(__file__).resolve()),
        "--worker",
        engine,
        os.fspath(folder),
        os.fspath(result),
        args.dtype,
        "plain" if args.plain_call else "-",
    ]
    wall_s = launch(ranks, worker, env=env, label=engine)
    ended_at = time.time()
    report = json.loads(result.read_text())
    if report.get("phases") is not None:
        report["phases"]["planning"] = _planning_phases(report["plan_cache"], cache_dir)
    # from rank 0's last step (its report written) to the launch's end as the parent saw it: the
    # group's teardown, the interpreters' exits and the launcher's own (autotp/teardown.py)
    exit_s = ended_at - report.pop("done_at") if "done_at" in report else None
    return {**report, "wall_s": wall_s, "exit_s": exit_s}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {
        "wall_s": stats([r["wall_s"] for r in runs]),
        "threads_per_rank": runs[0]["threads"],
        "tokens": runs[0]["tokens"],
    }
    for phase in ("import_s", "load_s", "plain_s", "generate_s", "exit_s", "cpu_s"):
        if all(r.get(phase) is not None for r in runs):
            out[phase] = stats([r[phase] for r in runs])
    memories = [r["memory"] for r in runs if r.get("memory", {}).get("peak_rss")]
    if memories:
        out["peak_rss_bytes"] = max(m["peak_rss"] for m in memories)
        out["rss_anon_bytes"] = max(m["rss_anon"] for m in memories)
    if "plan_cache" in runs[0]:
        out["graphs_compiled"] = [r["graphs_compiled"] for r in runs]
        out["plan_cache_status"] = [[o["status"] for o in r["plan_cache"]] for r in runs]
        out["plan_cache_lookup_s"] = [sum(o.get("lookup_s", 0.0) for o in r["plan_cache"]) for r in runs]
        out["stored_graphs"] = [r.get("stored_graphs") for r in runs]
        out["phases"] = [r.get("phases") for r in runs]
    return out


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    engines = [e for e in ENGINES + OPTIONAL_ENGINES if e in report["engines"]]
    medians = [report["engines"][e]["wall_s"]["median"] for e in engines]
    lows = [m - report["engines"][e]["wall_s"]["min"] for e, m in zip(engines, medians, strict=True)]
    highs = [report["engines"][e]["wall_s"]["max"] - m for e, m in zip(engines, medians, strict=True)]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(
        engines,
        medians,
        yerr=[lows, highs],
        capsize=4,
        color=["#3070c0", "#80a8e0", "#d08030", "#999999"][: len(engines)],
    )
    for i, (v, high) in enumerate(zip(medians, highs, strict=True)):
        ax.text(i + 0.08, v + high, f"{v:.1f}", ha="left", va="bottom")
    ax.set_ylabel("process start to exit (s)")
    provenance = report["provenance"]
    load = provenance["machine"]["load_average"]
    versions = provenance.get("versions", {})
    ax.set_title(
        f"{report['size']} tp={report['tp']} {report['dtype']}: {PROMPT_TOKENS}+{NEW_TOKENS} tokens, "
        f"median, min-max (load {load['start'][0]:.1f}-{load['end'][0]:.1f})\n"
        f"commit {provenance.get('commit', '?')[:7]}, torch {versions.get('torch', '?')}, "
        f"transformers {versions.get('transformers', '?')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--worker", nargs=5, metavar=("ENGINE", "FOLDER", "RESULT", "DTYPE", "PLAIN"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "autotp-bench"),
        help="folder for the benchmark checkpoint (written once)",
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--size",
        default="150m",
        choices=("150m", "300m", "small"),
        help="benchmark checkpoint size (small: a smoke run of the script)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating launches per engine")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--plain-call",
        action="store_true",
        help="call model(input_ids=prompt) once between load and generate (timed as plain_s)",
    )
    parser.add_argument("--out", default="startup.json")
    parser.add_argument("--png", default=None)
    parser.add_argument("--plot", metavar="JSON", default=None,
                        help="only draw --png from a result this script wrote (no launch)")
    args = parser.parse_args(argv)
    if args.plot:
        _plot(json.loads(Path(args.plot).read_text()), Path(args.png or Path(args.plot).with_suffix(".png")))
        return 0
    if args.worker:
        engine, folder, result, dtype_name, plain = args.worker
        profile = os.environ.get("AUTOTP_BENCH_PROFILE")
        if not profile:
            _worker(engine, folder, result, dtype_name, plain_call=plain == "plain")
            return 0
        import cProfile

        with cProfile.Profile() as prof:
            _worker(engine, folder, result, dtype_name, plain_call=plain == "plain")
        Path(profile).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(os.path.join(profile, f"{engine}-rank{os.environ.get('RANK', '0')}.prof"))
        return 0

    import torch
    from _checkpoint import make_checkpoint

    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES) - set(OPTIONAL_ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {list(ENGINES + OPTIONAL_ENGINES)}")
    if "autotp_warm" in engines and "autotp_cold" not in engines:
        parser.error("autotp_warm reads the cache its round's autotp_cold launch leaves: run both")
    provenance = Provenance.start(argv)
    folder = make_checkpoint(args.cache, getattr(torch, args.dtype), size=args.size)
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory(prefix="autotp-startup-") as tmp:
        for round_ in range(args.rounds):
            plans = Path(tmp) / f"plans-{round_}"  # empty for this round's cold launch
            for engine in engines:
                t = time.perf_counter()
                runs[engine].append(
                    _launch(engine, folder, args, Path(tmp) / f"{engine}-{round_}.json", plans)
                )
                print(f"round {round_} {engine}: {time.perf_counter() - t:.1f} s", flush=True)
    summary = {e: _summary(r) for e, r in runs.items()}
    report: dict[str, Any] = {
        "what": f"process start to exit: import, load, greedy generate {NEW_TOKENS} tokens from {PROMPT_TOKENS}",
        "checkpoint": checkpoint_name(folder),
        "size": args.size,
        "tp": args.tp,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "plain_call": args.plain_call,
        "engines": summary,
        "ratios": {},
    }
    for engine in ("autotp_cold", "autotp_warm", "autotp_nocache"):
        for base in ("transformers_tp", "one_process", "autotp_nocache"):
            if engine != base and engine in summary and base in summary:
                report["ratios"][f"{engine}/{base}"] = (
                    summary[engine]["wall_s"]["median"] / summary[base]["wall_s"]["median"]
                )
    report["same_greedy_tokens"] = len({tuple(s["tokens"]) for s in summary.values()}) == 1
    report = write_result(args.out, report, provenance)
    for e, s in summary.items():
        w = s["wall_s"]
        print(
            f"{e:>16}: {w['median']:.1f} s median ({w['min']:.1f}-{w['max']:.1f}); import {s['import_s']['median']:.1f}"
            f" load {s['load_s']['median']:.1f}"
            + (f" plain call {s['plain_s']['median']:.2f}" if "plain_s" in s else "")
            + f" generate {s['generate_s']['median']:.1f}"
            + (f" exit {s['exit_s']['median']:.1f}" if "exit_s" in s else "")
        )
    print(
        json.dumps(
            {
                "ratios": report["ratios"],
                "same_greedy_tokens": report["same_greedy_tokens"],
                "load_average": report["provenance"]["machine"]["load_average"],
            },
            indent=1,
        )
    )
    if args.png:
        _plot(report, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
