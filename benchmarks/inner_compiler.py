"""Eager vs inductor inner compiler, interleaved in one process (one rank, no process group).

    python benchmarks/inner_compiler.py [--dtype bfloat16] [--size small]

Loads the benchmark checkpoint twice with ``parallelize_model`` (``compile_inner="eager"`` and
``"inductor"``, both fused) and alternates the two models call by call: a prefill of 1 x P tokens
into an empty ``DynamicCache``, then D greedy decode steps, each step timed, ``--reps`` times.
Interleaving in one process puts both under the same machine load at the same moment, which a
shared machine needs (launch-level alternation, ``benchmarks/generation.py``, drifts with the other
jobs' load). The first repetition's prefill and the first 4 decode steps are warm-up (compiles).
Writes JSON: medians with min, max and spread, the ratios inductor/eager, whether the greedy tokens
agree, and the run's provenance (``benchmarks/_record.py``: commit, command, versions, machine, load
averages). Measures compute only (no collectives: tp=1).
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

from _record import Provenance, checkpoint_name, stats, write_result  # noqa: E402

COMPILERS = ("eager", "inductor")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "autotp-bench"))
    parser.add_argument("--size", default="150m", choices=("150m", "small"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="inner_compiler.json")
    args = parser.parse_args(argv)

    provenance = Provenance.start(argv)
    import torch
    from _checkpoint import make_checkpoint
    from transformers import DynamicCache

    from autotp import parallelize_model
    from autotp.kv_cache import cache_keyword, returned_cache

    dtype = getattr(torch, args.dtype)
    folder = make_checkpoint(args.cache, dtype, size=args.size)
    models = {
        c: parallelize_model(os.fspath(folder), compile_inner=c, dtype=dtype, progress=False)
        for c in COMPILERS
    }
    vocab = models["eager"].config.vocab_size
    keyword = cache_keyword(type(models["eager"]).forward)  # "cache" from transformers 5.24
    P = args.prefill
    ids = (torch.arange(P) * 7919 % (vocab - 1) + 1).unsqueeze(0)  # (1, P)
    prefill: dict[str, list[float]] = {c: [] for c in COMPILERS}
    decode: dict[str, list[float]] = {c: [] for c in COMPILERS}
    tokens: dict[str, list[int]] = {c: [] for c in COMPILERS}
    with torch.no_grad():
        for rep in range(args.reps):
            state: dict[str, Any] = {}
            for c, m in models.items():
                start = time.perf_counter()
                out = m(input_ids=ids, use_cache=True, **{keyword: DynamicCache(config=m.config)})
                if rep > 0:
                    prefill[c].append(time.perf_counter() - start)
                state[c] = (returned_cache(out), out.logits[:, -1:].argmax(-1))
            for i in range(args.decode):
                for c, m in models.items():
                    cache, token = state[c]
                    start = time.perf_counter()
                    out = m(
                        input_ids=token,
                        use_cache=True,
                        position_ids=torch.tensor([[P + i]]),
                        **{keyword: cache},
                    )
                    if rep > 0 or i >= 4:
                        decode[c].append(time.perf_counter() - start)
                    state[c] = (returned_cache(out), out.logits[:, -1:].argmax(-1))
                    if rep == args.reps - 1:
                        tokens[c].append(int(state[c][1]))
    summary = {
        c: {
            "prefill_ms": 1000 * statistics.median(prefill[c]) if prefill[c] else None,
            "decode_ms_per_token": 1000 * statistics.median(decode[c]),
            "prefill_ms_stats": stats([1000 * t for t in prefill[c]]) if prefill[c] else None,
            "decode_ms_per_token_stats": stats([1000 * t for t in decode[c]]),
            "samples": {"prefill": len(prefill[c]), "decode_steps": len(decode[c])},
        }
        for c in COMPILERS
    }
    report = {
        "checkpoint": checkpoint_name(folder),
        "size": args.size,
        "dtype": args.dtype,
        "tp": 1,
        "prefill": P,
        "threads": torch.get_num_threads(),
        "compilers": summary,
        "ratios": {
            f"inductor/eager:{k}": summary["inductor"][k] / summary["eager"][k]
            for k in ("prefill_ms", "decode_ms_per_token")
            if summary["eager"][k]
        },
        "same_greedy_tokens": tokens["eager"] == tokens["inductor"],
    }
    report = write_result(args.out, report, provenance)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
