"""Architecture coverage: run the matrix of tests/distributed/test_architectures.py and write the
README table (architecture, tp sizes, status, plan of one block, collectives per block).

    python benchmarks/coverage.py --out coverage.jsonl [--readme README.md] [--case gpt2 --case opt]
                                  [--no-per-block]
    python benchmarks/coverage.py --rows coverage.jsonl --readme README.md   # table from saved rows
    python benchmarks/coverage.py --update benchmarks/coverage.jsonl --case mixtral --readme README.md
    python benchmarks/coverage.py --update benchmarks/coverage.jsonl --blocks-only --readme README.md
    python benchmarks/coverage.py --update benchmarks/coverage.jsonl --widths-only --readme README.md

For every case and tp size: save the tiny checkpoint, run ``parallelize_model`` on N gloo ranks and
compare with one process (:func:`tests.distributed.test_architectures.run_case`, same tolerance as
the test). *Collectives per block* comes from the planner (``autotp.planner.plan_model``: the same
solve of the same warm-up forward, one process, simulated collectives), per block, read as
the architecture test reads it (``PlanReport.block_collectives``: per stack of blocks where there
are several, T5's encoder and decoder); architectures the meta
planner cannot trace say "not measured". *Plan* lists the matmul weights of layer 0 by style (``fused``: stored
strided, each rank holds its chunk of every segment). One JSON line per run goes to ``--out``, with the run's provenance (commit, date, command,
versions, machine: ``benchmarks/_record.py``);
``--update FILE`` replaces the rows of the cases run in FILE and keeps the others;
``--blocks-only`` recomputes only the per-block column of FILE's rows (of the ``--case`` ids, default
all), recording its provenance as ``columns_provenance``; ``--widths-only`` the
batch-2 column (the tiny model planned at batch 2, after the batch-1 warm-up, as a batch-2 call
after ``parallelize_model`` is) and the real-width column (the plan matrix of
``tests/unit/test_plans_at_real_widths.py``). The README section between
the ``coverage`` markers is replaced.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# for _record; appended, so no module of benchmarks/ shadows an installed one
sys.path.append(str(ROOT / "benchmarks"))

from _record import Provenance  # noqa: E402

from tests._tiny import ARCHS  # noqa: E402
from tests.distributed.test_architectures import (  # noqa: E402
    BY_ID,
    CASES,
    KNOWN_FAILURES,
    Case,
    run_case,
    save_case,
)

#: the first layer's weights: "<stack>.0.<rest>.weight", where no earlier name part is a number
BLOCK = re.compile(r"^((?:[A-Za-z_]\w*\.)+)0\.(.+)\.weight$")


def plan_summary(plan: dict[str, Any]) -> str:
    """``colwise: attn.c_attn (fused), mlp.c_fc; rowwise: ...; replicated: ...`` for layer 0."""
    by_style: dict[str, list[str]] = {}
    seen_stacks: set[str] = set()
    for fqn, entry in plan["parameters"].items():
        m = BLOCK.match(fqn)
        if not m or len(entry["global_shape"]) < 2:
            continue
        stack = m.group(1)
        if seen_stacks and stack not in seen_stacks and len(seen_stacks) >= 2:
            continue
        seen_stacks.add(stack)
        name = m.group(2) + (" (fused)" if "|" in entry["placement"] else "")
        by_style.setdefault(entry["style"], []).append(name)
    return "; ".join(f"{style}: {', '.join(sorted(set(names)))}" for style, names in sorted(by_style.items()))


def per_block(case: Case, world: int, folder: Path | Any, batch: int = 1) -> str:
    """Collectives of each block of a forward at ``batch`` (1: the warm-up), from the planner, per
    stack of blocks where a model has several (T5's encoder and decoder); ``folder``: the
    checkpoint folder or a config."""
    from autotp.planner import plan_model

    try:
        model = str(folder) if isinstance(folder, Path) else folder
        stacks = plan_model(model, world, batch=batch, decode=False).block_collectives()
    except Exception as e:  # noqa: BLE001 - a planner failure is a table cell
        return f"not measured (meta planner: {type(e).__name__})"
    cells = {stack: _blocks_text(blocks) for stack, blocks in stacks.items()}
    if len(cells) == 1:
        return next(iter(cells.values()))
    return "; ".join(f"{stack} ({text})" for stack, text in cells.items()) or "none"


def _blocks_text(blocks: dict[int, dict[str, int]]) -> str:
    """``2 all-reduce`` where every block issues the same, else each block's."""
    texts = {
        layer: ", ".join(f"{n} {k.replace('_', '-')}" for k, n in sorted(kinds.items()))
        for layer, kinds in blocks.items()
    }
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"block {layer}: {text}" for layer, text in texts.items()) or "none"


def real_widths(case: Case) -> str:
    """Collectives per block with a public model's widths (2 layers), at every tp in 2, 4, 8 its
    sizes divide (:mod:`tests.unit.test_plans_at_real_widths`)."""
    from tests.unit.test_plans_at_real_widths import REAL_WIDTHS, _config, _valid_tps

    if case.arch not in REAL_WIDTHS:
        return "not planned"
    cells = [f"tp {tp}: {per_block(case, tp, _config(case.arch))}" for tp in _valid_tps(case.arch)]
    return f"{REAL_WIDTHS[case.arch][0]}: " + ("; ".join(cells) or "no tp in 2, 4, 8 divides its sizes")


