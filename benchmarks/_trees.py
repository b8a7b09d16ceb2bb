"""This tree against another revision, for the benchmarks that compare two (``--compare REV``:
``certificate_gap.py``, ``cold_plan.py``, ``solver_scaling.py``): the revision checked out in a
throwaway git worktree, each measurement a fresh process of the benchmark's own child mode with
``PYTHONPATH`` on the tree measured, and the trees alternating round by round, so that drift on a
shared machine hits both alike."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _record import ROOT


@contextlib.contextmanager
def compared_trees(rev: str | None, prefix: str) -> Iterator[dict[str, Path]]:
    """``{"this": ROOT}``, plus ``{rev: worktree}`` where ``rev`` is given; the worktree is removed
    after the block."""
    trees = {"this": ROOT}
    base = None
    if rev:
        base = Path(tempfile.mkdtemp(prefix=prefix)) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", os.fspath(base), rev], cwd=ROOT, check=True,
                       capture_output=True)
        trees[rev] = base
    try:
        yield trees
    finally:
        if base is not None:
            subprocess.run(["git", "worktree", "remove", "--force", os.fspath(base)], cwd=ROOT, capture_output=True)


def run_child(tree: Path, script: str, args: list[str], label: str | None = None) -> dict[str, Any]:
    """Run ``script args`` in a fresh process against ``tree``'s autotp; its last JSON line."""
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=tree,
                          env={**os.environ, "PYTHONPATH": os.fspath(tree)})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label or tree}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def alternate(trees: dict[str, Path], rounds: int, run: Callable[[str, Path], dict[str, Any]]
              ) -> dict[str, list[dict[str, Any]]]:
    """``run(name, tree)`` for every tree, ``rounds`` times, the trees alternating; each result is
    printed as a JSON line with its tree's name."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            runs[name].append(run(name, tree))
            print(json.dumps({"tree": name, **runs[name][-1]}), flush=True)
    return runs
