"""Suite-wide settings.

The plan cache (``autotp/plan_cache.py``) defaults to ``~/.cache/autotp``; the suite points
``AUTOTP_CACHE_DIR`` at a temporary folder made for this session (and removed after it), so
neither CI nor a developer's run writes plans into the user's cache, and no test reuses a plan a
previous session left. Spawned ranks inherit the variable, and so do pytest-xdist's workers (the
controller makes the folder before it starts them, and removes it after they are done): identical
graphs compiled by tests on different workers are solved once. Tests that exercise the cache set
their own folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller's folder is in its environment
        return
    folder = tempfile.mkdtemp(prefix="autotp-test-plans-")
    config.stash[_CACHE_DIR] = folder
    os.environ["AUTOTP_CACHE_DIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
