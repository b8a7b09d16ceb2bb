"""What importing ``parallelize_model`` loads: a warm launch (every graph a plan-cache hit with
stored graphs) never solves, so the solver's certificate (``autotp/passes/ilp.py``: scipy's HiGHS),
the planner, training and data-parallel code and plotting stay unimported until used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: modules only a solve, the planner, training, data parallelism or a plot needs
NOT_AT_IMPORT = ("scipy", "networkx", "matplotlib", "autotp.passes.ilp", "autotp.passes.bound", "autotp.planner",
                 "autotp.training", "autotp.data_parallel", "autotp.plan_report")


def test_importing_parallelize_model_loads_no_solver_planner_or_plotting_module() -> None:
    script = ("import sys; from autotp import parallelize_model; "
              f"print('loaded:', sorted(m for m in {NOT_AT_IMPORT!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)

    assert run.returncode == 0, run.stderr
    assert "loaded: []" in run.stdout, run.stdout
