"""Prefill and decode speed, side by side: autotp vs transformers' ``tp_plan="auto"`` vs one process.

    python benchmarks/generation.py --tp 2 --dtype float32 \\
        --prefill 256 --decode 32 --rounds 2 --out generation.json [--png generation.png]
    python benchmarks/generation.py --size small --prefill 32 --decode 4 --reps 1 --rounds 1  # smoke run

Same checkpoint for every engine (``benchmarks/_checkpoint.py``: 154M-parameter Llama family,
615 MB in fp32; ``--size small`` is a 6M-parameter one for checking the script). Engines:

* ``one_process``: plain transformers, one process, all the threads the ranks share;
* ``one_process_compiled``: the same under ``torch.compile`` (inductor), the compiled baseline;
* ``transformers_tp``: ``from_pretrained(..., tp_plan="auto")`` on ``--tp`` ranks (gloo, CPU);
* ``autotp``: ``parallelize_model`` on ``--tp`` ranks, fused sibling matmuls, eager inner graphs,
  all-reduces and small all-gathers through shared memory (the CPU default);
* ``autotp_gloo``: the same with ``shared_memory=False`` (every collective through gloo);
* ``autotp_unfused``: the same with ``fuse=False``;
* ``autotp_inductor``: the same as ``autotp`` with ``compile_inner="inductor"`` (its graphs use
  torch's functional collectives, i.e. gloo).

Every engine runs in its own launch (torch's elastic launcher, ``--standalone``); launches
alternate A B C A B C for ``--rounds`` rounds, so drift on a shared machine hits all engines alike.
Each launch loads once and times its *first token*: the first prefill after load
(``first_token_s``, compilation included) and the first decode step after it
(``first_decode_s``); then it warms up (a few decode steps: autotp and ``torch.compile`` compile their
decode graphs there) and measures ``--reps`` times: *prefill* = one forward of 1 x P tokens
into an empty ``DynamicCache``; *decode* = P-token prefill, then ``--decode`` greedy steps of one
token each through the cache, timed per step (ms/token is the median step). Medians are over all
rounds and reps, with min, max and spread (``benchmarks/_record.py``: ``stats``); ratios are
autotp / transformers_tp and autotp / one_process. Rank 0 of each launch reports its own memory at
the end (peak RSS and anonymous resident memory, ``_record.memory``). The result records its
provenance (commit, date, command, versions, machine and load averages; ``_record.Provenance``).

Each rank uses ``cores // ranks`` threads unless ``OMP_NUM_THREADS`` is set. For autotp the
output also has the collectives one decode step issued (from ``Comm.counts``) next to what the
decode graph's plan says (its in-graph collectives plus one all-gather per sharded output the
user reads: the logits), and the main process plans the checkpoint for a P-token prompt with
``autotp.planner.plan_model`` (meta device, simulated group) to compare one prefill's and one decode
step's collectives and bytes per rank (a decode step's = per token at batch 1) with what each
autotp engine issued (``collectives_vs_plan``; inductor graphs count collectives per call but not
their bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, checkpoint_name, launch, memory, pyplot, stats, write_result  # noqa: E402

ENGINES = (
    "one_process",
    "one_process_compiled",
    "transformers_tp",
    "autotp",
    "autotp_gloo",
    "autotp_unfused",
    "autotp_inductor",
)
#: autotp engines -> parallelize_model options
AUTOTP_VARIANTS: dict[str, dict[str, Any]] = {
    "autotp": {"fuse": True, "compile_inner": "eager"},
    "autotp_gloo": {"fuse": True, "compile_inner": "eager", "shared_memory": False},
    "autotp_unfused": {"fuse": False, "compile_inner": "eager"},
    "autotp_inductor": {"fuse": True, "compile_inner": "inductor"},
}


def _worker(
    engine: str, folder: str, prefill: int, decode: int, reps: int, result: str, dtype_name: str, device_name: str
) -> None:
    """One launch: load with ``engine``, warm up, time prefill and decode; rank 0 writes JSON.
    On ``cuda`` every rank uses GPU 0 (the tp=1 check on a one-GPU machine) and each timed call
    ends with ``torch.cuda.synchronize``."""
    import torch
    import torch.distributed as dist
    import transformers
    from transformers import DynamicCache

    transformers.logging.set_verbosity_error()
    distributed = "WORLD_SIZE" in os.environ  # under the elastic launcher (``_launch``: more than one rank)
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    from autotp.kv_cache import cache_keyword, returned_cache

    dtype = getattr(torch, dtype_name)
    device = torch.device(device_name)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    t0 = time.perf_counter()
    if engine in AUTOTP_VARIANTS:
        from autotp import parallelize_model

        model = parallelize_model(folder, tp_size=world, dtype=dtype, device=device, **AUTOTP_VARIANTS[engine])
    elif engine == "transformers_tp":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        if engine == "one_process_compiled":
            model.forward = torch.compile(model.forward)  # inductor, as a user compiles it
    sync()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    ids = (torch.arange(prefill) * 7919 % (vocab - 1) + 1).unsqueeze(0).to(device)  # (1, P), deterministic

    def barrier() -> None:
        if distributed:
            dist.barrier()

    keyword = cache_keyword(type(model).forward)  # "cache" from transformers 5.24, "past_key_values" before

    def run_prefill() -> tuple[float, Any, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        barrier()
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **{keyword: cache})
        sync()
        return time.perf_counter() - start, returned_cache(out), out.logits[:, -1:].argmax(-1)

    def run_decode(steps: int) -> tuple[list[float], list[int]]:
        _, cache, token = run_prefill()
        times, tokens = [], []
        for i in range(steps):
            position = torch.tensor([[prefill + i]], device=device)
            barrier()
            start = time.perf_counter()
            out = model(input_ids=token, use_cache=True, position_ids=position, **{keyword: cache})
            sync()
            times.append(time.perf_counter() - start)
            cache, token = returned_cache(out), out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        return times, tokens

    with torch.no_grad():
        t = time.perf_counter()
        first_token_s, cache, token = run_prefill()  # the first call after load: compiles the prefill
        barrier()
        start = time.perf_counter()
        model(input_ids=token, use_cache=True, position_ids=torch.tensor([[prefill]], device=device),
              **{keyword: cache})
        sync()
        first_decode_s = time.perf_counter() - start
        run_decode(4)  # warm-up: the dynamic-length decode graph
        warmup_s = time.perf_counter() - t
        comm = model.autotp.context.comm if engine in AUTOTP_VARIANTS else None
        step_collectives: dict[str, Any] = {}
        prefill_collectives: dict[str, Any] = {}
        if comm is not None:  # one prefill's and one decode step's collectives, counted as issued
            comm.reset_counts()
            _, cache, token = run_prefill()
            prefill_collectives = {
                "issued": dict(comm.counts),
                "bytes_per_rank": dict(comm.bytes),
                "compile_inner": model.autotp.context.config.compile_inner,
            }
            comm.reset_counts()
            model(input_ids=token, use_cache=True, position_ids=torch.tensor([[prefill]], device=device),
                  **{keyword: cache})
            plan = model.autotp.plans[-1]
            step_collectives = {
                "issued": dict(comm.counts),
                "bytes_per_rank": dict(comm.bytes),
                "plan_in_graph": plan["collectives"],
                "plan_sharded_outputs": plan["sharded_outputs"],
                "graphs_compiled": model.autotp.context.graphs_compiled,
                "compile_inner": model.autotp.context.config.compile_inner,
                "inner_reports": model.autotp.context.inner_reports,
            }
        prefill_s, decode_s, tokens = [], [], []
        for _ in range(reps):
            prefill_s.append(run_prefill()[0])
            times, tokens = run_decode(decode)
            decode_s.extend(times)
    if rank == 0:
        Path(result).write_text(
            json.dumps(
                {
                    "engine": engine,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "world_size": world,
                    "threads": torch.get_num_threads(),
                    "load_s": load_s,
                    "warmup_s": warmup_s,
                    "first_token_s": first_token_s,
                    "first_decode_s": first_decode_s,
                    "memory": memory(),
                    "prefill_s": prefill_s,
                    "decode_step_s": decode_s,
                    "tokens": tokens,
                    "decode_collectives": step_collectives,
                    "prefill_collectives": prefill_collectives,
                }
            )
        )
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _launch(engine: str, folder: Path, args: argparse.Namespace, result: Path) -> dict[str, Any]:
    ranks = 1 if engine.startswith("one_process") else args.tp
    worker = [
        os.fspath(Path(__file__).resolve()),
        "--worker",
        engine,
        os.fspath(folder),
        str(args.prefill),
        str(args.decode),
        str(args.reps),
        os.fspath(result),
        args.dtype,
        args.device,
    ]
    launch(ranks, worker, label=engine)
    return json.loads(result.read_text())


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    prefill = [t for r in runs for t in r["prefill_s"]]
    decode = [t for r in runs for t in r["decode_step_s"]]
    prefill_ms, decode_ms = stats([1000 * t for t in prefill]), stats([1000 * t for t in decode])
    memories = [r["memory"] for r in runs if r.get("memory")]
    return {
        "prefill_ms": prefill_ms["median"],
        "decode_ms_per_token": decode_ms["median"],
        "prefill_ms_stats": {k: v for k, v in prefill_ms.items() if k != "all"},
        "decode_ms_per_token_stats": {k: v for k, v in decode_ms.items() if k != "all"},
        "first_token_s": statistics.median(r["first_token_s"] for r in runs),
        "first_decode_s": statistics.median(r["first_decode_s"] for r in runs),
        "load_s": statistics.median(r["load_s"] for r in runs),
        "warmup_s": statistics.median(r["warmup_s"] for r in runs),
        **(
            {
                "peak_rss_bytes": max(m["peak_rss"] for m in memories),
                "rss_anon_bytes": max(m["rss_anon"] for m in memories),
            }
            if memories and memories[0]["peak_rss"]
            else {}
        ),
        "threads_per_rank": runs[0]["threads"],
        "tokens": runs[0]["tokens"],
        "samples": {"prefill": len(prefill), "decode_steps": len(decode)},
        "device": runs[0].get("device", "cpu"),
        **({key: runs[0][key] for key in ("prefill_collectives", "decode_collectives") if runs[0].get(key)}),
    }


def _compare_with_plan(folder: Path, args: argparse.Namespace, summary: dict[str, Any]) -> dict[str, Any]:
    """One prefill's and one decode step's collectives (count and bytes per rank; a decode step's
    bytes are per token at batch 1) as the planner predicts them for a P-token prompt, next to
    what each autotp engine issued."""
    import torch

    from autotp.planner import plan_model

    report = plan_model(os.fspath(folder), args.tp, dtype=getattr(torch, args.dtype), seq_len=args.prefill)
    out: dict[str, Any] = {}
    for phase, graph in (("prefill", report.forward), ("decode", report.decode)):
        if graph is None:
            out[phase] = {"plan": None, "note": report.decode_note}
            continue
        out[phase] = _issued_vs_plan(
            {"counts": dict(graph.collectives), "bytes_per_rank": dict(graph.collective_bytes)},
            {engine: s.get(f"{phase}_collectives", {}) for engine, s in summary.items()},
        )
    return out


def _issued_vs_plan(plan: dict[str, Any], issued_by_engine: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"plan": plan}
    for engine, issued in issued_by_engine.items():
        if not issued:
            continue
        counted_bytes = issued.get("compile_inner") == "eager"  # compiled graphs do not count bytes
        out[engine] = {
            "counts": issued["issued"],
            "bytes_per_rank": issued.get("bytes_per_rank") if counted_bytes else None,
            "counts_match_plan": issued["issued"] == plan["counts"],
            "bytes_match_plan": issued["bytes_per_rank"] == plan["bytes_per_rank"] if counted_bytes else None,
        }
    return out


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    engines = [e for e in ENGINES if e in report["engines"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric, label in (
        (axes[0], "prefill_ms", f"prefill 1x{report['prefill']} (ms)"),
        (axes[1], "decode_ms_per_token", "decode (ms/token)"),
    ):
        values = [report["engines"][e][metric] for e in engines]
        colors = {
            "one_process": "#999999",
            "one_process_compiled": "#666666",
            "transformers_tp": "#d08030",
            "autotp": "#3070c0",
            "autotp_gloo": "#80a8e0",
            "autotp_unfused": "#80a8e0",
            "autotp_inductor": "#205090",
        }
        ax.bar(engines, values, color=[colors[e] for e in engines])
        ax.tick_params(axis="x", labelrotation=20)
        ax.set_title(label)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    fig.suptitle(f"tp={report['tp']}, {report['dtype']}, medians")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--worker",
        nargs=8,
        metavar=("ENGINE", "FOLDER", "PREFILL", "DECODE", "REPS", "RESULT", "DTYPE", "DEVICE"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "autotp-bench"),
        help="folder for the benchmark checkpoint (written once)",
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: every engine on GPU 0 (tp=1 only: one GPU; transformers_tp needs NCCL)")
    parser.add_argument(
        "--size",
        default="150m",
        choices=("150m", "small"),
        help="benchmark checkpoint size (small: a smoke run of the script)",
    )
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions per launch")
    parser.add_argument("--rounds", type=int, default=2, help="alternating launches per engine")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--out", default="generation.json")
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        engine, folder, prefill, decode, reps, result, dtype_name, device_name = args.worker
        _worker(engine, folder, int(prefill), int(decode), int(reps), result, dtype_name, device_name)
        return 0

    import torch
    from _checkpoint import make_checkpoint

    provenance = Provenance.start(argv)
    folder = make_checkpoint(args.cache, getattr(torch, args.dtype), size=args.size)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    if args.device == "cuda" and (args.tp != 1 or "transformers_tp" in engines):
        parser.error("--device cuda measures tp=1 on GPU 0: use --tp 1 and no transformers_tp engine")
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory(prefix="autotp-gen-") as tmp:
        for round_ in range(args.rounds):
            for engine in engines:  # A B C A B C ...
                t = time.perf_counter()
                runs[engine].append(_launch(engine, folder, args, Path(tmp) / f"{engine}-{round_}.json"))
                print(f"round {round_} {engine}: {time.perf_counter() - t:.0f} s", flush=True)
    summary = {e: _summary(r) for e, r in runs.items()}
    report: dict[str, Any] = {
        "checkpoint": checkpoint_name(folder),
        "size": args.size,
        "tp": args.tp,
        "device": args.device,
        "dtype": args.dtype,
        "prefill": args.prefill,
        "decode": args.decode,
        "rounds": args.rounds,
        "reps": args.reps,
        "engines": summary,
        "ratios": {},
    }
    for metric in ("prefill_ms", "decode_ms_per_token"):
        for variant in AUTOTP_VARIANTS:
            for base in ("transformers_tp", "one_process", "one_process_compiled", "autotp"):
                if variant in summary and base in summary and base != variant:
                    report["ratios"][f"{variant}/{base}:{metric}"] = (
                        summary[variant][metric] / summary[base][metric]
                    )
    if any(e in AUTOTP_VARIANTS for e in engines):
        report["collectives_vs_plan"] = _compare_with_plan(folder, args, summary)
    tokens = {e: s["tokens"] for e, s in summary.items()}
    report["same_greedy_tokens"] = len({tuple(t) for t in tokens.values()}) == 1
    report = write_result(args.out, report, provenance)
    print(json.dumps({k: v for k, v in report.items() if k != "engines"}, indent=1))
    for e, s in summary.items():
        print(
            f"{e:>20}: prefill {s['prefill_ms']:.1f} ms, decode {s['decode_ms_per_token']:.2f} ms/token, "
            f"first token {s['first_token_s']:.2f} s"
        )
    if args.png:
        _plot(report, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
