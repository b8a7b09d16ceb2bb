"""What importing ``parallelize_model`` loads: a warm launch (every graph a plan-cache hit with
stored graphs) never solves, so the solver's certificate (``autotp/passes/ilp.py``: scipy's HiGHS),
the planner, training and data-parallel code and plotting stay unimported until used; and wrapping a
forward for Dynamo (what a warm launch does before its stored frames run) loads no minifier chain."""

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


#: what ``torch._dynamo.optimize``'s minifier wrapper (``repro.after_dynamo``) imports: a warm launch compiles nothing
NOT_AT_OPTIMIZE = ("torch._dynamo.repro.after_dynamo", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
                   "networkx")


def _loaded_after(script: str, watched: tuple[str, ...]) -> subprocess.CompletedProcess:
    script += f"; import sys; print('loaded:', sorted(m for m in {watched!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_wrapping_a_forward_in_a_dynamo_package_loads_no_minifier_chain() -> None:
    run = _loaded_after("import torch; from autotp.compat import DynamoPackage, DynamoCompiled; "
                        "m = torch.nn.Linear(2, 2); DynamoPackage(m.forward, lambda gm, _: gm.forward); "
                        "DynamoCompiled(m.forward, lambda gm, _: gm.forward)", NOT_AT_OPTIMIZE)

    assert run.returncode == 0, run.stderr
    assert "loaded: []" in run.stdout, run.stdout
