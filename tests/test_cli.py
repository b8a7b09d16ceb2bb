"""The ``autotp`` command line: the demo end to end, and bad input reported without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotp.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "autotp", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_tp2_tokens_identical_to_one_process(tmp_path: Path) -> None:
    # Two gloo ranks through torch's elastic launcher; greedy tokens must match one process exactly
    # (the demo model's top-2 logit gaps are far above fp32 reordering noise).
    proc = _run("demo", "--tp", "2", "--new-tokens", "4", "--workdir", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens identical to one process: yes" in proc.stdout, proc.stdout
    assert "all 2 ranks produced the same tokens: yes" in proc.stdout
    assert "collectives per forward:" in proc.stdout and "parameter bytes per rank:" in proc.stdout
    assert (tmp_path / "checkpoint" / "model.safetensors").exists()


def test_bad_tp_exits_2_with_a_readable_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--tp", "0"]) == 2
    err = capsys.readouterr().err
    assert "autotp: error: --tp must be a positive integer, got 0" in err
    assert "Traceback" not in err


def test_tp_that_does_not_divide_the_model_exits_2_before_launching(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    # 8 heads / 4 kv heads: tp=3 is refused from the config alone, before a checkpoint is written.
    assert main(["demo", "--tp", "3", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "tp_size=3 does not divide" in err and "Valid tp sizes for this model: [1, 2, 4]" in err
    assert "Traceback" not in err
    assert not (tmp_path / "checkpoint").exists()


def test_bad_prompt_ids_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", str(tmp_path), "--tp", "1", "--prompt-ids", "1,two,3"]) == 2
    assert "--prompt-ids must be comma-separated integers" in capsys.readouterr().err


def test_missing_checkpoint_folder_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", str(tmp_path / "nope"), "--tp", "1", "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: ") and "Traceback" not in err


def test_python_dash_m_autotp_reports_errors_without_traceback() -> None:
    proc = _run("demo", "--tp", "0", timeout=300)
    assert proc.returncode == 2
    assert "autotp: error: --tp must be a positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_usage_errors_and_help() -> None:
    assert main([]) == 2  # a subcommand is required; argparse prints the usage
    assert main(["--help"]) == 0
