"""The ``autotp`` command line.

    autotp demo [--tp 2] [--new-tokens 16] [--workdir DIR] [--trace-dir DIR]
    autotp generate MODEL --tp N (--prompt TEXT | --prompt-ids "1,2,3") [--max-new-tokens K] [--dtype D]
                [--device cpu|cuda] [--do-sample --temperature T --top-k K --top-p P --seed S]
                [--nnodes M --rdzv-backend B --rdzv-endpoint HOST:PORT --rdzv-id ID] [--trace-dir DIR]
    autotp plan MODEL --tp N [--json | --tp-plan] [--dtype D] [--batch B] [--seq-len S]
                [--override PATTERN=STYLE] [--explain FQN] [--html FILE] [--png FILE] [--no-decode]

``plan`` runs in this process on the meta device (:mod:`autotp.planner`); it reads no weights.

Both launch ``--tp`` ranks on this machine's CPUs (gloo) with torch's elastic launcher, in
process (``torch.distributed.launcher.api.elastic_launch``: the same agent ``torchrun`` uses, with
a c10d rendezvous on a port the OS picks), each forked from a server that imported torch, Dynamo,
transformers and autotp once (:func:`_start_rank_server`). Every rank calls
:func:`autotp.parallelize_model` and generates greedily; rank 0's results come back to this
process, which prints them.

``demo`` builds a small seeded Llama-family checkpoint (:mod:`autotp.demo`), generates with one
plain transformers process first, and exits 0 only if the tensor-parallel tokens are identical.

Bad input (an :class:`~autotp.errors.AutoTPError`, raised here or on a rank) prints one
``autotp: error:`` line with the cause and the fix, without a traceback (``--debug`` adds it), and
exits 2; what the launching process can check (config, checkpoint headers, prompt ids, names) is
checked before any rank starts or anything is planned. A rank that fails for any other reason (a bug) prints the launcher's report and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from autotp.errors import AutoTPError
from autotp.memory import cycle_collection_paused
from autotp.plan_report import PlanReport

__all__ = ["main", "run"]

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


@contextlib.contextmanager
def _imports_uncollected() -> Iterator[None]:
    """For the block's imports: importing torch, Dynamo and transformers allocates millions of objects
    that live until exit; the collector would walk them again and again, in the imports and in every
    full collection after them (0.6 + 0.5 CPU seconds of a Llama-3-70B-shaped plan). So no collection
    during the block, and what it built is frozen out of later ones. For commands, not for a library
    call (``gc.freeze`` is the whole process's)."""
    with cycle_collection_paused():
        try:
            yield
        finally:
            gc.freeze()


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


def _rank_generate(
    folder: str,
    prompt: list[int] | str,
    new_tokens: int,
    tp: int,
    trace_dir: str | None,
    dtype: str | None,
    device: str = "cpu",
    sampling: dict[str, Any] | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """Load ``folder`` tensor-parallel over the launcher's group and generate.

    ``prompt`` is token ids, or text for the checkpoint's tokenizer. ``sampling`` (``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``seed``) is applied alike on every rank, which seeds
    alike, so every rank draws the same tokens. With ``stream``, rank 0 prints tokens as they are
    generated. Returns this rank's tokens (and text), timings, parameter bytes and plan. An
    :class:`AutoTPError` comes back as ``{"error": message}`` so the parent can report it without
    a traceback.
    """
    import torch
    import torch.distributed as dist

    from autotp import parallelize_model
    from autotp.health import RankFailure

    _quiet_transformers()
    health = None
    reported = _report_on_termination()
    try:
        if not dist.is_initialized():
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        rank = dist.get_rank()
        start = time.perf_counter()
        target = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"
        model = parallelize_model(folder, tp_size=tp, dtype=dtype, trace_dir=trace_dir, device=target)
        loaded = time.perf_counter()
        health = model.autotp.context.comm.health
        if health is not None:
            health.set_phase("generate")
        tokenizer = _tokenizer(folder) if isinstance(prompt, str) else None
        ids = (
            tokenizer(prompt, return_tensors="pt").input_ids
            if tokenizer is not None
            else torch.tensor([prompt])
        )
        ids = ids.to(target)
        options = dict(sampling or {})
        seed = options.pop("seed", 0)
        if not options.get("do_sample"):
            options = {"do_sample": False}
        ctx = model.autotp.context
        clock = _TokenClock(lambda: ctx.graphs_compiled, tokenizer, echo=stream and rank == 0)
        with torch.no_grad():
            # One generate, as the user asked for it: its first steps compile the decode graph (and
            # the prefill's, unless parallelize_model's warm-up graph serves it); the clock records
            # when each token existed and how many graphs had compiled by then, so the report
            # separates the time to the first token from the decode rate after the last compile.
            torch.manual_seed(seed)  # the same seed on every rank: sampled tokens agree across ranks
            clock.start()
            out = model.generate(ids, max_new_tokens=new_tokens, streamer=clock, **options)
        done = time.perf_counter()
        tokens = out[0, ids.shape[1] :].tolist()
        return {
            "rank": rank,
            "tokens": tokens,
            "text": tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "plan": model.autotp.plan,
            "load_s": loaded - start,
            "generate_s": done - loaded,
            "token_s": clock.token_s,
            "graphs_compiled_by_token": clock.compiled,
        }
    except RankFailure as exc:
        # Another rank died: say which at once, before the launcher stops this rank too.
        print(f"autotp: rank {os.environ.get('RANK', '?')}: error: {exc}", file=sys.stderr, flush=True)
        reported.set()
        return {"error": str(exc)}
    except AutoTPError as exc:
        return {"error": str(exc)}
    except BaseException as exc:
        if health is not None:
            health.record_failure(exc)
        raise
    finally:
        if health is not None:
            health.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_on_termination() -> Any:
    """When another rank dies, the launcher stops the survivors with SIGTERM, often before their
    own failed collective has said which rank died. On SIGTERM this rank names the failed ranks
    it finds in the health store (:mod:`autotp.health`), unless it has already reported, then
    exits at once (128 + the signal). Returns the event that marks "already reported"."""
    import signal
    import threading

    from autotp.collectives import process_health

    reported = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        health = process_health()
        if health is not None and not reported.is_set():
            try:
                suspects = [s for s in health.diagnose(stale_after=0) if s.kind != "secondary"]
            except Exception:  # noqa: BLE001 - exiting anyway
                suspects = []
            if suspects:
                print(
                    f"autotp: rank {health.rank}: stopped by the launcher because "
                    + "; ".join(s.describe() for s in suspects)
                    + f". Check the log of {', '.join(f'rank {s.rank}' for s in suspects)} for its first error.",
                    file=sys.stderr,
                    flush=True,
                )
        sys.stdout.flush()
        os._exit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    return reported


def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise AutoTPError(
            f"--prompt needs the checkpoint's tokenizer, but none loads from {folder} ({exc}); pass token "
            "ids with --prompt-ids instead"
        ) from None


class _TokenClock:
    """``generate``'s streamer on every rank: records, for each new token, the seconds since
    :meth:`start` at which it existed (``token_s``) and how many graphs this model had compiled by
    then (``compiled``, from ``graphs_compiled``), so the decode rate can be taken over the steps
    after the last compile (:func:`_generate_timing`). With ``echo`` (rank 0 of ``autotp generate``) it
    also prints each token as it comes: text when there is a ``tokenizer``, ids otherwise. The first
    ``put`` is the prompt, skipped."""

    def __init__(self, graphs_compiled: Callable[[], int], tokenizer: Any, *, echo: bool) -> None:
        self.graphs_compiled = graphs_compiled
        self.tokenizer = tokenizer
        self.echo = echo
        self.start()
        self.prompt_seen = False
        self.tokens: list[int] = []
        self.token_s: list[float] = []
        self.compiled: list[int] = []
        self.printed = 0

    def start(self) -> None:
        """Call just before ``generate``: the clock's zero."""
        self.started = time.perf_counter()
        self.compiled_before = self.graphs_compiled()

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        new = [int(t) for t in value.reshape(-1).tolist()]
        self.token_s.extend([time.perf_counter() - self.started] * len(new))
        self.compiled.extend([self.graphs_compiled() - self.compiled_before] * len(new))
        self.tokens.extend(new)
        if not self.echo:
            return
        if self.tokenizer is None:
            print(" ".join(str(t) for t in new), end=" ", flush=True)
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        print(text[self.printed :], end="", flush=True)
        self.printed = len(text)

    def end(self) -> None:
        if self.echo:
            print(flush=True)


#: What every rank imports before it loads a model: the compile stack (with what a first compile
#: imports lazily: a demo rank forked from this list imports 0.1 CPU-s more), transformers'
#: generation code, autotp. The ranks' forkserver imports them once.
RANK_PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "torch._dynamo.backends.debugging", "torch._functorch.aot_autograd",
    "torch._functorch.compilers", "torch.fx.experimental.proxy_tensor", "torch._subclasses.fake_tensor",
    "torch.export", "torch.export._trace", "torch.distributed.tensor.experimental", "sympy.combinatorics",
    "transformers", "transformers.generation.utils", "autotp.api", "autotp.passes.ilp", "autotp.cli",
)


def _start_rank_server(modeling: str | None) -> None:
    """Start the process this machine's ranks are forked from (if it is not running yet): a
    ``forkserver`` that imports :data:`RANK_PRELOAD` and the model's ``modeling`` module once.

    Measured with ``autotp demo --tp 2`` on 2 cores: a ``spawn``-ed rank is a fresh interpreter
    that spends ~5 CPU-s importing torch, Dynamo, transformers and autotp before it reads a weight,
    every rank again; forked from the preloaded server a rank starts with them imported, and the
    imports are paid once however many ranks the machine runs. CPU seconds of the whole process
    tree on 2 shared cores, ``spawn`` -> this: ``autotp demo --tp 2`` 33 -> 21 with an empty cache
    (3 runs each), 18 -> 10 warm; ``autotp generate`` of a 2-layer Llama at ``--tp 2`` 30 -> 18
    cold, 20 -> 10 warm. Calling this before the launching process's own work (``demo`` does,
    before it builds the checkpoint) lets the server import while that work runs.

    Not ``fork`` from this process: by the time the elastic agent starts the ranks it runs the
    rendezvous store's threads (forking a multi-threaded process may deadlock the child), and
    ``generate --device cuda`` asked the CUDA driver for its GPU count (a forked child of a process
    that initialized the driver cannot use CUDA). The server is a fresh interpreter that only
    imports, and importing torch initializes no CUDA, so each rank still creates its own CUDA
    context. The ranks inherit the server's environment, which is this process's when it starts
    the server (inside the command's environment block; the elastic agent adds ``RANK``,
    ``MASTER_ADDR`` ... on top). The server lives until this process exits: a second launch from
    the same process (``main`` called twice from Python) reuses it, environment and all. How it
    collects garbage and exits: :mod:`autotp._rank_server`."""
    import multiprocessing.forkserver

    # autotp._rank_server first: it turns the collector off for the imports that follow
    preload = ["autotp._rank_server", *RANK_PRELOAD, *([modeling] if modeling else [])]
    multiprocessing.forkserver.set_forkserver_preload(preload)
    multiprocessing.forkserver.ensure_running()


def _launch(
    tp: int,
    args: tuple[Any, ...],
    log_dir: Path,
    nnodes: int = 1,
    rdzv_backend: str = "c10d",
    rdzv_endpoint: str = "127.0.0.1:0",
    rdzv_id: str | None = None,
    modeling: str | None = None,
) -> dict[int, dict[str, Any]]:
    """Run :func:`_rank_generate` on ``tp`` ranks (``tp / nnodes`` on this machine), forked from
    the preloaded server of :func:`_start_rank_server` (``modeling``: the model's modeling module,
    imported there too); return each rank's result. The rendezvous flags are torchrun's, passed
    through for multi-node runs."""
    if tp % nnodes:
        raise AutoTPError(
            f"--tp {tp} is not divisible by --nnodes {nnodes}; each node runs tp / nnodes ranks"
        )
    _start_rank_server(modeling)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=tp // nnodes,
        run_id=rdzv_id or f"autotp-{uuid.uuid4().hex[:12]}",
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,  # default: the agent hosts the store on a port the OS picks
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=os.fspath(log_dir)),
    )
    try:
        results = elastic_launch(config, _rank_generate)(*args)
    except ChildFailedError as exc:
        raise _RankFailure(_failed_ranks(exc), str(exc)) from None
    errors = {r["error"] for r in results.values() if "error" in r}
    if errors:
        raise AutoTPError("; ".join(sorted(errors)))
    return results


