"""Where autotp's caches live and the versions their entries are keyed on, without importing torch.

The plan cache (``autotp/plan_cache.py``), ``autotp plan``'s report cache
(``autotp/report_cache.py``) and the stored graphs (``autotp/stored_graphs.py``) share these facts
and :func:`write_atomic`. They are computed from the environment, the
installed packages' metadata (``importlib.metadata``) and autotp's own source files, never by
importing torch or transformers: ``autotp plan`` serves a report-cache hit before either loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["cache_dir_from", "package_version", "source_digest", "versions", "write_atomic"]

_OFF = ("0", "false", "off", "no")


def cache_dir_from(env: Mapping[str, str]) -> Path | None:
    """The cache location the environment asks for; None when ``AUTOTP_CACHE`` turns it off."""
    if env.get("AUTOTP_CACHE", "1").strip().lower() in _OFF:
        return None
    if env.get("AUTOTP_CACHE_DIR"):
        return Path(env["AUTOTP_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "autotp"
    return Path("~/.cache/autotp").expanduser()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary file in its folder, then ``os.replace``:
    a reader sees the old entry or the new one, never part of one, and concurrent writers of one
    entry both succeed. Raises ``OSError`` (with the temporary file removed) where it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def source_digest() -> str:
    """SHA-256 over autotp's own ``.py`` files (relative path and bytes, in path order): plans of
    an edited planner are never reused, whatever the version number says."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def package_version(dist_name: str) -> str | None:
    """The installed distribution's version from its metadata (no import); None if absent."""
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """autotp (version and source digest), torch, transformers and Python: what a cached plan was
    computed with."""
    return {"autotp": package_version("autotp"), "autotp_source": source_digest(),
            "torch": package_version("torch"), "transformers": package_version("transformers"),
            "python": sys.version.split()[0]}
