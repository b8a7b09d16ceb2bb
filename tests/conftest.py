"""Suite-wide settings.

The plan cache (``autotp/plan_cache.py``) defaults to ``~/.cache/autotp``; the suite points
``AUTOTP_CACHE_DIR`` at a temporary folder made for this session (and removed after it), so
neither CI nor a developer's run writes plans into the user's cache, and no test reuses a plan a
previous session left. Spawned ranks inherit the variable. Tests that exercise the cache set their
own folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_CACHE_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    folder = tempfile.mkdtemp(prefix="autotp-test-plans-")
    config.stash[_CACHE_DIR] = folder
    os.environ["AUTOTP_CACHE_DIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_CACHE_DIR, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