class _RankFailure(Exception):
    """A rank died or raised something other than an AutoTPError: which ranks (a line), and the
    launcher's report."""

    def __init__(self, summary: str, report: str) -> None:
        super().__init__(summary)
        self.summary, self.report = summary, report


def _failed_ranks(exc: Any) -> str:
    """One line naming the ranks the launcher saw fail, and how (exit code or signal)."""
    parts = []
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        if failure.exitcode < 0:
            try:
                how = f"killed by signal {failure.signal_name()}"
            except Exception:  # noqa: BLE001 - an unknown signal number
                how = f"killed by signal {-failure.exitcode}"
        else:
            how = f"exit code {failure.exitcode}"
        parts.append(f"rank {rank} ({how})")
    return ("failed: " + ", ".join(parts)) if parts else "a rank failed"


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _safetensors_bytes(folder: Path) -> int:
    """Bytes of all tensors in the folder's safetensors files (from their headers, no data read)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(
            end - start
            for k, v in header.items()
            if k != "__metadata__"
            for start, end in [v["data_offsets"]]
        )
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
    print(
        f"  parameter bytes per rank: {_mib(param_bytes)} of {_mib(full_bytes)} in the full checkpoint "
        f"({share:.1f}%)"
    )
    # One decoder block stands for all of them; other layers' entries are the same styles.
    shown = [(fqn, e) for fqn, e in params.items() if ".layers." not in fqn or ".layers.0." in fqn]
    width = max((len(fqn) for fqn, _ in shown), default=0)
    for fqn, e in shown:
        shapes = f"{tuple(e['global_shape'])} -> {tuple(e['local_shape'])}"
        print(f"    {fqn:<{width}}  {e['style']:<9} {shapes}")
    if len(shown) < len(params):
        print(f"    ... and {len(params) - len(shown)} more in layers 1+ (same styles as layer 0)")


def _generate_timing(token_s: list[float], compiled: list[int]) -> dict[str, Any]:
    """What one generate's token clock (:class:`_TokenClock`) says: ``first_token_s`` (the prefill,
    with whatever compiled for it), ``graphs_compiled`` during the generate and ``last_compile_token``
    (1-based: the token whose step compiled last; 0 when none did), and the steady decode rate over the
    tokens after both the first token and the last compile: ``decode_tokens`` in ``decode_s``
    (no token there when a graph compiled up to the last step)."""
    n = len(token_s)
    last = max((i + 1 for i in range(n) if compiled[i] > (compiled[i - 1] if i else 0)), default=0)
    begin = max(last, 1)  # the decode span starts at this token's time: the prefill is never in it
    return {
        "tokens": n,
        "first_token_s": token_s[0] if n else None,
        "graphs_compiled": compiled[-1] if n else 0,
        "last_compile_token": last,
        "decode_tokens": max(n - begin, 0),
        "decode_s": token_s[-1] - token_s[begin - 1] if n > begin else 0.0,
        "generate_s": token_s[-1] if n else 0.0,
    }


def _throughput(summary: dict[str, Any]) -> str:
    """The timing line of one generate on rank 0: the time to the first token, the graphs compiled
    during the generate, and the decode rate over the tokens after the last compile (how many)."""
    t = _generate_timing(summary["token_s"], summary["graphs_compiled_by_token"])
    if not t["tokens"]:
        return f"generated 0 tokens in {summary['generate_s']:.2f} s (rank 0)"
    compiled = (
        f"{t['graphs_compiled']} graph(s) compiled, the last in token {t['last_compile_token']}'s step "
        f"(out after {summary['token_s'][t['last_compile_token'] - 1]:.2f} s)"
        if t["graphs_compiled"] else "no graph compiled"
    )
    if t["decode_tokens"] and t["decode_s"] > 0:
        after = "that compile" if t["last_compile_token"] > 1 else "the first token"
        rate = (f"decode {t['decode_tokens'] / t['decode_s']:.2f} tokens/s over the {t['decode_tokens']} token(s) "
                f"after {after} (no compile in that span)")
    else:
        rate = "no decode step after the last compile to time (ask for more --max-new-tokens)"
    return (
        f"generated {t['tokens']} tokens in {t['generate_s']:.2f} s (rank 0): "
        f"first token after {t['first_token_s']:.2f} s; {compiled}; {rate}"
    )


def _rank_summary(results: dict[int, dict[str, Any]], tp: int) -> dict[str, Any]:
    first = results[min(results)]
    same = all(r["tokens"] == first["tokens"] for r in results.values())
    if not same:
        for rank, r in sorted(results.items()):
            print(f"  rank {rank} tokens: {r['tokens']}")
    print(
        f"tp={tp}: parallelize_model {first['load_s']:.1f} s, generate {first['generate_s']:.1f} s on rank 0; "
        f"all {len(results)} ranks produced the same tokens: {'yes' if same else 'NO'}"
    )
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
        with _imports_uncollected():
            _quiet_transformers()
            import torch
            from transformers import AutoModelForCausalLM, LlamaForCausalLM

            from autotp.api import check_divisible
            from autotp.demo import DEMO_PROMPT, build_demo_checkpoint, demo_config

        config = demo_config()
        check_divisible(config, args.tp)  # refuse a bad --tp before building or launching anything
        _start_rank_server(_modeling(LlamaForCausalLM))  # imports while the checkpoint is built and run
        folder = build_demo_checkpoint(workdir / "checkpoint")
        full_bytes = _safetensors_bytes(folder)
        print(
            f"autotp demo: seeded Llama-family checkpoint ({config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads / {config.num_key_value_heads} kv heads, "
            f"vocab {config.vocab_size}, fp32, {_mib(full_bytes)}) in {folder}"
        )

        prompt = list(DEMO_PROMPT)
        t0 = time.perf_counter()
        reference = AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        del reference
        print(
            f"one process (plain transformers): greedy generate {args.new_tokens} tokens in "
            f"{time.perf_counter() - t0:.1f} s"
        )

        print(f"launching {args.tp} CPU rank(s) (gloo) with torch's elastic launcher ...", flush=True)
        results = _launch(
            args.tp,
            (os.fspath(folder), prompt, args.new_tokens, args.tp, args.trace_dir, None),
            workdir / "logs",
            modeling=_modeling(LlamaForCausalLM),
        )
        summary = _rank_summary(results, args.tp)
        _print_plan(summary["plan"], summary["param_bytes"], full_bytes, args.tp)
        identical = summary["ranks_agree"] and summary["tokens"] == ref
        print(f"prompt ids:            {prompt}")
        print(f"one process:           {ref}")
        print(f"autotp tp={args.tp}, rank 0:  {summary['tokens']}")
        print(f"tokens identical to one process: {'yes' if identical else 'NO'}")
        if args.trace_dir:
            print(
                f"solver traces: {Path(args.trace_dir).resolve()} (rank*/graph*/, see docs/architecture.md)"
            )
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


def _modeling(model_class: type) -> str | None:
    """The module defining ``model_class``, for the ranks' server to import (see
    :func:`_start_rank_server`); None for code outside transformers (a checkpoint's remote code,
    which each rank imports itself)."""
    module = model_class.__module__
    return module if module.startswith("transformers.models.") else None


def _check_before_launch(folder: Path, tp: int, dtype: str | None, prompt: list[int] | str) -> str | None:
    """Everything about the checkpoint and the prompt that would fail on the ranks, checked in this
    process before any rank starts (seconds, against minutes of launching and compiling): the config
    reads and divides by ``tp``, the weights' headers hold every parameter in a shape and dtype that
    fit (:mod:`autotp.checkpoint_match`), the prompt ids lie inside the vocabulary and a text
    prompt has a tokenizer. Returns the model's modeling module (:func:`_modeling`)."""
    import torch

    from autotp.api import check_divisible
    from autotp.checkpoint_match import check_checkpoint
    from autotp.config import parse_dtype
    from autotp.hf_config import read_config
    from autotp.inputs import check_token_ids
    from autotp.weights import build_meta_model

    torch_dtype = parse_dtype(dtype)
    config = read_config(folder)
    check_divisible(config, tp)
    module = build_meta_model(config, dtype=torch_dtype)
    check_checkpoint(folder, module)
    if isinstance(prompt, str):
        _tokenizer(os.fspath(folder))  # refuse a missing tokenizer before launching anything
    else:
        embeddings = module.get_input_embeddings()
        rows = int(embeddings.weight.shape[0]) if embeddings is not None else None
        if rows is not None:
            check_token_ids("--prompt-ids", torch.tensor(prompt), rows)
    return _modeling(type(module))


