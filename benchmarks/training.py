"""Training step speed and memory per rank: forward + backward + AdamW at tp = 1, 2, 4, with
sequence parallelism, with gradient checkpointing, and on a dp x tp mesh (FSDP2 or DDP on "dp").

    python benchmarks/training.py --tp 1,2,4 --batch 1 --seq 128 \\
        --steps 3 --out training.json
    python benchmarks/training.py --tp 1,2 --sequence-parallel --checkpointing --mesh 2x2 \\
        --size small --steps 2 --out training_rows.json

Same checkpoint as the other benchmarks (``benchmarks/_checkpoint.py``: 154M-parameter Llama
family, fp32; ``--size small``: 6.3M parameters, for a quick run). Each row is one launch (torch's
elastic launcher, ``--standalone``; tp=1 is ``parallelize_model`` in one process, which compiles but
solves nothing) with ``cores // ranks`` threads per rank unless ``OMP_NUM_THREADS`` is set. A
launch loads the model, builds ``torch.optim.AdamW(model.parameters())`` over the local shards, runs
one untimed step (it compiles the training graphs and allocates the optimizer state), then
``--steps`` timed steps of ``loss = model(input_ids, labels=input_ids).loss; loss.backward();
optimizer.step(); optimizer.zero_grad()`` on a ``batch x seq`` batch with a barrier before each.

Rows (``rows`` in the JSON, by name): ``"<tp>"`` for each ``--tp``; with ``--sequence-parallel``,
``"<tp>+sp"`` for every tp > 1 (``parallelize_model(..., sequence_parallel=True)``); with ``--mesh
DPxTP``, ``"<dp>x<tp> fsdp"`` and ``"<dp>x<tp> ddp"`` (``init_device_mesh("cpu", (dp, tp),
mesh_dim_names=("dp", "tp"))``, ``parallelize_model(..., mesh=mesh, data_parallel=...)``, each dp
replica training on its own ``batch x seq`` tokens); with ``--checkpointing``, every row again as
``"<row>+ckpt"`` (``model.gradient_checkpointing_enable()`` after loading, before the first step).

Reported per row: ``tokens_per_s`` (dp * batch * seq / median step time: the group's throughput),
``step_ms`` (median) and ``step_ms_stats`` (median, min, max, spread over all ranks' timed steps),
and per rank the peak resident set (``VmHWM``, ``benchmarks/_record.py``: ``memory``; on CUDA
``torch.cuda.max_memory_allocated``), the anonymous resident memory at the end (``RssAnon``), the
resident set after loading, the bytes of parameters + gradients + AdamW state this rank holds
(``state_bytes``; FSDP2's DTensors by their local piece), and what autograd saves for backward
during one (untimed) training forward, counted with ``autotp.training.saved_activation_bytes``:
``saved_bytes`` (every distinct storage) and ``activation_bytes`` (the same without the storages of
this rank's weights, which a matmul keeps for its input's gradient: at small batches they are most
of ``saved_bytes``, though no activation). ``*_max`` is the largest rank's, and
``*_ratio_to_one_process`` divides it by row ``"1"``'s (one process, no checkpointing) when that
row ran. A row whose launch fails is recorded with its ``error`` (and the script exits 1) while the
other rows still run. On a shared machine the timings move with the neighbours' load: compare
launches made in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, checkpoint_name, launch, memory, stats, write_result  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One configuration, run as one launch of ``dp * tp`` ranks."""

    tp: int
    dp: int = 1
    data_parallel: str | None = None  # "fsdp" or "ddp" on a dp x tp mesh, None without a mesh
    sequence_parallel: bool = False
    checkpointing: bool = False

    @property
    def name(self) -> str:
        """``"2"``, ``"2+sp"``, ``"2x2 fsdp"``, each with ``"+ckpt"`` under gradient checkpointing."""
        name = f"{self.dp}x{self.tp} {self.data_parallel}" if self.data_parallel else str(self.tp)
        return name + ("+sp" if self.sequence_parallel else "") + ("+ckpt" if self.checkpointing else "")

    @property
    def ranks(self) -> int:
        return self.dp * self.tp


