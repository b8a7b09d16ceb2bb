"""``autotp/memory.py``: freed heap pages go back to the OS; Dynamo's guard-latency profiling (a
~32 MB cache-eviction buffer per compiled graph) is skipped inside the block and only there.

Exact checks only (which function Dynamo calls, what is restored); no RSS or timing asserts.
"""

from __future__ import annotations

import sys

import torch
import torch._dynamo.guards as dynamo_guards

from autotp.memory import no_guard_latency_profile, release_free_memory


def test_release_free_memory_runs_and_reports_a_bool() -> None:
    assert isinstance(release_free_memory(), bool)
    if not sys.platform.startswith("linux"):
        assert release_free_memory() is False  # only the collection runs elsewhere


def test_guard_latency_profile_is_skipped_inside_the_block_and_restored_after() -> None:
    original = dynamo_guards.profile_guard_manager
    calls: list[int] = []

    def counting(*args: object) -> float:
        calls.append(1)
        return original(*args)

    dynamo_guards.profile_guard_manager = counting
    try:
        torch._dynamo.reset()
        with no_guard_latency_profile():
            assert dynamo_guards.profile_guard_manager is not counting
            with no_guard_latency_profile():  # nested: restores what it found
                pass
            assert dynamo_guards.profile_guard_manager is not counting
            out = torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        assert calls == []  # the graph compiled inside the block was not profiled
        assert dynamo_guards.profile_guard_manager is counting
        torch.testing.assert_close(out, torch.full((3,), 3.0))  # exact: small integers in fp32
        torch.compile(lambda x: x * 3 - 1, backend="eager")(torch.ones(3))
        assert calls == [1]  # outside the block Dynamo profiles as before
    finally:
        dynamo_guards.profile_guard_manager = original
        torch._dynamo.reset()