def _cmd_generate(args: argparse.Namespace) -> int:
    _positive("--tp", args.tp)
    _positive("--max-new-tokens", args.max_new_tokens)
    _positive("--nnodes", args.nnodes)
    if (args.prompt is None) == (args.prompt_ids is None):
        raise AutoTPError(
            "give the prompt as text (--prompt, with the checkpoint's tokenizer) or as token ids "
            "(--prompt-ids), exactly one of them"
        )
    prompt: list[int] | str = args.prompt if args.prompt is not None else _parse_ids(args.prompt_ids)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise AutoTPError("--device cuda but this torch build sees no CUDA device; use --device cpu")
        per_node = args.tp // args.nnodes if args.tp % args.nnodes == 0 else args.tp
        if per_node > torch.cuda.device_count():
            raise AutoTPError(
                f"--tp {args.tp} --device cuda runs {per_node} ranks on this machine, one GPU each (NCCL), but "
                f"it has {torch.cuda.device_count()} GPU(s); use --tp {torch.cuda.device_count()} (or fewer), more "
                "machines (--nnodes), or --device cpu"
            )
    sampling = {
        "do_sample": args.do_sample,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environ(_QUIET_ENV))  # threads: parallelize_model gives cores / local ranks
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="autotp-logs-")))
        with _imports_uncollected():
            _quiet_transformers()
            from autotp.weights import resolve_checkpoint

        # Resolve (download) once here, not once per rank; the ranks get the local folder.
        folder = resolve_checkpoint(
            args.model, revision=args.revision, local_files_only=args.local_files_only
        )
        modeling = _check_before_launch(folder, args.tp, args.dtype, prompt)
        print(f"launching {args.tp} rank(s) ({args.device}) ...", flush=True)
        results = _launch(
            args.tp,
            (
                os.fspath(folder),
                prompt,
                args.max_new_tokens,
                args.tp,
                args.trace_dir,
                args.dtype,
                args.device,
                sampling,
                True,
            ),
            logs,
            nnodes=args.nnodes,
            rdzv_backend=args.rdzv_backend,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
            modeling=modeling,
        )
        summary = _rank_summary(results, args.tp)
        _print_plan(summary["plan"], summary["param_bytes"], _safetensors_bytes(folder), args.tp)
        print(_throughput(summary))
        if summary.get("text") is not None:
            print(f"text: {summary['text']}")
        else:
            print(f"prompt ids: {prompt}")
        print(f"generated ids: {summary['tokens']}")
    return 0 if summary["ranks_agree"] else 1


