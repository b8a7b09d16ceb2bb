"""What ``parallelize_model`` shows while it loads (rank 0, when progress is on), by phase.

The load is three phases of very different kinds, and one bar over all of them lies: before the
first shard is read, Dynamo traces the model and the solver plans it (seconds to minutes, no count
to show); then the shards are read (a count of tensors, with a rate worth an ETA); then the
warm-up call runs the compiled graphs. A bar over tensors started at the beginning puts the whole
compilation into its rate, so it showed a minutes-long ETA for a model read in a second. Here:

* tracing and planning: one status line once it has taken over a second (no bar, no ETA);
* reading shards: a tqdm bar whose clock starts at the first read, so its rate and ETA are the
  reads' own;
* at the end, one line with each phase's time (plan, read, warm-up and the rest), when the load
  took over a second.

Files are resolved before this (huggingface_hub's own download bars).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from autotp.weights import Checkpoint

__all__ = ["LoadProgress", "load_progress"]

#: a phase that ends sooner than this shows nothing
_DELAY_S = 1.0


class LoadProgress:
    """The phases of one load, timed from ``start``; ``read`` is the checkpoint's ``on_read`` hook."""

    def __init__(self, total: int, stream: Any = None, clock: Any = time.perf_counter) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = clock()
        self.first_read: float | None = None
        self.last_read: float | None = None
        self.reads = 0
        self.bar: Any = None
        self.announced = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(_DELAY_S, self._announce_planning)
        self._timer.daemon = True

    def begin(self) -> None:
        self._timer.start()

    def _announce_planning(self) -> None:
        with self._lock:
            if self.first_read is None:
                self.announced = True
                print("autotp: tracing and planning the model (compilation; no count to show) ...",
                      file=self.stream, flush=True)

    def read(self, _read: Any = None) -> None:
        now = self.clock()
        with self._lock:
            if self.first_read is None:
                self.first_read = now
                self._timer.cancel()
                from tqdm.auto import tqdm

                # the bar's clock starts here: its rate and ETA cover the reads only
                self.bar = tqdm(total=self.total, desc="autotp: reading shards", unit="tensor",
                                delay=_DELAY_S, leave=False, file=self.stream)
            self.last_read = now
            self.reads += 1
            self.bar.update(1)

    def phases(self, end: float) -> dict[str, float]:
        """Seconds per phase: ``plan`` (until the first read), ``read`` (first to last read),
        ``warmup`` (after the last read: the compiled graphs run, untouched parameters load)."""
        first = self.first_read if self.first_read is not None else end
        last = self.last_read if self.last_read is not None else first
        return {"plan": first - self.start, "read": last - first, "warmup": end - last}

    def abandon(self) -> None:
        """The load failed: stop the status timer and the bar, report no times."""
        self._timer.cancel()
        if self.bar is not None:
            self.bar.close()

    def finish(self) -> dict[str, float]:
        self._timer.cancel()
        end = self.clock()
        if self.bar is not None:
            self.bar.close()
        phases = self.phases(end)
        if end - self.start >= _DELAY_S:
            print(f"autotp: loaded in {end - self.start:.1f} s: tracing and planning {phases['plan']:.1f} s, "
                  f"reading {self.reads} tensors {phases['read']:.1f} s, warm-up {phases['warmup']:.1f} s",
                  file=self.stream, flush=True)
        return phases


@contextlib.contextmanager
def load_progress(checkpoint: Checkpoint, total: int, show: bool) -> Iterator[LoadProgress | None]:
    """Per-phase progress over the block (the warm-up call), hooked into ``checkpoint``'s reads."""
    if not show:
        yield None
        return
    progress = LoadProgress(total)
    checkpoint.on_read = progress.read
    progress.begin()
    try:
        yield progress
    except BaseException:
        progress.abandon()
        raise
    finally:
        checkpoint.on_read = None
    progress.finish()
