"""Rank-health bookkeeping (autotp.health) on a single-process HashStore: several RankHealth
objects stand for the ranks of one group, sharing the store, as ranks share the c10d store."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from autotp.collectives import Comm, _guard, peer_failures
from autotp.health import RankFailure, RankHealth


def _ranks(n: int, interval: float = 0.05) -> tuple[dist.HashStore, list[RankHealth]]:
    store = dist.HashStore()
    return store, [RankHealth(store, r, n, interval=interval) for r in range(n)]


def test_a_rank_that_raised_is_named_with_its_phase_and_reason():
    _, (h0, h1, h2) = _ranks(3)
    for h in (h0, h1, h2):
        h.start()
    try:
        h1.set_phase("generate")
        h1.step = 4
        h1.record_failure(ValueError("bad token id 99999"))
        suspects = h0.diagnose(stale_after=0.2)
        assert [(s.rank, s.kind) for s in suspects] == [(1, "failed")]
        assert suspects[0].phase == "generate, forward call 4"
        err = h0.failure("the model was running", RuntimeError("Connection closed by peer"))
        assert isinstance(err, RankFailure) and err.ranks == (1,)
        text = str(err)
        assert "rank 0 of 3: rank 1 failed while the model was running" in text
        assert "ValueError: bad token id 99999" in text and "'generate, forward call 4'" in text
        assert "Check the log of rank 1" in text and "Connection closed by peer" in text
    finally:
        for h in (h0, h1, h2):
            h.stop()


def test_secondary_failures_come_after_the_rank_that_caused_them():
    _, (h0, h1, h2) = _ranks(3)
    for h in (h0, h1, h2):
        h.beat()
    h2.record_failure(RankFailure("rank 2 of 3: rank 1 failed ..."))  # h2 only saw rank 1 fail
    h1.record_failure(MemoryError("out of memory"))
    suspects = h0.diagnose(stale_after=0.1)
    assert [(s.rank, s.kind) for s in suspects] == [(1, "failed"), (2, "secondary")]
    assert str(h0.failure("x", "boom")).startswith("rank 0 of 3: rank 1 failed while x")


def test_a_process_that_is_gone_is_named_dead_at_once():
    _, (h0, h1) = _ranks(2)
    h0.start()
    try:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        # rank 1 "ran" in that (now finished) process on this host and last said it was generating
        h1.set_phase("generate")
        h1.store.set("autotp/health/1/pid", f"{h1.host}:{child.pid}")
        start = time.monotonic()
        suspects = h0.diagnose(stale_after=5.0)
        assert time.monotonic() - start < 1.0  # no waiting on heartbeats for a local process
        assert [(s.rank, s.kind, s.phase) for s in suspects] == [(1, "dead", "generate")]
        assert "rank 1 died in phase 'generate'" in str(h0.failure("the model was running", "closed"))
    finally:
        h0.stop()


def test_a_silent_heartbeat_on_another_host_is_named_after_the_wait():
    store, (h0, h1) = _ranks(2)
    h1.host = "elsewhere"  # cannot be checked through /proc: only the heartbeat tells
    h1.start()
    h1.set_phase("loading")
    h1.stop()  # the "process" stops beating
    h0.start()
    try:
        suspects = h0.diagnose(stale_after=0.3)
        assert [(s.rank, s.kind, s.phase) for s in suspects] == [(1, "silent", "loading")]
    finally:
        h0.stop()


def test_a_live_rank_that_never_reached_the_collective_is_named_behind():
    _, (h0, h1) = _ranks(2)
    h0.collectives = lambda: 12
    h1.collectives = lambda: 11
    h1.set_phase("loading")
    h0.start()
    h1.start()
    try:
        suspects = h0.diagnose(stale_after=0.3)
        assert [(s.rank, s.kind) for s in suspects] == [(1, "behind")]
        assert "entered 11 collectives, rank 0 12" in suspects[0].detail
    finally:
        h0.stop()
        h1.stop()


def test_no_suspect_and_an_unreachable_store_give_a_plain_message():
    class Broken:
        def set(self, *a):
            raise RuntimeError("Connection refused")

        check = get = set

    h = RankHealth(Broken(), 0, 2, interval=0.05)
    h.start()  # never raises, the thread ends on the first failed write
    try:
        assert h.diagnose(stale_after=0.1) == []
        text = str(h.failure("the model was loading", "Timed out"))
        assert "which one could not be told" in text and "Connection refused" in text
    finally:
        h.stop()
    assert not h.running


def test_the_heartbeat_thread_is_a_daemon_and_stops_cleanly():
    store, (h0,) = _ranks(1, interval=0.02)
    hook = sys.excepthook
    h0.start()
    assert h0.running and h0._thread.daemon and sys.excepthook != hook
    time.sleep(0.1)
    seq = int(store.get("autotp/health/0/beat").decode().split("|")[0])
    assert seq >= 3  # beat on its own
    h0.stop()
    assert not h0.running and sys.excepthook == hook
    assert not any(t.name.startswith("autotp-heartbeat") for t in threading.enumerate())
    h0.stop()  # idempotent


def test_an_uncaught_exception_is_recorded_by_the_except_hook(capsys):
    store, (h0, h1) = _ranks(2)
    h1.start()
    h1.set_phase("generate")
    try:
        raise KeyError("boom")
    except KeyError as e:
        sys.excepthook(type(e), e, e.__traceback__)  # what the interpreter does for an uncaught one
    assert "KeyError" in capsys.readouterr().err  # the previous hook still printed it
    assert not h1.running
    assert store.get("autotp/health/1/failed").decode() == "generate|KeyError: 'boom'"


def test_a_failed_collective_becomes_a_rank_failure_naming_the_rank():
    _, (h0, h1) = _ranks(2)
    comm = Comm.simulated_group(2, rank=0)
    comm.health = h0
    h1.set_phase("generate")
    h1.record_failure(ZeroDivisionError("division by zero"))
    with pytest.raises(RankFailure, match="rank 1 raised in phase 'generate': ZeroDivisionError") as info:
        with peer_failures(comm, "the model was running"), _guard(comm, "all_reduce"):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert info.value.ranks == (1,)
    assert comm.issued == 1
    # anything else passes through unchanged
    with pytest.raises(RuntimeError, match="shape mismatch"), _guard(comm, "all_reduce"):
        raise RuntimeError("shape mismatch")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="process check reads /proc")
def test_a_zombie_counts_as_dead():
    _, (h0,) = _ranks(1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # exited but not reaped yet: a zombie
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                break
        time.sleep(0.02)
    assert h0._process_gone({"host": h0.host, "pid": child.pid}) is True
    child.wait()
    assert h0._process_gone({"host": h0.host, "pid": os.getpid()}) is False
