"""The ``autotp`` command line.

    autotp demo [--tp 2] [--new-tokens 16] [--workdir DIR] [--trace-dir DIR]
    autotp generate MODEL --tp N --prompt-ids "1,2,3" [--max-new-tokens K] [--dtype D] [--trace-dir DIR]

Both launch ``--tp`` ranks on this machine's CPUs (gloo) with torch's elastic launcher, in
process (``torch.distributed.launcher.api.elastic_launch``: the same agent ``torchrun`` uses, with
a c10d rendezvous on a port the OS picks). Every rank calls :func:`autotp.parallelize_model` and
generates greedily; rank 0's results come back to this process, which prints them.

``demo`` builds a small seeded Llama-family checkpoint (:mod:`autotp.demo`), generates with one
plain transformers process first, and exits 0 only if the tensor-parallel tokens are identical.

Bad input (an :class:`~autotp.errors.AutoTPError`) prints its message, without a traceback, and
exits 2. A rank that fails for any other reason (a bug) prints the launcher's report and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from autotp.errors import AutoTPError

__all__ = ["main"]

#: Environment for quiet runs (set only where the user has not set them): no progress bars, no
#: transformers advisory warnings, one OpenMP thread per rank (ranks share the machine's cores).
_QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


@contextlib.contextmanager
def _environ(defaults: dict[str, str]) -> Iterator[None]:
    """Set the variables of ``defaults`` that are unset, for the duration of the block."""
    added = [k for k in defaults if k not in os.environ]
    for k in added:
        os.environ[k] = defaults[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------
# One rank (runs in a process the elastic agent spawned)
# ---------------------------------------------------------------------------------------------


def _rank_generate(folder: str, prompt: list[int], new_tokens: int, tp: int,
                   trace_dir: str | None, dtype: str | None) -> dict[str, Any]:
    """Load ``folder`` tensor-parallel over the launcher's group and generate greedily.

    Returns this rank's tokens, timings, parameter bytes and plan. An :class:`AutoTPError` comes
    back as ``{"error": message}`` so the parent can report it without a traceback.
    """
    import torch
    import torch.distributed as dist

    from autotp import parallelize_model

    _quiet_transformers()
    try:
        if not dist.is_initialized():
            # CPU + gloo on purpose: the demo runs on any machine; parallelize_model joins this group.
            dist.init_process_group("gloo")
        start = time.perf_counter()
        model = parallelize_model(folder, tp_size=tp, dtype=dtype, trace_dir=trace_dir, device="cpu")
        loaded = time.perf_counter()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        done = time.perf_counter()
        return {
            "rank": dist.get_rank(),
            "tokens": out[0, len(prompt):].tolist(),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "plan": model.autotp.plan,
            "load_s": loaded - start,
            "generate_s": done - loaded,
        }
    except AutoTPError as exc:
        return {"error": str(exc)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _launch(tp: int, args: tuple[Any, ...], log_dir: Path) -> dict[int, dict[str, Any]]:
    """Run :func:`_rank_generate` on ``tp`` local ranks; return each rank's result."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=tp,
        run_id=f"autotp-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # the agent hosts the store on a port the OS picks
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.fspath(log_dir)),
    )
    try:
        results = elastic_launch(config, _rank_generate)(*args)
    except ChildFailedError as exc:
        raise _RankFailure(str(exc)) from None
    errors = {r["error"] for r in results.values() if "error" in r}
    if errors:
        raise AutoTPError("; ".join(sorted(errors)))
    return results


