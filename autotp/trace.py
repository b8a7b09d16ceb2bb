"""Solver traces: one folder per compiled graph and rank, so a plan can be read and trusted.

Contents: ``dynamo_graph.py`` (what Dynamo gave us), ``aten_graph.py`` (the bracketed shadow
graph), ``decisions.jsonl`` (each ATen op: owner Dynamo node, input placements, the chosen output,
every candidate the rule offered, the local rewrite, notes such as "no rule: replicated"),
``backtracks.json`` (partial plans abandoned and why), ``summary.json`` (cost, states, pruning,
reused nodes, unknown ops, timings, ``uneven_shards``: each parameter split unevenly, e.g.
``"dim 0 of 50257 over tp=2: rows 25129/25128"``), ``rewritten_graph.py`` (this rank's program; an
uneven gather's ``Redistribute`` says ``uneven 50257 (25129/25128)``) and ``plan.json`` (the same
notes under ``uneven``).

The solver's files (``aten_graph.py``, ``decisions.jsonl``, ``backtracks.json``) are written by
the rank that solved: rank 0 where it plans for the group (``backend._plans_once``); the other
ranks' ``summary.json`` then says ``"plan_from": "rank 0"``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


def graph_folder(trace_dir: Path, rank: int, graph_id: int) -> Path:
    folder = Path(trace_dir) / f"rank{rank}" / f"graph{graph_id:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_text(folder: Path, name: str, text: str) -> None:
    (folder / name).write_text(text)


def write_json(folder: Path, name: str, obj: Any) -> None:
    (folder / name).write_text(json.dumps(obj, indent=1, default=str) + "\n")


def write_solver_trace(folder: Path, trace: Any, extra: dict[str, Any]) -> None:
    with open(folder / "decisions.jsonl", "w") as f:
        for d in trace.decisions:
            f.write(json.dumps(dataclasses.asdict(d), default=str) + "\n")
    write_json(folder, "backtracks.json", {"count": trace.backtrack_count, "events": trace.backtracks})
    summary = {
        "pruned_states": trace.pruned_states,
        "max_states": trace.max_states,
        "reused_nodes": trace.reused_nodes,
        "beam_widened_to": trace.widened_to,
        "unknown_ops_replicated": trace.unknown_ops,
        "solve_seconds": trace.seconds,
    }
    summary.update(extra)
    write_json(folder, "summary.json", summary)
