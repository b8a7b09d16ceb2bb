"""Every table in the README, regenerated from the result files (no number is typed by hand).

    python -m benchmarks.tables            # print the tables
    python -m benchmarks.tables --write    # rewrite the marked regions of README.md

Two regions: ``<!-- coverage:begin/end -->`` (the architecture matrix, from
``benchmarks/coverage.jsonl`` through :func:`benchmarks.coverage.table`) and
``<!-- performance:begin/end -->`` (one row per measurement, each naming the file in
``benchmarks/results/`` it reads; :data:`PERFORMANCE` lists them). A result file made before the
shared provenance record (``benchmarks/_record.py``) is read all the same; its row's spread and
first-token cells are then empty.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS = ("autotp", 'transformers `tp_plan="auto"`', "one process, eager", "one process, `torch.compile`")
#: generation.py engine -> column
GENERATION_ENGINES = ("autotp", "transformers_tp", "one_process", "one_process_compiled")
Row = tuple[str, list[str]]


def _ms(summary: dict[str, Any], metric: str) -> str:
    """``513 ms`` or, where the run kept every sample, ``513 ms (505-520)`` (min-max)."""
    value = summary.get(metric)
    if value is None:
        return "-"
    spread = summary.get(f"{metric}_stats")
    if spread:
        return f"{value:.1f} ms ({spread['min']:.1f}-{spread['max']:.1f})"
    return f"{value:.1f} ms"


def _seconds(value: float) -> str:
    return f"{1000 * value:.0f} ms" if value < 1 else f"{value:.1f} s"


def generation_rows(result: dict[str, Any]) -> list[Row]:
    engines = result["engines"]
    setup = f"tp={result['tp']}, {result['dtype']}"
    gpu = {s.get("device") for s in engines.values()} - {None, "cpu"}
    if gpu:  # a --device cuda run: its GPU's name, from each engine's launches
        setup += ", " + " / ".join(sorted(gpu))

    def cells(fmt: Callable[[dict[str, Any]], str]) -> list[str]:
        return [fmt(engines[e]) if e in engines else "-" for e in GENERATION_ENGINES]

    rows: list[Row] = [
        (f"prefill 1x{result['prefill']} tokens, {setup}", cells(lambda s: _ms(s, "prefill_ms"))),
        (f"decode, per token, {setup}", cells(lambda s: _ms(s, "decode_ms_per_token"))),
    ]
    if any("first_token_s" in s for s in engines.values()):
        rows.append(
            (
                f"first token after load (compilation included), {setup}",
                cells(lambda s: _seconds(s["first_token_s"]) if "first_token_s" in s else "-"),
            )
        )
    if any("peak_rss_bytes" in s for s in engines.values()):
        rows.append(
            (
                f"peak RSS / anonymous memory per rank, {setup}",
                cells(
                    lambda s: (
                        f"{s['peak_rss_bytes'] / 2**20:.0f} / {s['rss_anon_bytes'] / 2**20:.0f} MiB"
                        if "peak_rss_bytes" in s
                        else "-"
                    )
                ),
            )
        )
    return rows


def load_memory_rows(result: dict[str, Any]) -> list[Row]:
    summaries = {line["library"]: line for line in result["lines"] if line.get("summary")}
    by_column = {"autotp": "autotp", "transformers": 'transformers `tp_plan="auto"`'}
    cells = ["-"] * len(COLUMNS)
    for library, line in summaries.items():
        cells[COLUMNS.index(by_column[library])] = f"{line['max_ratio_above_baseline']:.2f}x"
    return [
        (
            f"peak memory per rank, load + first forward, above the import baseline, in checkpoint bytes, "
            f"tp={result['tp']}, {result['dtype']}",
            cells,
        )
    ]


def solver_scaling_rows(result: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    cache = {None: "", "empty": ", empty cache", "cached": ", again (report cache)"}
    for point in result["points"]:
        if point.get("shape") == "llama3-70b" and "error" not in point and not point.get("full_depth"):
            rows.append(
                (
                    f"`autotp plan` of the Llama-3-70B shape ({point['layers']} layers), tp={point['tp']}, "
                    f"whole command{cache.get(point.get('plan_cache'), '')}",
                    [f"{point['command_wall_s']:.1f} s", "-", "-", "-"],
                )
            )
    return rows


def startup_rows(result: dict[str, Any]) -> list[Row]:
    """The whole job as a user waits for it (``benchmarks/startup.py``): autotp with an empty plan
    cache and with the cache the previous job left, in one cell."""
    engines = result["engines"]

    def wall(name: str) -> str:
        return f"{engines[name]['wall_s']['median']:.1f} s" if name in engines else "-"

    autotp = f"{wall('autotp_cold')} (empty plan cache) / {wall('autotp_warm')} (warm)"
    return [
        (
            f"whole job: start, load, greedy-generate 16 tokens, exit, tp={result['tp']}, {result['dtype']}",
            [autotp, wall("transformers_tp"), wall("one_process"), "-"],
        )
    ]


#: result file -> its rows, in README order
PERFORMANCE: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "generation_tp2_fp32.json": generation_rows,
    "generation_tp2_bf16.json": generation_rows,
    "generation_tp1_cuda_fp32.json": generation_rows,
    "startup_tp2_fp32.json": startup_rows,
    "load_memory_tp2_fp32.json": load_memory_rows,
    "solver_scaling.json": solver_scaling_rows,
}


def _load_average(result: dict[str, Any]) -> str:
    """The 1-minute load average at the start and the end, from either record format."""
    load = result.get("provenance", {}).get("machine", {}).get("load_average") or result.get("load_average")
    if not load:
        return "not recorded"
    return f"{load['start'][0]:.1f} / {load['end'][0]:.1f}"


def performance_table(results: Path = RESULTS) -> str:
    lines = [
        "| measurement | " + " | ".join(COLUMNS) + " | load at start / end | result file |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    for name, rows_of in PERFORMANCE.items():
        result = json.loads((results / name).read_text())
        for label, cells in rows_of(result):
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_load_average(result)} | `{name}` |")
    return "\n".join(lines)


def coverage_table() -> str:
    from benchmarks import coverage

    return coverage.table(coverage.read_rows(ROOT / "benchmarks" / "coverage.jsonl"))


def replace_region(text: str, name: str, body: str) -> str:
    """``text`` with what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no {begin} ... {end} region in the README")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite the marked regions of the README")
    parser.add_argument("--readme", default=ROOT / "README.md", type=Path)
    args = parser.parse_args(argv)
    tables = {"coverage": coverage_table(), "performance": performance_table()}
    if not args.write:
        print("\n\n".join(tables.values()))
        return 0
    text = args.readme.read_text()
    for name, body in tables.items():
        text = replace_region(text, name, body)
    args.readme.write_text(text)
    print(f"rewrote {', '.join(tables)} in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