class _RankFailure(Exception):
    """A rank died or raised something other than an AutoTPError (the launcher's report)."""


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _safetensors_bytes(folder: Path) -> int:
    """Bytes of all tensors in the folder's safetensors files (from their headers, no data read)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(end - start for k, v in header.items() if k != "__metadata__"
                     for start, end in [v["data_offsets"]])
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _print_plan(plan: dict[str, Any] | None, param_bytes: int, full_bytes: int, tp: int) -> None:
    if not plan:
        print("plan: (none recorded)")
        return
    params = plan["parameters"]
    styles = Counter(e["style"] for e in params.values())
    print(f"plan (rank 0 of {plan.get('world_size', tp)}):")
    print(f"  parameters ({len(params)}): {_counts(styles)}")
    print(f"  collectives per forward: {_counts(plan.get('collectives', {}))}")
    share = 100.0 * param_bytes / full_bytes if full_bytes else float("nan")
    print(f"  parameter bytes per rank: {_mib(param_bytes)} of {_mib(full_bytes)} in the full checkpoint "
          f"({share:.1f}%)")
    # One decoder block stands for all of them; other layers' entries are the same styles.
    shown = [(fqn, e) for fqn, e in params.items() if ".layers." not in fqn or ".layers.0." in fqn]
    width = max((len(fqn) for fqn, _ in shown), default=0)
    for fqn, e in shown:
        shapes = f"{tuple(e['global_shape'])} -> {tuple(e['local_shape'])}"
        print(f"    {fqn:<{width}}  {e['style']:<9} {shapes}")
    if len(shown) < len(params):
        print(f"    ... and {len(params) - len(shown)} more in layers 1+ (same styles as layer 0)")


def _rank_summary(results: dict[int, dict[str, Any]], tp: int) -> dict[str, Any]:
    first = results[min(results)]
    same = all(r["tokens"] == first["tokens"] for r in results.values())
    if not same:
        for rank, r in sorted(results.items()):
            print(f"  rank {rank} tokens: {r['tokens']}")
    print(f"tp={tp}: parallelize_model {first['load_s']:.1f} s, generate {first['generate_s']:.1f} s on rank 0; "
          f"all {len(results)} ranks produced the same tokens: {'yes' if same else 'NO'}")
    return {**first, "ranks_agree": same}


# ---------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise AutoTPError(f"{name} must be a positive integer, got {value}")


def _cmd_demo(args: argparse.Namespace) -> int:
    _positive("--tp", args.tp)
    _positive("--new-tokens", args.new_tokens)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environ({**_QUIET_ENV, "OMP_NUM_THREADS": "1"}))
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="autotp-demo-")))
        else:
            workdir = Path(args.workdir).expanduser().resolve()
            workdir.mkdir(parents=True, exist_ok=True)
        _quiet_transformers()
        import torch
        from transformers import AutoModelForCausalLM

        from autotp.api import check_divisible
        from autotp.demo import DEMO_PROMPT, build_demo_checkpoint, demo_config

        config = demo_config()
        check_divisible(config, args.tp)  # refuse a bad --tp before building or launching anything
        folder = build_demo_checkpoint(workdir / "checkpoint")
        full_bytes = _safetensors_bytes(folder)
        print(f"autotp demo: seeded Llama-family checkpoint ({config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} kv heads, "
              f"vocab {config.vocab_size}, fp32, {_mib(full_bytes)}) in {folder}")

        prompt = list(DEMO_PROMPT)
        t0 = time.perf_counter()
        reference = AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, len(prompt):].tolist()
        del reference
        print(f"one process (plain transformers): greedy generate {args.new_tokens} tokens in "
              f"{time.perf_counter() - t0:.1f} s")

        print(f"launching {args.tp} CPU rank(s) (gloo) with torch's elastic launcher ...", flush=True)
        results = _launch(args.tp, (os.fspath(folder), prompt, args.new_tokens, args.tp, args.trace_dir, None),
                          workdir / "logs")
        summary = _rank_summary(results, args.tp)
        _print_plan(summary["plan"], summary["param_bytes"], full_bytes, args.tp)
        identical = summary["ranks_agree"] and summary["tokens"] == ref
        print(f"prompt ids:            {prompt}")
        print(f"one process:           {ref}")
        print(f"autotp tp={args.tp}, rank 0:  {summary['tokens']}")
        print(f"tokens identical to one process: {'yes' if identical else 'NO'}")
        if args.trace_dir:
            print(f"solver traces: {Path(args.trace_dir).resolve()} (rank*/graph*/, see docs/architecture.md)")
        print(f"demo took {time.perf_counter() - started:.1f} s")
    return 0 if identical else 1


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError:
        raise AutoTPError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise AutoTPError(f"--prompt-ids must be one or more non-negative integers, got {text!r}")
    return ids


def _cmd_generate(args: argparse.Namespace) -> int:
    _positive("--tp", args.tp)
    _positive("--max-new-tokens", args.max_new_tokens)
    prompt = _parse_ids(args.prompt_ids)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environ({**_QUIET_ENV, "OMP_NUM_THREADS": "1"}))
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="autotp-logs-")))
        _quiet_transformers()
        from transformers import AutoConfig

        from autotp.api import check_divisible
        from autotp.config import parse_dtype
        from autotp.weights import resolve_checkpoint

        parse_dtype(args.dtype)
        # Resolve (download) once here, not once per rank; the ranks get the local folder.
        folder = resolve_checkpoint(args.model, revision=args.revision, local_files_only=args.local_files_only)
        check_divisible(AutoConfig.from_pretrained(folder), args.tp)
        results = _launch(args.tp, (os.fspath(folder), prompt, args.max_new_tokens, args.tp, args.trace_dir,
                                    args.dtype), logs)
        summary = _rank_summary(results, args.tp)
        _print_plan(summary["plan"], summary["param_bytes"], _safetensors_bytes(folder), args.tp)
        print(f"prompt ids: {prompt}")
        print(f"generated:  {summary['tokens']}")
    return 0 if summary["ranks_agree"] else 1


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp",
        description="Run Hugging Face models tensor-parallel with autotp (a torch.compile backend).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo", help="build a tiny seeded Llama checkpoint, run it tensor-parallel on CPU, compare tokens",
        description="Build a small seeded Llama-family checkpoint, generate greedily in one process, then "
                    "on --tp CPU ranks with parallelize_model; exit 0 only if the tokens are identical.",
    )
    demo.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of ranks (default 2)")
    demo.add_argument("--new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    demo.add_argument("--workdir", default=None,
                      help="folder for the checkpoint and launcher logs (kept); default: a temporary folder")
    demo.add_argument("--trace-dir", default=None, help="write autotp's solver traces here (rank*/graph*/)")
    demo.set_defaults(func=_cmd_demo)

    gen = sub.add_parser(
        "generate", help="greedy generation from token ids with a checkpoint loaded tensor-parallel",
        description="Load MODEL (Hub id or local folder) with parallelize_model on --tp CPU ranks and "
                    "generate greedily from the given token ids.",
    )
    gen.add_argument("model", metavar="MODEL", help="Hub id ('org/name') or a folder written by save_pretrained")
    gen.add_argument("--tp", type=int, required=True, help="tensor-parallel size = number of ranks")
    gen.add_argument("--prompt-ids", required=True, help='comma-separated token ids, e.g. "1,2,3"')
    gen.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    gen.add_argument("--dtype", default=None, help="load the weights in this dtype (default: the checkpoint's)")
    gen.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    gen.add_argument("--local-files-only", action="store_true", help="do not download; use the Hub cache only")
    gen.add_argument("--trace-dir", default=None, help="write autotp's solver traces here (rank*/graph*/)")
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autotp`` command line; returns the exit code (0 ok, 1 failure, 2 bad input)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args)
    except AutoTPError as exc:
        print(f"autotp: error: {exc}", file=sys.stderr)
        return 2
    except _RankFailure as exc:
        print(f"autotp: a rank failed (a bug in autotp or its environment):\n{exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
