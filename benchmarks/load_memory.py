"""Peak memory per rank while loading a checkpoint tensor-parallel and running one short forward.

Question: how much of the checkpoint does each rank hold at its peak? Ideal at tp=N is 1/N (the
issue's bar: <= 0.55 x checkpoint bytes at tp=2). Measured side by side for autotp's
``parallelize_model`` and transformers' ``from_pretrained(..., tp_plan="auto")`` on the same
checkpoint (``benchmarks/_checkpoint.py``: ~154M-parameter Llama, fp32, seeded), same launcher
(torch's elastic launcher, ``python -m torch.distributed.run --standalone``), CPU + gloo, one
thread per rank.

Each rank reads ``/proc/self/status`` (``VmHWM`` = peak resident set, which counts every
touched page of a file mapping as well as anonymous memory; ``ru_maxrss`` is recorded as a cross
check) at three points: after importing torch + transformers + autotp (the *baseline*, the same
imports in both modes), after loading, and after one forward of 8 tokens. Reported per rank:

* ``peak_bytes``: raw peak RSS of the process;
* ``peak_minus_baseline``: peak RSS minus the RSS right after the imports, i.e. what loading and
  the forward added;
* ``ratio_raw`` / ``ratio_above_baseline``: those divided by the checkpoint's tensor bytes;
* ``ratio_above_compile_baseline``: the same above a second baseline taken after warming
  ``torch.compile``'s stack on a trivial function (in both modes), a fixed cost of compiling;
* autotp only, ``reads_ratio``: RSS after its last checkpoint read minus RSS before its first one
  (the reads happen inside the warm-up's compilation, after tracing and solving), divided by the
  checkpoint bytes: what loading the shards itself costs.

The 0.55 criterion is read against ``ratio_above_baseline`` (a python + torch + transformers
process is ~0.3-0.4 GB before it loads anything, the same for both libraries); both are printed.

Several checkpoint sizes (``--sizes 150m,300m,600m,2b``: the same Llama family at 615 MB, 1.23 GB,
2.46 GB and 7.83 GB in fp32, 1x / 2x / 4x / 12.7x the bytes, all with 14 layers so the traced graph
has the same nodes;
``_checkpoint.SIZES``). What a rank adds above the import baseline has two parts: a fixed cost that
does not grow with the checkpoint (torch.compile's stack, transformers' modeling imports, Dynamo's
trace of the model and the compile state built while tracing) and a part proportional to the
checkpoint's bytes, the one tensor parallelism controls (ideal: 1/tp). One size cannot tell them
apart: at 615 MB autotp's fixed cost alone is ~0.42 of the checkpoint, so 0.55 is out of reach at
that size whatever the sharding does. With more than one size, one ``fit`` line per library is
appended: a least-squares line through (checkpoint bytes, the worst rank's ``peak_minus_baseline``):
``fixed_bytes`` + ``slope`` x checkpoint bytes, with ``max_abs_residual_bytes``, the per-size
``ratios_above_baseline``, and ``checkpoint_bytes_to_meet_0.55`` = fixed / (0.55 - slope), the size
from which the ratio stays <= 0.55 (null when the slope is >= 0.55: no size does);
``above_compile_baseline`` repeats the fit above the RSS after the compile warm-up. Measured at tp=2
(``benchmarks/results/load_memory_tp2_fp32_sizes.json``): autotp fixed 263 MB, slope 0.500
(ratios 0.93 / 0.72 / 0.61 / 0.53), meets 0.55 from a ~5.3 GB checkpoint; transformers fixed 91 MB,
slope 0.81 (ratios 1.00 / 0.88 / 0.83 / 0.82), never. (Its fixed part varies by ~50 MB between
runs; ~102 MB of each library's is the compile warm-up this script runs in both modes.)

    python benchmarks/load_memory.py [--cache DIR] [--tp 2] [--out FILE.jsonl] [--which autotp,transformers]
                                     [--sizes 150m[,300m,600m,2b]]

Output: one JSON line per (library, rank) and one summary line per library, to stdout and
``--out`` (appended; an ``--out`` ending in ``.json`` gets one JSON document with all the lines
instead, as in ``benchmarks/results/load_memory_tp2_fp32.json``). Each rank's line carries
``phases``: how much the peak RSS grew in each phase (imports, the compile stack, tracing and
solving, the reads, the rest of the warm-up, the forward). With more than one size, every line also
carries ``size``, each summary the launch's ``wall_s``, the fit lines come last, and the JSON
document names ``checkpoints`` (size -> folder) instead of ``checkpoint``; one size (the default,
150m) gives the output as before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = Path(os.environ.get("AUTOTP_BENCH_CACHE", Path.home() / ".cache" / "autotp-bench"))


def _status() -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile of this process, in bytes."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _rank(library: str, folder: str, result_dir: str) -> None:
    """One rank (run under the elastic launcher): import, load, forward, record memory."""
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    import transformers

    import autotp  # noqa: F401 - the same imports in both modes, so the baseline is comparable

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    baseline = _status()
    # torch.compile's own stack (dynamo, sympy, fx; ~0.1 GB) is a fixed cost autotp pays and
    # transformers does not: warm it on a trivial function, in both modes, and record the RSS after
    # it as a second baseline.
    torch.compile(lambda x: torch.relu(x) + 1, backend="eager")(torch.ones(2))
    baseline_compile = _status()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    reads: dict[str, dict[str, int]] = {}
    if library == "autotp":
        import autotp.weights
        from autotp import parallelize_model

        real_read = autotp.weights.Checkpoint.read_slice

        def observed_read(self: Any, *args: Any, **kwargs: Any) -> Any:
            # RSS before the first slice read and after the latest one: what the reads themselves add
            reads.setdefault("before_first_read", _status())
            out = real_read(self, *args, **kwargs)
            reads["after_last_read"] = _status()
            return out

        autotp.weights.Checkpoint.read_slice = observed_read
        model = parallelize_model(folder, tp_size=world)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
        model.eval()
    loaded_at = time.perf_counter()
    after_load = _status()
    ids = torch.arange(1, 9).unsqueeze(0)  # (1, 8)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    after_forward = _status()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record = {
        "library": library,
        "rank": rank,
        "world_size": world,
        "baseline": baseline,
        "baseline_compile": baseline_compile,
        "reads": reads,
        "after_load": after_load,
        "after_forward": after_forward,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "param_bytes": param_bytes,
        "logits_checksum": float(logits.double().sum()),
        "import_s": start - t0,
        "load_s": loaded_at - start,
        "forward_s": time.perf_counter() - loaded_at,
    }
    Path(result_dir, f"{library}-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _launch(library: str, folder: Path, tp: int, result_dir: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CI": os.environ.get("CI", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           os.fspath(Path(__file__).resolve()), "--rank", library, os.fspath(folder), os.fspath(result_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{library}: ranks failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-8000:]}")
    return [json.loads((result_dir / f"{library}-rank{r}.json").read_text()) for r in range(tp)]


def _phases(rec: dict[str, Any], ckpt_bytes: int) -> dict[str, dict[str, float]]:
    """Per phase, how much the peak RSS (``VmHWM``) grew during it, in MB and as a fraction of the
    checkpoint: ``imports`` (python + torch + transformers + autotp), ``compile_stack`` (warming
    torch.compile on a trivial function), then for autotp ``trace_solve`` (process group, meta
    model, Dynamo tracing, decomposition and solving of the warm-up graph: everything before the
    first checkpoint read), ``reads`` (first to last slice read), ``warmup_rest`` (the rest of
    ``parallelize_model``: rewriting, the warm-up's run); for transformers ``load``; then
    ``forward`` (the 8-token forward; for autotp it reuses the warm-up's dynamic-length graph)."""
    marks = [("imports", rec["baseline"]["VmHWM"]), ("compile_stack", rec["baseline_compile"]["VmHWM"])]
    if rec.get("reads"):
        marks += [("trace_solve", rec["reads"]["before_first_read"]["VmHWM"]),
                  ("reads", rec["reads"]["after_last_read"]["VmHWM"]),
                  ("warmup_rest", rec["after_load"]["VmHWM"])]
    else:
        marks.append(("load", rec["after_load"]["VmHWM"]))
    marks.append(("forward", rec["after_forward"]["VmHWM"]))
    out, last = {}, 0
    for name, hwm in marks:
        grew = hwm - last
        out[name] = {"peak_grew_mb": round(grew / 1e6, 1), "ratio": round(grew / ckpt_bytes, 3)}
        last = hwm
    return out


def _summarize(records: list[dict[str, Any]], ckpt_bytes: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = []
    for rec in records:
        peak = rec["after_forward"]["VmHWM"]
        base = rec["baseline"]["VmRSS"]
        lines.append({
            "library": rec["library"], "rank": rec["rank"], "tp": rec["world_size"],
            "checkpoint_bytes": ckpt_bytes,
            "baseline_rss_bytes": base,
            "peak_after_load_bytes": rec["after_load"]["VmHWM"],
            "peak_bytes": peak,
            "peak_minus_baseline": peak - base,
            "ratio_raw": round(peak / ckpt_bytes, 3),
            "ratio_above_baseline": round((peak - base) / ckpt_bytes, 3),
            "baseline_with_compile_stack_bytes": rec["baseline_compile"]["VmRSS"],
            "ratio_above_compile_baseline": round((peak - rec["baseline_compile"]["VmRSS"]) / ckpt_bytes, 3),
            **({"rss_before_first_read": rec["reads"]["before_first_read"]["VmRSS"],
                "rss_after_last_read": rec["reads"]["after_last_read"]["VmRSS"],
                "reads_ratio": round((rec["reads"]["after_last_read"]["VmRSS"]
                                      - rec["reads"]["before_first_read"]["VmRSS"]) / ckpt_bytes, 3)}
               if rec.get("reads") else {}),
            "rss_file_after_forward": rec["after_forward"]["RssFile"],
            "rss_anon_after_forward": rec["after_forward"]["RssAnon"],
            "ru_maxrss_bytes": rec["ru_maxrss_bytes"],
            "phases": _phases(rec, ckpt_bytes),
            "param_bytes": rec["param_bytes"],
            "load_s": round(rec["load_s"], 2), "forward_s": round(rec["forward_s"], 2),
            "logits_checksum": rec["logits_checksum"],
        })
    worst = max(lines, key=lambda x: x["peak_minus_baseline"])
    summary = {
        "library": worst["library"], "tp": worst["tp"], "summary": True, "checkpoint_bytes": ckpt_bytes,
        "max_ratio_raw": max(x["ratio_raw"] for x in lines),
        "max_ratio_above_baseline": worst["ratio_above_baseline"],
        "max_ratio_above_compile_baseline": max(x["ratio_above_compile_baseline"] for x in lines),
        "criterion": "ratio_above_baseline <= 0.55",
        "meets_criterion": worst["ratio_above_baseline"] <= 0.55,
    }
    return lines, summary


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = fixed + slope * x``: (fixed, slope, largest absolute residual)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    return fixed, slope, max(abs(y - fixed - slope * x) for x, y in zip(xs, ys, strict=True))


def _meet(fixed: float, slope: float, bar: float = 0.55) -> int | None:
    """Checkpoint bytes from which ``(fixed + slope x bytes) / bytes <= bar``; None if never."""
    return None if slope >= bar else max(0, round(fixed / (bar - slope)))


def _fit(library: str, tp: int, summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Least-squares line through (checkpoint bytes, worst rank's peak RSS above the import baseline)
    over the sizes that ran: ``fixed_bytes`` + ``slope`` x checkpoint bytes, and the checkpoint size
    from which the ratio stays <= 0.55 (``fixed / (0.55 - slope)``; None when the slope is >= 0.55).
    ``above_compile_baseline``: the same fit above the RSS after warming torch.compile's stack."""
    xs = [float(summaries[s]["checkpoint_bytes"]) for s in summaries]
    fixed, slope, residual = _line_fit(xs, [float(summaries[s]["max_peak_minus_baseline"]) for s in summaries])
    cfixed, cslope, cresidual = _line_fit(
        xs, [float(summaries[s]["max_peak_minus_compile_baseline"]) for s in summaries])
    return {
        "library": library, "tp": tp, "fit": True,
        "model": "max over ranks of peak_minus_baseline = fixed_bytes + slope x checkpoint_bytes",
        "fixed_bytes": round(fixed), "slope": round(slope, 4), "ideal_slope": round(1 / tp, 4),
        "sizes": list(summaries),
        "checkpoint_bytes": {s: summaries[s]["checkpoint_bytes"] for s in summaries},
        "peak_minus_baseline": {s: summaries[s]["max_peak_minus_baseline"] for s in summaries},
        "ratios_above_baseline": {s: summaries[s]["max_ratio_above_baseline"] for s in summaries},
        "max_abs_residual_bytes": round(residual),
        "checkpoint_bytes_to_meet_0.55": _meet(fixed, slope),
        "above_compile_baseline": {
            "fixed_bytes": round(cfixed), "slope": round(cslope, 4), "max_abs_residual_bytes": round(cresidual),
            "checkpoint_bytes_to_meet_0.55": _meet(cfixed, cslope)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the checkpoint is written once")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    parser.add_argument("--which", default="autotp,transformers")
    parser.add_argument("--sizes", default="150m",
                        help="comma-separated checkpoint sizes (keys of _checkpoint.SIZES, e.g. 150m,300m,600m); "
                             "with more than one, a fixed + slope x bytes fit per library is appended")
    parser.add_argument("--rank", nargs=3, metavar=("LIBRARY", "FOLDER", "RESULT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        _rank(*args.rank)
        return 0

    sys.path.insert(0, os.fspath(HERE))
    import torch
    from _checkpoint import SIZES, checkpoint_bytes, make_checkpoint

    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown --sizes {unknown}; known: {sorted(SIZES)}")
    libraries = args.which.split(",")
    several = len(sizes) > 1
    folders = {size: make_checkpoint(args.cache, torch.float32, size=size) for size in sizes}
    out_lines: list[dict[str, Any]] = []
    summaries: dict[str, dict[str, dict[str, Any]]] = {library: {} for library in libraries}
    with tempfile.TemporaryDirectory(prefix="autotp-loadmem-") as tmp:
        for size in sizes:
            folder = folders[size]
            ckpt_bytes = checkpoint_bytes(folder)
            result_dir = Path(tmp, size)
            result_dir.mkdir()
            for library in libraries:
                started = time.perf_counter()
                lines, summary = _summarize(_launch(library, folder, args.tp, result_dir), ckpt_bytes)
                if several:  # which size each line is about (a single size keeps the original format)
                    for line in [*lines, summary]:
                        line["size"] = size
                    summary["wall_s"] = round(time.perf_counter() - started, 1)
                summaries[library][size] = {
                    **summary, "max_peak_minus_baseline": max(x["peak_minus_baseline"] for x in lines),
                    "max_peak_minus_compile_baseline": max(x["peak_bytes"] - x["baseline_with_compile_stack_bytes"]
                                                           for x in lines)}
                for line in [*lines, summary]:
                    print(json.dumps(line), flush=True)
                    out_lines.append(line)
    if several:
        for library in libraries:
            line = _fit(library, args.tp, summaries[library])
            print(json.dumps(line), flush=True)
            out_lines.append(line)
    if args.out and args.out.suffix == ".json":  # one document (benchmarks/results/)
        where = ({"checkpoints": {size: os.fspath(folder) for size, folder in folders.items()}} if several
                 else {"checkpoint": os.fspath(folders[sizes[0]])})
        args.out.write_text(json.dumps({**where, "tp": args.tp, "dtype": "float32",
                                        "cores": os.cpu_count(), "lines": out_lines}, indent=1) + "\n")
    elif args.out:
        with open(args.out, "a") as f:
            for line in out_lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
