"""Training step speed and memory per rank: forward + backward + AdamW at tp = 1, 2, 4.

    python benchmarks/training.py --tp 1,2,4 --batch 1 --seq 128 \\
        --steps 3 --out training.json

Same checkpoint as the other benchmarks (``benchmarks/_checkpoint.py``: 154M-parameter Llama
family, fp32). Each tp size is one launch (torch's elastic launcher, ``--standalone``; tp=1 is
``parallelize_model`` in one process, which compiles but solves nothing) with ``cores // tp``
threads per rank unless ``OMP_NUM_THREADS`` is set. A launch loads the model, builds
``torch.optim.AdamW(model.parameters())`` over the local shards, runs one untimed step (it compiles
the training graphs and allocates the optimizer state), then ``--steps`` timed steps of
``loss = model(input_ids, labels=input_ids).loss; loss.backward(); optimizer.step();
optimizer.zero_grad()`` on a ``batch x seq`` batch with a barrier before each.

Reported per tp: ``tokens_per_s`` (batch * seq / median step time; every rank processes the same
tokens, so this is the group's throughput), ``step_ms`` (median), and per rank the peak resident
set (``VmHWM``, ``benchmarks/_record.py``: ``memory``; on CUDA ``torch.cuda.max_memory_allocated``),
the anonymous resident memory at the end (``RssAnon``), the resident set after loading, and the bytes of parameters + gradients + AdamW state this rank holds
(``state_bytes``: ideal 1/N of one process's, plus the replicated norms), and ``activation_bytes``:
the distinct storages autograd saves for backward during one (untimed) training forward, counted
with ``autotp.training.saved_activation_bytes``. ``--sequence-parallel`` adds, for every tp > 1,
a launch with ``parallelize_model(..., sequence_parallel=True)`` (reported as ``"<tp>+sp"``): its
``activation_bytes`` against the plain launch's is the activation memory sequence parallelism
saves. On a shared machine the timings move with the neighbours' load: compare launches made in
one run.
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

from _record import Provenance, checkpoint_name, launch, memory, stats, write_result  # noqa: E402


def _worker(
    folder: str, batch: int, seq: int, steps: int, result: str, sequence_parallel: bool = False
) -> None:
    """One launch: load, one warm-up step, ``steps`` timed steps; every rank reports, rank 0 writes."""
    import torch
    import torch.distributed as dist
    import transformers

    from autotp import parallelize_model
    from autotp.training import saved_activation_bytes

    transformers.logging.set_verbosity_error()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    t0 = time.perf_counter()
    model = parallelize_model(folder, progress=False, sequence_parallel=sequence_parallel)
    load_s = time.perf_counter() - t0
    rank, world = model.autotp.rank, model.autotp.world_size
    after_load = memory()
    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    ids = (torch.arange(batch * seq) * 7919 % (vocab - 1) + 1).reshape(batch, seq).to(device)  # (B, S)

    def barrier() -> None:
        if distributed:
            dist.barrier()

    def step() -> float:
        barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers: they are part of the peak
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    t0 = time.perf_counter()
    step()
    warmup_s = time.perf_counter() - t0
    times = [step() for _ in range(steps)]
    loss, activation_bytes = saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    optimizer.zero_grad(set_to_none=False)
    state_bytes = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # value + grad
    state_bytes += sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    record = {
        "rank": rank,
        "step_s": times,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "peak_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else memory()["peak_rss"]
        ),
        "rss_anon_bytes": memory()["rss_anon"],
        "rss_after_load_bytes": after_load["rss"],
        "state_bytes": state_bytes,
        "activation_bytes": activation_bytes,
        "threads": torch.get_num_threads(),
    }
    records = [None] * world if distributed else [record]
    if distributed:
        dist.all_gather_object(records, record)
    if rank == 0:
        Path(result).write_text(json.dumps({"world_size": world, "ranks": records}))
    if distributed:
        dist.destroy_process_group()


def _launch(
    tp: int, folder: Path, args: argparse.Namespace, result: Path, sequence_parallel: bool = False
) -> dict[str, Any]:
    worker = [
        os.fspath(Path(__file__).resolve()),
        "--worker",
        os.fspath(folder),
        str(args.batch),
        str(args.seq),
        str(args.steps),
        os.fspath(result),
        str(int(sequence_parallel)),
    ]
    launch(tp, worker, label=f"tp={tp}")
    return json.loads(result.read_text())


def _summary(run: dict[str, Any], tokens: int) -> dict[str, Any]:
    ranks = run["ranks"]
    step_ms = stats([1000 * t for r in ranks for t in r["step_s"]])
    step = step_ms["median"] / 1000
    return {
        "step_ms_stats": {k: v for k, v in step_ms.items() if k != "all"},
        "tokens_per_s": tokens / step,
        "step_ms": 1000 * step,
        "warmup_s": max(r["warmup_s"] for r in ranks),
        "load_s": max(r["load_s"] for r in ranks),
        "threads_per_rank": ranks[0]["threads"],
        "per_rank": [
            {
                k: r[k]
                for k in (
                    "rank",
                    "peak_bytes",
                    "rss_anon_bytes",
                    "rss_after_load_bytes",
                    "state_bytes",
                    "activation_bytes",
                )
            }
            for r in ranks
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--worker",
        nargs=6,
        metavar=("FOLDER", "BATCH", "SEQ", "STEPS", "RESULT", "SP"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "autotp-bench"),
        help="folder for the benchmark checkpoint (written once)",
    )
    parser.add_argument(
        "--size",
        default="150m",
        choices=("150m", "small"),
        help="benchmark checkpoint size (small: a smoke run of the script)",
    )
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tp sizes")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per launch")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also run every tp > 1 with sequence_parallel=True (reported as '<tp>+sp')",
    )
    parser.add_argument("--out", default="training.json")
    args = parser.parse_args(argv)
    if args.worker:
        folder, batch, seq, steps, result, sp = args.worker
        _worker(folder, int(batch), int(seq), int(steps), result, sequence_parallel=sp == "1")
        return 0

    provenance = Provenance.start(argv)
    import torch
    from _checkpoint import make_checkpoint

    folder = make_checkpoint(args.cache, torch.float32, size=args.size)
    report: dict[str, Any] = {
        "checkpoint": checkpoint_name(folder),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "tp": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (int(t) for t in args.tp.split(",")):
            for sp in (False, True) if args.sequence_parallel and tp > 1 else (False,):
                key = f"{tp}+sp" if sp else str(tp)
                run = _launch(tp, folder, args, Path(tmp) / f"tp{key}.json", sequence_parallel=sp)
                report["tp"][key] = _summary(run, args.batch * args.seq)
                print(json.dumps({"tp": key, **report["tp"][key]}), flush=True)
    write_result(args.out, report, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