def add_widths(rows: list[dict[str, Any]], folder_of: Any, provenance: Provenance) -> None:
    """Fill the batch-2 and real-width columns of each case's first passing row, with their
    provenance (``columns_provenance``)."""
    done: set[str] = set()
    for row in rows:
        case = BY_ID[row["case"]]
        if row["case"] in done or row.get("status") != "pass" or case.path != "load":
            continue
        done.add(row["case"])
        row["batch2"] = per_block(case, row["tp"], folder_of(case), batch=2)
        row["real_widths"] = real_widths(case)
        row["columns_provenance"] = provenance.finish()
        print(row["case"], row["batch2"], "|", row["real_widths"], flush=True)


def run(cases: list[Case], out: Path, provenance: Provenance, measure_blocks: bool = True) -> list[dict[str, Any]]:
    """Run ``cases``; one row per (case, tp), each with the run's provenance (``_record``: commit,
    date, command, versions, machine)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name, out.open("w") as sink:
        tmp = Path(tmp_name)
        for case in cases:
            folder = save_case(case, tmp / case.id)
            for world in case.worlds:
                row: dict[str, Any] = {"case": case.id, "tp": world}
                try:
                    result = run_case(case, world, folder)
                    row.update(
                        status="pass",
                        seconds=round(result["seconds"], 1),
                        plan=plan_summary(result["plan"]),
                        collectives=result["plan"]["collectives"],
                    )
                    if measure_blocks and world == case.worlds[0]:
                        row["per_block"] = per_block(case, world, folder)
                except Exception as e:  # noqa: BLE001 - a failing architecture is a table row
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    row.update(
                        status="xfail" if case.id in KNOWN_FAILURES else "fail",
                        reason=KNOWN_FAILURES.get(case.id, last[:200]),
                    )
                    traceback.print_exc()
                row["provenance"] = provenance.finish()
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    by_case: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    lines = [
        "| architecture | entry point | tp: status | plan (layer 0) | collectives, whole 2-layer forward "
        "| collectives per block | per block, batch 2 | per block at real widths (2 layers) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case_id, runs in by_case.items():
        case = BY_ID[case_id]
        entry = "parallelize_model" if case.path == "load" else "torch.compile"
        tps = ", ".join(f"{r['tp']}: {r['status']}" for r in runs)
        first = runs[0]
        plan = first.get("plan") or first.get("reason", "")
        total = ", ".join(
            f"{n} {k.replace('_', '-')}" for k, n in sorted(first.get("collectives", {}).items())
        )
        lines.append(
            f"| {ARCHS[case.arch][1]} | {entry} | {tps} | {plan} | {total or '-'} | "
            f"{first.get('per_block', 'not measured')} | {first.get('batch2', 'not measured')} | "
            f"{first.get('real_widths', 'not measured')} |"
        )
    return "\n".join(lines)


def write_readme(readme: Path, rows: list[dict[str, Any]]) -> None:
    """Replace the README's ``coverage`` region with the table of ``rows``."""
    from benchmarks.tables import replace_region

    readme.write_text(replace_region(readme.read_text(), "coverage", table(rows)))


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("coverage.jsonl"))
    ap.add_argument("--readme", type=Path, default=None)
    ap.add_argument("--case", action="append", help="only these case ids (default: all)")
    ap.add_argument("--no-per-block", action="store_true", help="skip the planner's per-block counts")
    ap.add_argument("--rows", type=Path, help="write the table from saved JSON rows instead of running")
    ap.add_argument("--update", type=Path, help="rows file: replace the rows of the cases run, keep the rest")
    ap.add_argument(
        "--blocks-only", action="store_true", help="with --update: only recompute per-block counts"
    )
    ap.add_argument(
        "--widths-only",
        action="store_true",
        help="with --update: only recompute the batch-2 and real-width columns",
    )
    args = ap.parse_args()
    provenance = Provenance.start()
    if args.rows:
        rows = read_rows(args.rows)
    elif args.update and args.blocks_only:
        rows = read_rows(args.update)
        with tempfile.TemporaryDirectory() as tmp:
            for row in rows:
                case = BY_ID[row["case"]]
                if row["tp"] == case.worlds[0] and row.get("status") == "pass" and (not args.case or case.id in args.case):
                    row["per_block"] = per_block(case, row["tp"], save_case(case, Path(tmp) / case.id))
                    row["columns_provenance"] = provenance.finish()
                    print(row["case"], row["per_block"], flush=True)
        write_rows(args.update, rows)
    elif args.update and args.widths_only:
        rows = read_rows(args.update)
        with tempfile.TemporaryDirectory() as tmp:
            add_widths([r for r in rows if not args.case or r["case"] in args.case],
                       lambda case: save_case(case, Path(tmp) / case.id), provenance)
        write_rows(args.update, rows)
    else:
        cases = [c for c in CASES if not args.case or c.id in args.case]
        rows = run(cases, args.out, provenance, measure_blocks=not args.no_per_block)
        if args.update:
            fresh = {r["case"] for r in rows}
            kept = (
                [r for r in read_rows(args.update) if r["case"] not in fresh] if args.update.exists() else []
            )
            order = {c.id: i for i, c in enumerate(CASES)}
            rows = sorted(kept + rows, key=lambda r: (order.get(r["case"], len(order)), r["tp"]))
            write_rows(args.update, rows)
    if args.readme:
        write_readme(args.readme, rows)


if __name__ == "__main__":
    main()