def _local_bytes(t: Any) -> int:
    """Bytes of this rank's piece of ``t`` (FSDP2's DTensor shards by their local tensor)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _weights(model: Any) -> list[Any]:
    """The tensors whose storages are this rank's weights: the parameters' local pieces, and the
    local shards the compiled graphs bind (under FSDP2 the all-gathered tensors, during a call)."""
    from torch.distributed.tensor import DTensor

    from autotp.context import meta_of

    out = []
    for p in model.parameters():
        out.append(p.to_local() if isinstance(p, DTensor) else p)
        meta = meta_of(p)
        if meta is not None and meta.local is not None:
            out.append(meta.local)
    return out


def _worker(folder: str, batch: int, seq: int, steps: int, result: str, row: Row) -> None:
    """One launch: load, one warm-up step, ``steps`` timed steps; every rank reports, rank 0 writes.
    On a mesh each dp replica trains on its own ``batch x seq`` tokens."""
    import torch
    import torch.distributed as dist
    import transformers

    from autotp import parallelize_model
    from autotp.training import saved_activation_bytes

    transformers.logging.set_verbosity_error()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    t0 = time.perf_counter()
    dp_rank = 0
    if row.data_parallel:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (row.dp, row.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        model = parallelize_model(folder, progress=False, mesh=mesh, data_parallel=row.data_parallel)
    else:
        model = parallelize_model(folder, progress=False, sequence_parallel=row.sequence_parallel)
    if row.checkpointing:
        model.gradient_checkpointing_enable()
    load_s = time.perf_counter() - t0
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    after_load = memory()
    device = next(model.parameters()).device
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    first = dp_rank * batch * seq  # each dp replica its own tokens
    ids = ((torch.arange(batch * seq) + first) * 7919 % (vocab - 1) + 1).reshape(batch, seq).to(device)  # (B, S)

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
    loss, saved_bytes = saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    loss, activation_bytes = saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss,
                                                    weights=lambda: _weights(model))
    loss.backward()
    optimizer.zero_grad(set_to_none=False)
    state_bytes = sum(_local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0)
                      for p in model.parameters())  # value + grad
    state_bytes += sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
    record = {
        "rank": rank,
        "dp_rank": dp_rank,
        "step_s": times,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "peak_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else memory()["peak_rss"]
        ),
        "rss_anon_bytes": memory()["rss_anon"],
        "rss_after_load_bytes": after_load["rss"],
        "state_bytes": state_bytes,
        "saved_bytes": saved_bytes,
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


def _launch(row: Row, folder: Path, args: argparse.Namespace, result: Path) -> dict[str, Any]:
    worker = [
        os.fspath(Path(__file__).resolve()),
        "--worker",
        os.fspath(folder),
        str(args.batch),
        str(args.seq),
        str(args.steps),
        os.fspath(result),
        json.dumps(asdict(row)),
    ]
    launch(row.ranks, worker, label=row.name)
    return json.loads(result.read_text())


def _summary(row: Row, run: dict[str, Any], tokens: int) -> dict[str, Any]:
    """A row of the result: its configuration, step time, and memory per rank. ``tokens`` is one
    replica's batch x seq; the group processes ``dp`` times that per step."""
    ranks = run["ranks"]
    step_ms = stats([1000 * t for r in ranks for t in r["step_s"]])
    step = step_ms["median"] / 1000
    return {
        **asdict(row),
        "ranks": row.ranks,
        "step_ms_stats": {k: v for k, v in step_ms.items() if k != "all"},
        "tokens_per_s": row.dp * tokens / step,
        "step_ms": 1000 * step,
        "warmup_s": max(r["warmup_s"] for r in ranks),
        "load_s": max(r["load_s"] for r in ranks),
        "threads_per_rank": ranks[0]["threads"],
        "activation_bytes_max": max(r["activation_bytes"] for r in ranks),
        "saved_bytes_max": max(r["saved_bytes"] for r in ranks),
        "state_bytes_max": max(r["state_bytes"] for r in ranks),
        "per_rank": [
            {
                k: r[k]
                for k in (
                    "rank",
                    "dp_rank",
                    "peak_bytes",
                    "rss_anon_bytes",
                    "rss_after_load_bytes",
                    "state_bytes",
                    "saved_bytes",
                    "activation_bytes",
                )
            }
            for r in ranks
        ],
    }


def _rows(args: argparse.Namespace) -> list[Row]:
    """The launches the flags ask for, in order: every tp (and its ``+sp`` twin), then the mesh's
    rows, each followed by its ``+ckpt`` twin under ``--checkpointing``."""
    plain = []
    for tp in (int(t) for t in args.tp.split(",") if t):
        plain.append(Row(tp))
        if args.sequence_parallel and tp > 1:
            plain.append(Row(tp, sequence_parallel=True))
    if args.mesh:
        dp, tp = args.mesh
        plain += [Row(tp, dp=dp, data_parallel=kind) for kind in args.data_parallel.split(",")]
    checkpointed = (False, True) if args.checkpointing else (False,)
    return [Row(**{**asdict(r), "checkpointing": c}) for r in plain for c in checkpointed]


