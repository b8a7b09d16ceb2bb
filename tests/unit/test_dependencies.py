"""pyproject.toml declares what autotp imports and nothing else (``scripts/check-deps``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_declared_dependencies_are_the_imported_ones() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check-deps")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dependencies match the imports" in proc.stdout
