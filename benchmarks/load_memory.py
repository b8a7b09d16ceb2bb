"""Peak memory per rank while loading a checkpoint tensor-parallel and running one short forward.

Question: how much of the checkpoint does each rank hold at its peak? Ideal at tp=N is 1/N (the
issue's bar: <= 0.55 x checkpoint bytes at tp=2). Measured side by side for autotp's
``parallelize_model`` and transformers' ``from_pretrained(..., tp_plan="auto")`` on the same
checkpoint (``benchmarks/_checkpoint.py``: ~154M-parameter Llama, fp32, seeded), same launcher
(torch's elastic launcher, ``python -m torch.distributed.run --standalone``), CPU + gloo, one
thread per rank.

Each rank reads its memory (``benchmarks/_record.py``: ``memory``; ``peak_rss`` = ``VmHWM``, the
peak resident set, which counts every touched page of a file mapping as well as anonymous memory;
``ru_maxrss`` is recorded as a cross check) at three points: after importing torch + transformers
(the *baseline*, the same imports in both modes), after loading, and after one forward of 8
tokens. Nothing else runs in a rank: the transformers ranks never import autotp or warm
torch.compile, and autotp's import and its torch.compile stack count as autotp's cost. Reported
per rank:

* ``peak_bytes``: raw peak RSS of the process;
* ``peak_minus_baseline``: peak RSS minus the RSS right after the imports, i.e. what loading and
  the forward added;
* ``ratio_raw`` / ``ratio_above_baseline``: those divided by the checkpoint's tensor bytes;
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
the figures are in ``docs/benchmarks.md``.

    python benchmarks/load_memory.py [--cache DIR] [--tp 2] [--out FILE.jsonl] [--which autotp,transformers]
                                     [--sizes 150m[,300m,600m,2b]]

Output: one JSON line per (library, rank) and one summary line per library, to stdout and
``--out`` (appended; an ``--out`` ending in ``.json`` gets one JSON document with all the lines
and the run's provenance instead, as in ``benchmarks/results/load_memory_tp2_fp32.json``). Each
rank's line carries ``phases``: how much the peak RSS grew in each phase (imports; for autotp its
own import, tracing and solving, the reads, the rest of the warm-up; for transformers the load;
the forward). With more than one size, every line also
carries ``size``, each summary the launch's ``wall_s``, the fit lines come last, and the JSON
document names ``checkpoints`` (size -> folder) instead of ``checkpoint``; one size (the default,
150m) gives the output as before.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(HERE))

from _record import Provenance, checkpoint_name, launch, memory, write_result  # noqa: E402

DEFAULT_CACHE = Path(os.environ.get("AUTOTP_BENCH_CACHE", Path.home() / ".cache" / "autotp-bench"))


def _rank(library: str, folder: str, result_dir: str) -> None:
    """One rank (run under the elastic launcher): import, load, forward, record memory."""
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    baseline = memory()  # torch + transformers imported, the same in both modes
    if library == "autotp":
        import autotp  # noqa: F401 - autotp's import is autotp's cost
    imported = memory()
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
            reads.setdefault("before_first_read", memory())
            out = real_read(self, *args, **kwargs)
            reads["after_last_read"] = memory()
            return out

        autotp.weights.Checkpoint.read_slice = observed_read
        model = parallelize_model(folder, tp_size=world)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
        model.eval()
    loaded_at = time.perf_counter()
    after_load = memory()
    ids = torch.arange(1, 9).unsqueeze(0)  # (1, 8)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    after_forward = memory()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    record = {
        "library": library,
        "rank": rank,
        "world_size": world,
        "baseline": baseline,
        "imported": imported,
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
    worker = [
        os.fspath(Path(__file__).resolve()),
        "--rank",
        library,
        os.fspath(folder),
        os.fspath(result_dir),
    ]
    launch(tp, worker, env=env, label=library)
    return [json.loads((result_dir / f"{library}-rank{r}.json").read_text()) for r in range(tp)]


def _phases(rec: dict[str, Any], ckpt_bytes: int) -> dict[str, dict[str, float]]:
    """Per phase, how much the peak RSS (``VmHWM``) grew during it, in MB and as a fraction of the
    checkpoint: ``imports`` (python + torch + transformers), then for autotp ``autotp_import``,
    ``trace_solve`` (process group, meta model, torch.compile's stack, Dynamo tracing,
    decomposition and solving of the warm-up graph: everything before the first checkpoint read), ``reads`` (first to last slice read), ``warmup_rest`` (the rest of
    ``parallelize_model``: rewriting, the warm-up's run); for transformers ``load``; then
    ``forward`` (the 8-token forward; for autotp a plain call compiles its own graph, since a
    generating model's warm-up is ``generate``'s prefill: ``api._warm_up``)."""
    marks = [("imports", rec["baseline"]["peak_rss"])]
    if rec.get("reads"):
        marks += [
            ("autotp_import", rec["imported"]["peak_rss"]),
            ("trace_solve", rec["reads"]["before_first_read"]["peak_rss"]),
            ("reads", rec["reads"]["after_last_read"]["peak_rss"]),
            ("warmup_rest", rec["after_load"]["peak_rss"]),
        ]
    else:
        marks.append(("load", rec["after_load"]["peak_rss"]))
    marks.append(("forward", rec["after_forward"]["peak_rss"]))
    out, last = {}, 0
    for name, hwm in marks:
        grew = hwm - last
        out[name] = {"peak_grew_mb": round(grew / 1e6, 1), "ratio": round(grew / ckpt_bytes, 3)}
        last = hwm
    return out


def _summarize(records: list[dict[str, Any]], ckpt_bytes: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = []
    for rec in records:
        peak = rec["after_forward"]["peak_rss"]
        base = rec["baseline"]["rss"]
        lines.append(
            {
                "library": rec["library"],
                "rank": rec["rank"],
                "tp": rec["world_size"],
                "checkpoint_bytes": ckpt_bytes,
                "baseline_rss_bytes": base,
                "peak_after_load_bytes": rec["after_load"]["peak_rss"],
                "peak_bytes": peak,
                "peak_minus_baseline": peak - base,
                "ratio_raw": round(peak / ckpt_bytes, 3),
                "ratio_above_baseline": round((peak - base) / ckpt_bytes, 3),
                **(
                    {
                        "rss_before_first_read": rec["reads"]["before_first_read"]["rss"],
                        "rss_after_last_read": rec["reads"]["after_last_read"]["rss"],
                        "reads_ratio": round(
                            (
                                rec["reads"]["after_last_read"]["rss"]
                                - rec["reads"]["before_first_read"]["rss"]
                            )
                            / ckpt_bytes,
                            3,
                        ),
                    }
                    if rec.get("reads")
                    else {}
                ),
                "rss_file_after_forward": rec["after_forward"]["rss_file"],
                "rss_anon_after_forward": rec["after_forward"]["rss_anon"],
                "anonymous_after_forward": rec["after_forward"]["anonymous"],
                "ru_maxrss_bytes": rec["ru_maxrss_bytes"],
                "phases": _phases(rec, ckpt_bytes),
                "param_bytes": rec["param_bytes"],
                "load_s": round(rec["load_s"], 2),
                "forward_s": round(rec["forward_s"], 2),
                "logits_checksum": rec["logits_checksum"],
            }
        )
    worst = max(lines, key=lambda x: x["peak_minus_baseline"])
    summary = {
        "library": worst["library"],
        "tp": worst["tp"],
        "summary": True,
        "checkpoint_bytes": ckpt_bytes,
        "max_ratio_raw": max(x["ratio_raw"] for x in lines),
        "max_ratio_above_baseline": worst["ratio_above_baseline"],
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
    from which the ratio stays <= 0.55 (``fixed / (0.55 - slope)``; None when the slope is >= 0.55)."""
    xs = [float(summaries[s]["checkpoint_bytes"]) for s in summaries]
    fixed, slope, residual = _line_fit(
        xs, [float(summaries[s]["max_peak_minus_baseline"]) for s in summaries]
    )
    return {
        "library": library,
        "tp": tp,
        "fit": True,
        "model": "max over ranks of peak_minus_baseline = fixed_bytes + slope x checkpoint_bytes",
        "fixed_bytes": round(fixed),
        "slope": round(slope, 4),
        "ideal_slope": round(1 / tp, 4),
        "sizes": list(summaries),
        "checkpoint_bytes": {s: summaries[s]["checkpoint_bytes"] for s in summaries},
        "peak_minus_baseline": {s: summaries[s]["max_peak_minus_baseline"] for s in summaries},
        "ratios_above_baseline": {s: summaries[s]["max_ratio_above_baseline"] for s in summaries},
        "max_abs_residual_bytes": round(residual),
        "checkpoint_bytes_to_meet_0.55": _meet(fixed, slope),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cache", type=Path, default=DEFAULT_CACHE, help="where the checkpoint is written once"
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    parser.add_argument("--which", default="autotp,transformers")
    parser.add_argument(
        "--sizes",
        default="150m",
        help="comma-separated checkpoint sizes (keys of _checkpoint.SIZES, e.g. 150m,300m,600m); "
        "with more than one, a fixed + slope x bytes fit per library is appended",
    )
    parser.add_argument(
        "--rank", nargs=3, metavar=("LIBRARY", "FOLDER", "RESULT_DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.rank:
        _rank(*args.rank)
        return 0

    provenance = Provenance.start(argv)
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
                    **summary,
                    "max_peak_minus_baseline": max(x["peak_minus_baseline"] for x in lines),
                }
                for line in [*lines, summary]:
                    print(json.dumps(line), flush=True)
                    out_lines.append(line)
    if several:
        for library in libraries:
            line = _fit(library, args.tp, summaries[library])
            print(json.dumps(line), flush=True)
            out_lines.append(line)
    if args.out and args.out.suffix == ".json":  # one document (benchmarks/results/)
        where = (
            {"checkpoints": {size: checkpoint_name(folder) for size, folder in folders.items()}}
            if several
            else {"checkpoint": checkpoint_name(folders[sizes[0]])}
        )
        write_result(args.out, {**where, "tp": args.tp, "dtype": "float32", "lines": out_lines}, provenance)
    elif args.out:
        with open(args.out, "a") as f:
            for line in out_lines:
                f.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