def _parse_overrides(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        pattern, sep, style = item.partition("=")
        if not sep or not pattern.strip() or not style.strip():
            raise AutoTPError(f"--override must read PATTERN=STYLE (e.g. 'lm_head=replicate'), got {item!r}")
        out[pattern.strip()] = style.strip()
    return out


def _plan_report(args: argparse.Namespace, overrides: dict[str, str]) -> tuple[PlanReport, list[Any]]:
    """The report ``autotp plan`` prints, and the explanations of ``--explain``.

    Read from the report cache (``autotp/report_cache.py``) before the planner, and with it torch
    and transformers, is imported: a hit costs a file read and this module's imports. A miss plans
    (:func:`autotp.planner.plan_model`) and keeps the report. A hit was stored after the planner's
    checks passed for the very same key, so it never needs them again."""
    from autotp.report_cache import ReportCache, config_file

    started = time.perf_counter()
    request = {"tp": args.tp, "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
               "decode": not args.no_decode, "overrides": overrides, "full_depth": args.full_depth,
               "revision": args.revision, "local_files_only": args.local_files_only}
    cache = ReportCache(None) if args.explain else ReportCache.from_environment()
    config = config_file(args.model, revision=args.revision, local_files_only=args.local_files_only) \
        if cache.root is not None else None
    key = cache.key(args.model, config, request) if config is not None else None
    state = cache.load(key)
    if state is not None:
        report = PlanReport.from_state(state)
        report.timings = {"report_cache_read_s": time.perf_counter() - started}
        return report, []
    with _environ(_QUIET_ENV):
        with _imports_uncollected():
            _quiet_transformers()
            from autotp.planner import explain_matching, plan_model
        report = plan_model(args.model, explain_names=args.explain, **request)
        explanations = [e for name in args.explain for e in explain_matching(report, name)]
    cache.store(key, report.to_state())
    return report, explanations


def _cmd_plan(args: argparse.Namespace) -> int:
    """``autotp plan``: a thin layer over :func:`autotp.planner.plan_model` (one process, meta
    device); the report is printed as text, JSON (``--json``) or a tp_plan (``--tp-plan``)."""
    _positive("--tp", args.tp)
    _positive("--batch", args.batch)
    if args.seq_len is not None:
        _positive("--seq-len", args.seq_len)
    overrides = _parse_overrides(args.override)
    for flag, path in (("--html", args.html), ("--png", args.png)):
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise AutoTPError(
                f"{flag} {path}: the folder {Path(path).expanduser().resolve().parent} does not "
                "exist; create it or pass another path"
            )
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise AutoTPError(
            "autotp plan --png needs matplotlib, which is not installed: "
            "pip install 'autotp[plot]' (or pip install matplotlib), or use --html"
        )
    report, explanations = _plan_report(args, overrides)
    from autotp.render import render_html, render_png, render_text

    if args.html:
        try:
            Path(args.html).write_text(render_html(report))
        except OSError as e:
            raise AutoTPError(
                f"cannot write --html {args.html}: {e.strerror or e}; pass a writable path"
            ) from e
    if args.png:
        try:
            render_png(report, args.png)
        except OSError as e:
            raise AutoTPError(
                f"cannot write --png {args.png}: {e.strerror or e}; pass a writable path"
            ) from e
    if args.json:
        out = report.to_json()
        if explanations:
            out["explanations"] = {
                e.fqn: {"chain": e.chain, "alternatives": e.alternatives} for e in explanations
            }
        print(json.dumps(out, indent=1))
    elif args.tp_plan:
        print(json.dumps(report.transformers_tp_plan(), indent=1))
    else:
        print(render_text(report))
        print(f"layers: {report.depth}")
        for e in explanations:
            print(e.text())
        for path in (args.html, args.png):
            if path:
                print(f"plan drawn in {Path(path).resolve()}")
    return 0


def _add_debug(parser: argparse.ArgumentParser) -> None:
    """``--debug`` after the subcommand as well (SUPPRESS: an unset flag leaves the top-level one)."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show the traceback as well as the one-line message",
    )


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="print the tensor-parallel plan of a model from its config (no weights, one process)",
        description="Plan MODEL (Hub id, folder, or a folder holding only config.json) for --tp ranks in one "
        "process on the meta device: per-parameter styles, collectives per forward and per "
        "generated token, bytes per rank, solver timings.",
    )
    plan.add_argument("model", metavar="MODEL", help="Hub id ('org/name') or a folder with config.json")
    plan.add_argument("--tp", type=int, required=True, help="tensor-parallel size to plan for")
    plan.add_argument(
        "--dtype", default=None, help="parameter dtype (bf16, fp16, fp32; default: the config's)"
    )
    plan.add_argument("--batch", type=int, default=1, help="batch size of the planned calls (default 1)")
    plan.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="prompt length, and KV-cache positions of the decode step (default 2*tp+1)",
    )
    plan.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="PATTERN=STYLE",
        help="pin parameters (fnmatch on parameter/module names) to a style: colwise, rowwise, "
        "vocab, replicate, shard(d); repeatable",
    )
    plan.add_argument(
        "--explain",
        action="append",
        default=[],
        metavar="NAME",
        help="say why a parameter got its placement: a parameter or module name, or an fnmatch "
        "pattern, as --override reads them (e.g. lm_head); repeatable",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument(
        "--tp-plan",
        action="store_true",
        help="print the plan as a transformers tp_plan dict (DistributedConfig(tp_plan=...))",
    )
    plan.add_argument("--html", default=None, metavar="FILE", help="also draw the plan into this HTML file")
    plan.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="also draw the plan into this PNG file (needs matplotlib: the [plot] extra)",
    )
    plan.add_argument("--no-decode", action="store_true", help="plan the forward only (skip the decode steps)")
    plan.add_argument(
        "--full-depth",
        action="store_true",
        help="trace and solve every layer (by default a deep model is planned from a few layers that stand "
        "for the repeated ones, and the report expanded: autotp/depth.py)",
    )
    plan.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    plan.add_argument(
        "--local-files-only", action="store_true", help="do not download; use the Hub cache only"
    )
    _add_debug(plan)
    plan.set_defaults(func=_cmd_plan)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp",
        description="Run Hugging Face models tensor-parallel with autotp (a torch.compile backend).",
    )
    parser.add_argument(
        "--debug", action="store_true", help="on an error, show the traceback as well as the one-line message"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="build a tiny seeded Llama checkpoint, run it tensor-parallel on CPU, compare tokens",
        description="Build a small seeded Llama-family checkpoint, generate greedily in one process, then "
        "on --tp CPU ranks with parallelize_model; exit 0 only if the tokens are identical.",
    )
    demo.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of ranks (default 2)")
    demo.add_argument("--new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    demo.add_argument(
        "--workdir",
        default=None,
        help="folder for the checkpoint and launcher logs (kept); default: a temporary folder",
    )
    demo.add_argument("--trace-dir", default=None, help="write autotp's solver traces here (rank*/graph*/)")
    _add_debug(demo)
    demo.set_defaults(func=_cmd_demo)

    gen = sub.add_parser(
        "generate",
        help="generate text with a checkpoint loaded tensor-parallel, streaming the tokens",
        description="Load MODEL (Hub id or local folder) with parallelize_model on --tp ranks (torch's elastic "
        "launcher; --nnodes/--rdzv-* pass through for several machines) and generate from the "
        "prompt, printing tokens as they come and the tokens/s at the end.",
    )
    gen.add_argument(
        "model", metavar="MODEL", help="Hub id ('org/name') or a folder written by save_pretrained"
    )
    gen.add_argument("--tp", type=int, required=True, help="tensor-parallel size = number of ranks")
    gen.add_argument("--prompt", default=None, help="prompt text (tokenized with the checkpoint's tokenizer)")
    gen.add_argument("--prompt-ids", default=None, help='or comma-separated token ids, e.g. "1,2,3"')
    gen.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu (gloo) or cuda (NCCL, one GPU per rank); default cpu",
    )
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    gen.add_argument("--top-k", type=int, default=50, help="sampling top-k (default 50)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (default 1.0)")
    gen.add_argument("--seed", type=int, default=0, help="seed, the same on every rank (default 0)")
    gen.add_argument(
        "--nnodes", type=int, default=1, help="machines taking part (torchrun's flag; default 1)"
    )
    gen.add_argument("--rdzv-backend", default="c10d", help="torchrun's rendezvous backend (default c10d)")
    gen.add_argument(
        "--rdzv-endpoint",
        default="127.0.0.1:0",
        help="torchrun's rendezvous endpoint HOST:PORT (default: this machine, a free port)",
    )
    gen.add_argument("--rdzv-id", default=None, help="torchrun's rendezvous id (default: a fresh one)")
    gen.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    gen.add_argument(
        "--dtype", default=None, help="load the weights in this dtype (default: the checkpoint's)"
    )
    gen.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    gen.add_argument(
        "--local-files-only", action="store_true", help="do not download; use the Hub cache only"
    )
    gen.add_argument("--trace-dir", default=None, help="write autotp's solver traces here (rank*/graph*/)")
    _add_debug(gen)
    gen.set_defaults(func=_cmd_generate)

    _add_plan_parser(sub)
    return parser


def one_line(message: str) -> str:
    """``message`` on one line (a rank's error may carry newlines), whole: never cut."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


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
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"autotp: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except _RankFailure as exc:
        print(
            f"autotp: error: {exc.summary}. A rank killed by signal 9 with no error of its own is usually the "
            "out-of-memory killer; otherwise the launcher's report below shows the first error "
            f"(a bug in autotp or its environment):\n{exc.report}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:
    """The ``autotp`` command (the console script and ``python -m autotp``): :func:`main`, then exit
    at once. A process that imported torch, Dynamo and transformers and planned a model spends
    1.5-2.5 CPU seconds in the interpreter's teardown (collecting and finalizing its objects:
    ``autotp plan`` of a Llama-3-70B shape, ``benchmarks/solver_scaling.py --cached``), after the
    command has said all it has to say. So the streams are flushed, logging is shut down, and the
    process ends with ``os._exit``: atexit handlers do not run (autotp registers none; every file a
    command writes is closed and every rank joined before :func:`main` returns). Python callers
    and tests use :func:`main`."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (autotp plan ... | head): nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
