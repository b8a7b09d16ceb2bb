"""Load progress by phase: the shard-read bar's clock starts at the first read, so compilation is
never in its rate or ETA, and the closing line gives each phase's own time."""

from __future__ import annotations

import io

from autotp.progress import LoadProgress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_planning_reading_and_warm_up_are_timed_apart() -> None:
    clock, out = _Clock(), io.StringIO()
    progress = LoadProgress(total=3, stream=out, clock=clock)
    clock.now = 95.0
    progress._announce_planning()  # the 1 s timer fired while tracing and planning
    assert progress.bar is None  # no bar yet: nothing has been read
    for t in (100.0, 101.0, 102.0):
        clock.now = t
        progress.read()
    assert progress.bar is not None and progress.bar.n == 3
    clock.now = 105.0
    phases = progress.finish()
    assert phases == {"plan": 100.0, "read": 2.0, "warmup": 3.0}
    text = out.getvalue()
    assert "tracing and planning the model" in text
    assert ("autotp: loaded in 105.0 s: tracing and planning 100.0 s, reading 3 tensors 2.0 s, warm-up 3.0 s"
            in text)


def test_the_read_bar_starts_its_clock_at_the_first_read_not_at_the_start_of_the_load() -> None:
    clock, out = _Clock(), io.StringIO()
    progress = LoadProgress(total=2, stream=out, clock=clock)
    import time

    time.sleep(0.2)  # "compilation": the bar must not count it
    before = time.time()
    progress.read()
    assert progress.bar.start_t >= before  # tqdm's own clock: rate and ETA cover the reads only
    progress.finish()


def test_a_failed_load_reports_no_times() -> None:
    clock, out = _Clock(), io.StringIO()
    progress = LoadProgress(total=2, stream=out, clock=clock)
    progress.read()
    clock.now = 10.0
    progress.abandon()
    assert "loaded in" not in out.getvalue()
