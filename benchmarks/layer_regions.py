"""Layer regions off and on: a cold launch at tp=2 of real-width models whose layers meet their
region in other ways than the startup benchmark's Llama (``autotp/regions.py``).

    python benchmarks/layer_regions.py --rounds 3 --out benchmarks/results/layer_regions_tp2_fp32.json

Each launch is ``benchmarks/startup.py``'s ``autotp_cold`` worker (import, ``parallelize_model`` with
an empty plan cache, a greedy 16-token ``generate`` from 16 tokens, exit) under torch's elastic
launcher on ``--tp`` ranks, with ``AUTOTP_LAYER_REGIONS=0`` or ``1``; the two alternate, round by
round, per model (``benchmarks/_checkpoint.py: MODELS``): GPT-2 124M's own config (its blocks take
the KV cache by position) and the startup benchmark's widths as a Mistral with Mistral-7B-v0.1's
sliding window of 4096. Ranks trace their own frames (``AUTOTP_TRACE_ONCE=0``, the default at tp=2
on this 2-core machine). Reported per model and setting: the launch's wall seconds (the parent's
clock, process start to exit), rank 0's ``load_s``, ``generate_s`` and CPU seconds, their medians,
and whether both settings gave the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _checkpoint import MODELS, make_model_checkpoint  # noqa: E402
from _record import Provenance, launch, stats, write_result  # noqa: E402

STARTUP = os.fspath(Path(__file__).resolve().parent / "startup.py")
SETTINGS = ("off", "on")


def _launch(folder: Path, tp: int, regions: str) -> dict[str, Any]:
    """One cold launch with layer regions ``regions`` ("off"/"on"): the parent's wall seconds and
    rank 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        env = dict(os.environ, AUTOTP_CACHE_DIR=os.path.join(tmp, "cache"), AUTOTP_TRACE_ONCE="0",
                   AUTOTP_LAYER_REGIONS="1" if regions == "on" else "0")
        wall = launch(tp, [STARTUP, "--worker", "autotp_cold", os.fspath(folder), os.fspath(result), "float32", "0"],
                      env=env, label=f"{folder.name} regions {regions}")
        report = json.loads(result.read_text())
    return {"wall_s": wall, "load_s": report["load_s"], "generate_s": report["generate_s"],
            "cpu_s": report["cpu_s"], "tokens": report["tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "autotp-bench"),
                        help="folder for the checkpoints (written once)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternating off/on launches per model")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default="layer_regions.json")
    args = parser.parse_args(argv)
    provenance = Provenance.start(argv)
    models: dict[str, Any] = {}
    for name in args.models.split(","):
        family, fields = MODELS[name]
        folder = make_model_checkpoint(args.cache, f"{name}-float32-seed0", family, fields)
        runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in SETTINGS}
        for i in range(args.rounds):
            for setting in SETTINGS:
                run = _launch(folder, args.tp, setting)
                runs[setting].append(run)
                print(f"{name} round {i} regions {setting}: {run['wall_s']:.1f} s (load {run['load_s']:.1f}, "
                      f"generate {run['generate_s']:.1f}, rank 0 CPU {run['cpu_s']:.1f})", flush=True)
        summary = {setting: {key: stats([r[key] for r in rs]) for key in ("wall_s", "load_s", "generate_s", "cpu_s")}
                   for setting, rs in runs.items()}
        tokens = {tuple(r["tokens"]) for rs in runs.values() for r in rs}
        models[name] = {"family": family, "fields": fields, "runs": runs, "summary": summary,
                        "same_tokens": len(tokens) == 1,
                        "wall_ratio_on_off": summary["on"]["wall_s"]["median"] / summary["off"]["wall_s"]["median"]}
        print(f"{name}: wall {summary['off']['wall_s']['median']:.1f} s off, {summary['on']['wall_s']['median']:.1f} s "
              f"on; same tokens {len(tokens) == 1}", flush=True)
    write_result(args.out, {"tp": args.tp, "rounds": args.rounds, "models": models}, provenance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
