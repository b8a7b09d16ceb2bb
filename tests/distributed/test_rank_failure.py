"""A rank that hangs or dies while loading does not leave the others waiting: with
``parallelize_model(timeout=3)`` the survivors raise an AutoTPError that says another rank failed,
and the launcher exits non-zero. Ranks run under torch's elastic launcher (``torch.distributed.run
--standalone``: the agent hosts the rendezvous on a port the OS picks), on gloo, one thread each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests._tiny import save_tiny

REPO = Path(__file__).resolve().parents[2]

# Rank 1 misbehaves at its first checkpoint read (inside the warm-up), rank 0 carries on into the
# warm-up forward's first collective and must give up after the 3 s timeout (hang) or at once
# (a dead peer closes its connections).
_RANK = textwrap.dedent('''
    import os, sys, time
    import autotp.weights
    from autotp import AutoTPError, parallelize_model

    mode, folder = sys.argv[1], sys.argv[2]
    if os.environ["RANK"] == "1":
        def misbehave(*args, **kwargs):
            if mode == "hang":
                time.sleep(120)
            os._exit(3)
        autotp.weights.Checkpoint.read_slice = misbehave
    try:
        parallelize_model(folder, tp_size=2, timeout=3, progress=False)
    except AutoTPError as e:
        print(f"rank {os.environ['RANK']} AutoTPError: {e}", flush=True)
        sys.exit(2)
    print("loaded", flush=True)
''')


def _launch(mode: str, folder: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=0", "--tee=3", str(script), mode, str(folder)],
        env=env, capture_output=True, text=True, timeout=240)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("mode", ["hang", pytest.param("exit", marks=pytest.mark.slow)])
def test_a_rank_that_hangs_or_dies_while_loading_makes_the_run_fail_instead_of_hang(tmp_path, mode):
    folder = save_tiny("llama", tmp_path / "ck")
    proc, elapsed = _launch(mode, folder, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "loaded" not in proc.stdout
    assert elapsed < 120, out  # rank 1 sleeps 120 s in the hang case: rank 0 did not wait for it
    if mode == "hang":
        # rank 0 gave up after the 3 s timeout with an error that names rank 1 and where it stuck
        assert ("rank 0 AutoTPError: rank 0 of 2: rank 1 failed while the model was loading: rank 1 is alive "
                "but stuck in phase 'loading") in out, out


# `autotp generate` with a fault injected: the launcher's entry function is swapped (in the parent,
# before `main` runs) for one that, on rank 1 only, SIGKILLs its own process (or raises) at the
# start of the given forward call (call 1 is parallelize_model's warm-up, 2 generate's prefill, 3 the first decode
# step). The ranks (forked from the CLI's forkserver) import the swapped function from this module by name.
_KILLER = textwrap.dedent('''
    import os, signal
    import autotp.cli

    _real = autotp.cli._rank_generate


    def rank_generate(*args, **kwargs):
        if os.environ.get("RANK") == "1":
            import autotp.api
            call = autotp.api._SwappingForward.__call__
            seen = [0]

            def dying(self, *a, **k):
                seen[0] += 1
                if seen[0] == int(os.environ["KILL_AT_CALL"]):
                    if os.environ["KILL_MODE"] == "raise":
                        raise RuntimeError("injected failure on rank 1")
                    os.kill(os.getpid(), signal.SIGKILL)
                return call(self, *a, **k)

            autotp.api._SwappingForward.__call__ = dying
        return _real(*args, **kwargs)
''')

_GENERATE = textwrap.dedent('''
    import sys

    if __name__ == "__main__":  # not when a rank process imports this file
        import autotp.cli
        import killer
        autotp.cli._rank_generate = killer.rank_generate
        sys.exit(autotp.cli.main(sys.argv[1:]))
''')


@pytest.mark.parametrize("mode", ["kill", pytest.param("raise", marks=pytest.mark.slow)])
def test_a_rank_killed_while_generating_makes_autotp_generate_exit_nonzero_naming_it(tmp_path, mode):
    folder = save_tiny("llama", tmp_path / "ck")
    (tmp_path / "killer.py").write_text(_KILLER)
    (tmp_path / "generate.py").write_text(_GENERATE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CI": "1", "KILL_AT_CALL": "3", "KILL_MODE": mode,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(tmp_path / "generate.py"), "generate", str(folder), "--tp", "2",
                           "--prompt-ids", "1,2,3", "--max-new-tokens", "4"],
                          env=env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "generated ids" not in out
    # the parent names the rank the launcher saw die, and how
    how = "killed by signal SIGKILL" if mode == "kill" else "exit code 1"
    assert f"autotp: error: failed: rank 1 ({how})" in out, out
    # and the survivor names it with the phase it last reported: through its failed collective, or
    # (when the launcher's SIGTERM comes first) from its SIGTERM handler. A killed rank's call count
    # is the one its last heartbeat published (every 0.5 s), so it may lag behind the call it died in
    # (call 3 of this test: the warm-up, generate's prefill, the first decode step) by the calls of
    # its last half second; a raised error is published at once, with the exact call
    what = (r"rank 1 died in phase 'generate, forward call [123]'" if mode == "kill" else
            r"rank 1 raised in phase 'generate, forward call 2': RuntimeError: injected failure on rank 1")
    assert re.search(r"autotp: rank 0: (error: rank 0 of 2: rank 1 failed while the model was running: |"
                     r"stopped by the launcher because )" + what, out), out
    assert elapsed < 120, out  # no rank waited for a timeout (the default would be 10 minutes)
