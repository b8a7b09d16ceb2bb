"""Ranks on one machine take turns downloading: a file lock per repo in the Hub cache. Offline
nothing is downloaded, so no lock is taken and a read-only cache works."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from huggingface_hub.utils import WeakFileLock

from autotp.weights import _download_lock, resolve_checkpoint
from tests._tiny import make_hf_cache, offline_hub, save_tiny


def test_a_second_process_waits_for_the_first_to_finish_downloading(tmp_path: Path) -> None:
    lock_file = tmp_path / ".locks" / "models--tiny-org--llama" / "autotp-resolve.lock"
    lock_file.parent.mkdir(parents=True)
    events: list[str] = []

    def second() -> None:
        with _download_lock("tiny-org/llama", tmp_path):
            events.append("second has the lock")

    with WeakFileLock(lock_file):  # the first process, downloading
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.5)
        events.append("first done")
    waiter.join(10)
    assert events == ["first done", "second has the lock"]


def test_offline_resolution_takes_no_lock(tmp_path: Path, monkeypatch) -> None:
    offline_hub(monkeypatch)
    snapshot = make_hf_cache(tmp_path / "hub", "tiny-org/llama", save_tiny("llama", tmp_path / "src"))
    assert resolve_checkpoint("tiny-org/llama", cache_dir=tmp_path / "hub") == snapshot
    assert not (tmp_path / "hub" / ".locks").exists()
