"""``autotp plan``'s reports kept on disk: planning the same model again is one file read.

The per-graph plan cache (``autotp/plan_cache.py``) keys a Dynamo graph, so a hit still builds
the model and runs Dynamo's trace, the larger half of a plan; and the planner bypasses it anyway
(it re-solves from solver records). This cache keys the whole question instead: the config (as
``to_dict``), the model name, ``tp``, dtype, batch, sequence length, decode, every
:class:`~autotp.config.AutoTPConfig` field, ``full_depth``, and the versions the plan cache keys on
(its format, autotp's source digest, torch, transformers, Python). The value is the
:class:`~autotp.planner.PlanReport` without its solver record (``PlanReport.to_state``).

Not cached: plans with ``explain_names`` (an explanation re-solves from the record) and a folder
holding weights (they are checked against the config on every plan). Same location, switch and
trust rules as the plan cache (``AUTOTP_CACHE_DIR`` / ``AUTOTP_CACHE=0``; entries in
``<cache dir>/reports/<sha256 of the key>.json`` carry their key and a checksum, anything that does
not match is a miss, writes are atomic); a folder that cannot be written is skipped silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from autotp.plan_cache import cache_dir_from, versions

FORMAT = 1


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)


@dataclasses.dataclass
class ReportCache:
    root: Path | None

    @classmethod
    def from_environment(cls) -> ReportCache:
        return cls(cache_dir_from(os.environ))

    def key(self, *, config: Any, model: str, tp: int, dtype: Any, batch: int, seq_len: int, decode: bool,
            options: Any, full_depth: bool) -> dict[str, Any]:
        return json.loads(_canonical({
            "format": FORMAT, "versions": versions(), "config": config.to_dict(), "model": model, "tp": tp,
            "dtype": str(dtype), "batch": batch, "seq_len": seq_len, "decode": decode, "full_depth": full_depth,
            "options": {f.name: repr(getattr(options, f.name)) for f in dataclasses.fields(options)},
        }))

    def _path(self, key: dict[str, Any]) -> Path:
        assert self.root is not None
        return self.root / "reports" / f"{hashlib.sha256(_canonical(key).encode()).hexdigest()}.json"

    def load(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored report state for ``key``; None for no entry or one that does not check out."""
        if self.root is None:
            return None
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or \
                entry.get("checksum") != _checksum(key, entry.get("report")):
            return None
        return entry["report"]

    def store(self, key: dict[str, Any], report: dict[str, Any]) -> None:
        if self.root is None:
            return
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(_canonical({"key": key, "report": report, "checksum": _checksum(key, report)}))
            os.replace(tmp, path)
            tmp = None
        except OSError:
            pass  # an unwritable cache only costs the next plan its time
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)


def _checksum(key: Any, report: Any) -> str:
    return hashlib.sha256(_canonical([key, report]).encode()).hexdigest()

