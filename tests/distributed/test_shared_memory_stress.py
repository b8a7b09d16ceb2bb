"""Stress of the shared-memory transport (``collectives.SharedMemoryCollectives``): thousands of
calls on two and three ranks (three ranks on this 2-core machine: more ranks than cores), random sizes up to
and across the slot size (4 KB slots here, so an all-reduce goes in 1 to 3 pieces), ranks made
to run at different speeds (random, rank-dependent pauses and busy loops between calls), forward
and backward through the autograd collectives.

Every result is checked bit for bit: each rank's input of call ``k`` is generated from ``(k,
rank)``, so every rank can compute every other rank's input and the exact sum in rank order
(slot 0 + slot 1 + ..., the order the transport reduces in); a stale or torn slot (a flag seen
before its bytes) changes the checksum. A mismatch is reported with the call, the size and the
rank.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.dist

CALLS = 2000
SLOT = 4096  # bytes: 1024 fp32 values


def _data(call: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(call * 1000 + rank)
    return torch.randn(numel, generator=g)


def _rank_sum(call: int, world: int, numel: int) -> torch.Tensor:
    out = _data(call, 0, numel).clone()
    for q in range(1, world):
        out.add_(_data(call, q, numel))
    return out


def _stress(rank: int, world: int) -> dict:
    from autotp.collectives import Comm, GatherFromParallelRegion, ReduceFromParallelRegion

    comm = Comm.from_default_group()
    assert comm.use_shared_memory(capacity=SLOT)
    shm = comm.shared_memory
    sizes = random.Random(7)  # the same sequence of sizes on every rank
    pace = random.Random(100 + rank)  # rank-dependent pauses: the ranks drift apart and catch up
    bad: list[str] = []
    backward_checks = 0
    for call in range(CALLS):
        numel = sizes.randint(1, 3 * SLOT // 4)  # up to three slots of fp32
        kind = sizes.random()
        roll = pace.random()
        if roll < 0.05:
            time.sleep(pace.random() * 2e-3)
        elif roll < 0.15:
            end = time.perf_counter() + pace.random() * 2e-4
            while time.perf_counter() < end:  # busy: this rank is slow without yielding the core
                pass
        x = _data(call, rank, numel)
        if kind < 0.6:  # all-reduce forward; every fifth one also backward (all-reduce of a partial grad)
            with_grad = call % 5 == 0
            x.requires_grad_(with_grad)
            y = ReduceFromParallelRegion.apply(x, comm, True)
            if not torch.equal(y.detach(), _rank_sum(call, world, numel)):
                bad.append(f"call {call}: all-reduce of {numel} values differs on rank {rank}")
            if with_grad:
                y.backward(_data(call + CALLS, rank, numel))
                backward_checks += 1
                if not torch.equal(x.grad, _rank_sum(call + CALLS, world, numel)):
                    bad.append(f"call {call}: backward all-reduce of {numel} values differs on rank {rank}")
        else:  # all-gather of a piece that fits one slot
            piece = x[: max(numel // 3, 1)]
            y = GatherFromParallelRegion.apply(piece, 0, comm, False, None)
            expected = torch.cat([_data(call, q, numel)[: piece.numel()] for q in range(world)])
            if not torch.equal(y, expected):
                bad.append(f"call {call}: all-gather of {piece.numel()} values differs on rank {rank}")
    return {"bad": bad, "shm_calls": shm.calls, "backward_checks": backward_checks}


@pytest.mark.parametrize("world", [2, 3])
def test_thousands_of_shared_memory_collectives_at_different_speeds_are_bit_exact(world: int) -> None:
    for r in run_ranks(_stress, world, timeout=900):
        assert not r["bad"], r["bad"][:10]
        assert r["shm_calls"] > CALLS  # every call went through shared memory, the large ones in pieces
        assert r["backward_checks"] > 100