def _mesh_shape(text: str) -> tuple[int, int]:
    """``--mesh``'s ``DPxTP`` (e.g. ``2x2``) as ``(dp, tp)``."""
    try:
        dp, tp = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes DPxTP, e.g. 2x2 (2 replicas x 2-way tp), not {text!r}") from None
    return dp, tp


def _ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's activation and state bytes per rank (its largest rank) over one process's (row
    ``"1"``, without checkpointing): 1.0 is no saving, 0.5 half. Absent without that row."""
    base = rows.get("1")
    for summary in rows.values():
        if base is None or "error" in summary:
            continue
        for key in ("activation_bytes", "saved_bytes", "state_bytes"):
            summary[f"{key}_ratio_to_one_process"] = summary[f"{key}_max"] / base[f"{key}_max"]


def _table(rows: dict[str, dict[str, Any]]) -> str:
    """The rows as a plain-text table, MB = 1e6 bytes, memory of each row's largest rank; "/1" is
    the ratio to one process's."""
    head = f"{'row':<16}{'ranks':>6}{'act MB':>9}{'act/1':>7}{'saved MB':>10}{'state MB':>10}{'state/1':>8}" \
           f"{'peak MB':>9}{'anon MB':>9}{'step ms':>9}{'spread':>8}"
    lines = [head]
    for name, s in rows.items():
        if "error" in s:
            lines.append(f"{name:<16}failed: {s['error'].strip().splitlines()[-1][:100]}")
            continue
        per = s["per_rank"]
        ratio = {k: s.get(f"{k}_bytes_ratio_to_one_process") for k in ("activation", "state")}
        lines.append(
            f"{name:<16}{s['ranks']:>6}{s['activation_bytes_max'] / 1e6:>9.1f}"
            + (f"{ratio['activation']:>7.2f}" if ratio["activation"] is not None else f"{'-':>7}")
            + f"{s['saved_bytes_max'] / 1e6:>10.1f}{s['state_bytes_max'] / 1e6:>10.1f}"
            + (f"{ratio['state']:>8.2f}" if ratio["state"] is not None else f"{'-':>8}")
            + f"{max(r['peak_bytes'] for r in per) / 1e6:>9.0f}{max(r['rss_anon_bytes'] for r in per) / 1e6:>9.0f}"
            + f"{s['step_ms']:>9.1f}{s['step_ms_stats']['spread']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--worker",
        nargs=6,
        metavar=("FOLDER", "BATCH", "SEQ", "STEPS", "RESULT", "ROW"),
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
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tp sizes (one process per rank, no mesh)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (per dp replica on a mesh)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per launch")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="also run every tp > 1 (not the mesh rows) with sequence_parallel=True (reported as '<tp>+sp')",
    )
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="also run every row with model.gradient_checkpointing_enable() (reported as '<row>+ckpt')",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        type=_mesh_shape,
        metavar="DPxTP",
        help="also run a dp x tp DeviceMesh (e.g. 2x2: 4 ranks) once per --data-parallel engine",
    )
    parser.add_argument(
        "--data-parallel",
        default="fsdp,ddp",
        help="comma-separated data-parallel engines of the --mesh rows (fsdp, ddp)",
    )
    parser.add_argument("--out", default="training.json")
    args = parser.parse_args(argv)
    if args.worker:
        folder, batch, seq, steps, result, row = args.worker
        _worker(folder, int(batch), int(seq), int(steps), result, Row(**json.loads(row)))
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
        "rows": {},
    }
    rows = report["rows"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(_rows(args)):
            try:
                run = _launch(row, folder, args, Path(tmp) / f"row{i}.json")
            except RuntimeError as err:  # recorded, and the other rows still run
                rows[row.name] = {**asdict(row), "ranks": row.ranks, "error": str(err)[-4000:]}
                print(json.dumps({"row": row.name, "error": str(err)[-2000:]}), flush=True)
                continue
            rows[row.name] = _summary(row, run, args.batch * args.seq)
            print(json.dumps({"row": row.name, **rows[row.name]}), flush=True)
    _ratios(rows)
    print(_table(rows))
    write_result(args.out, report, provenance)
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
