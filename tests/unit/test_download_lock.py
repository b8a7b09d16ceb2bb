"""Downloads are locked per file by huggingface_hub itself (autotp adds no lock of its own). Offline
nothing is downloaded, so no lock is taken and a read-only cache works."""

from __future__ import annotations

from pathlib import Path

from autotp.weights import resolve_checkpoint
from tests._tiny import make_hf_cache, offline_hub, save_tiny


def test_offline_resolution_takes_no_lock(tmp_path: Path, monkeypatch) -> None:
    offline_hub(monkeypatch)
    snapshot = make_hf_cache(tmp_path / "hub", "tiny-org/llama", save_tiny("llama", tmp_path / "src"))
    assert resolve_checkpoint("tiny-org/llama", cache_dir=tmp_path / "hub") == snapshot
    assert not (tmp_path / "hub" / ".locks").exists()
