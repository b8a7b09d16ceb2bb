"""First compile of a training step, plain vs sequence-parallel, at tp=2 (gloo, CPU).

    PYTHONPATH=$PWD python benchmarks/sp_compile.py --hidden 512 --layers 4 --out sp_compile.json

Each row starts fresh ranks (plan cache off: ``AUTOTP_CACHE=0``), loads a seeded Llama checkpoint with
``parallelize_model`` and times the first training step (forward with labels + backward), which
compiles the training graphs. Rank 0 plans each graph (``parallelize_model`` without ``timeout``);
its per-graph breakdown comes from the plan cache's records (decompose, each solve, annotate) and
Dynamo's own phase times (``torch._dynamo.utils.compile_times``). JSON out; no assert.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, world: int, folder: str, sequence_parallel: bool) -> dict[str, Any]:
    import torch

    import autotp.backend as backend
    from autotp import parallelize_model

    solves: list[dict[str, Any]] = []
    original = backend.solve

    def timed_solve(shadow: Any, opts: Any, fixed: Any, free: Any, param_nodes: Any) -> Any:
        t = time.perf_counter()
        out = original(shadow, opts, fixed, free, param_nodes)
        solves.append({"free_params": len(free), "pinned": len(fixed), "aten_nodes": len(shadow.aten.graph.nodes),
                       "activation_weight": opts.activation_weight, "seconds": time.perf_counter() - t,
                       "cost": out.cost, "pruned_states": out.trace.pruned_states,
                       "reused_nodes": out.trace.reused_nodes})
        return out

    backend.solve = timed_solve
    decompositions: list[float] = []
    original_decompose = backend.decompose

    def timed_decompose(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = original_decompose(*a, **k)
        decompositions.append(time.perf_counter() - t)
        return out

    backend.decompose = timed_decompose
    t = time.perf_counter()
    model = parallelize_model(folder, tp_size=world, sequence_parallel=sequence_parallel, progress=False)
    load_s = time.perf_counter() - t
    model.train()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    n_load = len(solves)
    torch._dynamo.utils.compile_times()  # noqa: B018
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    step_s = time.perf_counter() - t
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    second_s = time.perf_counter() - t
    outcomes = [getattr(o, "__dict__", repr(o)) for o in model.autotp.context.plan_cache.outcomes]
    return {"load_s": load_s, "first_step_s": step_s, "second_step_s": second_s, "solves_load": solves[:n_load],
            "solves_step": solves[n_load:], "decompose_s": decompositions, "dynamo": torch._dynamo.utils.compile_times(repr="str"),
            "plan_cache": outcomes}


def main(argv: list[str] | None = None) -> int:
    from tests._dist import run_ranks
    from tests._tiny import save_tiny

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", default="plain,sp,plain,sp", help="rows in order (alternate them: the machine's load drifts)")
    parser.add_argument("--out", default="sp_compile.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))
    from _record import Provenance, write_result

    provenance = Provenance.start(argv)
    os.environ["AUTOTP_CACHE"] = "0"  # a first compile: no plan cache (the ranks inherit it)
    config = dict(hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256)
    out: dict[str, Any] = {"config": config, "tp": 2, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny("llama", Path(tmp) / "ckpt", seed=0, **config)
        for row in args.rows.split(","):
            t = time.perf_counter()
            ranks = run_ranks(_rank, 2, str(folder), row == "sp", timeout=3000)
            out["rows"].append({"row": row, "wall_s": time.perf_counter() - t, "ranks": ranks})
            r0 = ranks[0]
            print(row, f"load {r0['load_s']:.1f}s first step {r0['first_step_s']:.1f}s "
                  f"second {r0['second_step_s']:.2f}s", [(s["free_params"], round(s["seconds"], 2))
                                                         for s in r0["solves_step"]], flush=True)
    for row in dict.fromkeys(args.rows.split(",")):
        steps = sorted(r["ranks"][0]["first_step_s"] for r in out["rows"] if r["row"] == row)
        out.setdefault("median_first_step_s", {})[row] = statistics.median(steps)
    print("median first step", out["median_first_step_s"], flush=True)
    write_result(args.out, json.loads(json.dumps(out, default=str)), provenance)  # rank results as plain JSON
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
