"""``autotp plan``'s reports kept on disk: asking the same question again is one file read, served
before torch or transformers are imported.

The per-graph plan cache (``autotp/plan_cache.py``) keys a Dynamo graph, so a hit there still builds
the model and runs Dynamo's trace, the larger half of a plan. This cache keys the whole question,
from what can be read without importing torch (``autotp plan`` looks it up first, and imports the
planner only on a miss):

* the model as given (the report prints it) and the SHA-256 of the ``config.json`` it is planned
  from (:func:`config_file`: a config-only folder's own file, or a Hub id's, through
  ``huggingface_hub``);
* the request: every option the command passes to :func:`~autotp.planner.plan_model` (tp, dtype and
  sequence length as given, batch, decode, overrides, full depth, revision);
* the versions (:func:`autotp.cache_env.versions`: autotp's version and a digest of its source, so
  a changed planner or a changed default option is a changed key; torch, transformers and Python
  from the packages' metadata) and this file's ``FORMAT``.

The value is the :class:`~autotp.plan_report.PlanReport` without its solver record
(``PlanReport.to_state``), its fields in the order the planner wrote them (the printed table keeps
its order). Not cached: plans with ``--explain`` (an explanation re-solves from the record) and a
folder holding weights (they are checked against the config on every plan).

Same location, switch and trust rules as the plan cache (``AUTOTP_CACHE_DIR`` / ``AUTOTP_CACHE=0``):
an entry ``<cache dir>/reports/<sha256 of the key>.json`` carries its key and a checksum of key and
report; an entry that does not parse, carries another key (another version, config or option) or
fails its checksum is a miss, planned again and rewritten. Writes are atomic (a temporary file,
then ``os.replace``), so concurrent writers both succeed; a folder that cannot be written is skipped
silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotp import cache_env
from autotp.checkpoint_files import holds_weights

__all__ = ["FORMAT", "ReportCache", "config_file"]

#: bump when the entry layout or the meaning of a key field changes
FORMAT = 3


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def config_file(model: str, *, revision: str | None = None, local_files_only: bool = False) -> Path | None:
    """The ``config.json`` the planner reads for ``model``, found without importing torch: a
    folder's own (None when the folder holds weights, or has no config.json: the planner says
    why), else a Hub id's through ``huggingface_hub`` (the file the planner downloads; None when
    it cannot be had, and the planner reports why)."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        return path if path.is_file() and not holds_weights(folder) else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json", revision=revision, local_files_only=local_files_only))
    except Exception:  # noqa: BLE001 - not a Hub id, or not reachable: planned without the cache
        return None


@dataclasses.dataclass
class ReportCache:
    """The reports under ``root``/reports; ``root`` None: no cache (every lookup misses)."""

    root: Path | None

    @classmethod
    def from_environment(cls) -> ReportCache:
        return cls(cache_env.cache_dir_from(os.environ))

    def key(self, model: str, config: Path, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """The key of planning ``model`` from the file ``config`` with ``request``; None without a
        cache or when the file cannot be read."""
        if self.root is None:
            return None
        try:
            digest = hashlib.sha256(config.read_bytes()).hexdigest()
        except OSError:
            return None
        return json.loads(_canonical({"format": FORMAT, "versions": cache_env.versions(), "model": model,
                                      "config_sha256": digest, "request": dict(request)}))

    def _path(self, key: dict[str, Any]) -> Path:
        assert self.root is not None
        return self.root / "reports" / f"{hashlib.sha256(_canonical(key).encode()).hexdigest()}.json"

    def load(self, key: dict[str, Any] | None) -> dict[str, Any] | None:
        """The stored report state for ``key``; None for no entry or one that does not check out."""
        if key is None or self.root is None:
            return None
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or \
                entry.get("checksum") != _checksum(key, entry.get("report")):
            return None
        return entry["report"]

    def store(self, key: dict[str, Any] | None, report: dict[str, Any]) -> None:
        """Keep ``report`` (a ``PlanReport.to_state()``) under ``key``, atomically."""
        if key is None or self.root is None:
            return
        path = self._path(key)
        try:
            text = json.dumps({"key": key, "report": report, "checksum": _checksum(key, report)},
                              separators=(",", ":"))  # the report's own order: the table prints in it
            cache_env.write_atomic(path, text.encode())
        except (OSError, TypeError, ValueError):
            pass  # an unwritable cache (or a report JSON cannot hold) only costs the next plan its time


def _checksum(key: Any, report: Any) -> str:
    return hashlib.sha256(_canonical([key, report]).encode()).hexdigest()
