"""Redistribution on 2 and 4 gloo ranks against a single-process reference.

Every pair ``src -> dst`` is checked in one spawn per world size (and per implementation: native
collectives and the emulations): each rank builds its piece of a logical tensor ``X`` under ``src``,
redistributes, and backpropagates its piece of a random upstream gradient ``G`` under ``dst``. The
parent reassembles the pieces and compares with the single-process computation (identity on ``X``,
so the forward is ``X`` and the gradient is ``G``, in the expected placements).

Tolerances: exact (``torch.equal``) where data only moves (narrow, all-gather, all-to-all); where
ranks sum fp32 summands (all-reduce, reduce-scatter, and the reassembly of a ``P`` value) the
addition order differs from the reference, so ``rtol = atol = 1e-6`` (values are O(1), at most 4
summands: the error is a few ulp).
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import sys
import traceback
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotp import collectives
from autotp.collectives import Comm, cost_bytes, kind_of, redistribute
from autotp.errors import AutoTPError, ShardingError
from autotp.layers import Redistribute, VocabParallelEmbedding, vocab_range
from autotp.placement import P, Partial, Placement, R, Shard
from tests._dist import RANK_CPU, RankError, run_ranks

pytestmark = pytest.mark.dist

SUM_TOL = {"rtol": 1e-6, "atol": 1e-6}

SHARDS = [Shard(0), Shard(1), Shard(2)]
# (src, dst, grad_partial) for every supported pair
PAIRS: list[tuple[Placement, Placement, bool]] = (
    [(R, R, False), (R, R, True), (P, R, False), (P, R, True), (P, P, False)]
    + [(R, s, False) for s in SHARDS]
    + [(P, s, False) for s in SHARDS]
    + [(s, R, gp) for s in SHARDS for gp in (False, True)]
    + [(a, b, False) for a in SHARDS for b in SHARDS]
)


def _shape(n: int) -> tuple[int, int, int]:
    return (2 * n, 3 * n, 5 * n)  # every dim divisible by n, all sizes different


def _global(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logical tensor X and upstream gradient G (same on every process for a seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(_shape(n), generator=g), torch.randn(_shape(n), generator=g)


def _partial_parts(t: torch.Tensor, n: int, seed: int) -> list[torch.Tensor]:
    """``n`` random summands of ``t`` (the last one closes the sum)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(t.shape, generator=g) for _ in range(n - 1)]
    return [*parts, t - sum(parts, torch.zeros_like(t))]


def _local(t: torch.Tensor, p: Placement, rank: int, n: int, seed: int) -> torch.Tensor:
    """This rank's piece of ``t`` under ``p``."""
    if isinstance(p, Shard):
        return t.chunk(n, p.dim)[rank].clone()
    if isinstance(p, Partial):
        return _partial_parts(t, n, seed)[rank]
    return t.clone()


def _pair_id(src: Placement, dst: Placement, gp: bool) -> str:
    return f"{src}->{dst}{'/gp' if gp else ''}"


# --------------------------------------------------------------------------------------------------
# Rank programs (module level: spawn pickles them by name)
# --------------------------------------------------------------------------------------------------


EMULATE = {"native": (), "emulated": ("all_gather", "reduce_scatter", "all_to_all")}


def _rank_program(rank: int, n: int) -> dict[str, Any]:
    """Everything one rank does (one spawn per world size keeps the file fast on 2 cores)."""
    collectives.ensure_process_group(None, datetime.timedelta(seconds=30))  # no-op: already set up
    out: dict[str, Any] = {mode: _redistribute_all(rank, n, emulate) for mode, emulate in EMULATE.items()}
    comm = Comm.from_default_group()
    assert comm.use_shared_memory(capacity=64)  # 64-byte slots: most all-reduces go in pieces
    out["shared_memory"] = _redistribute_all(rank, n, (), comm.shared_memory)
    out["shared_memory_calls"] = comm.shared_memory.calls
    out["broadcast"] = collectives.broadcast_object({"from": rank}, comm)
    collectives.barrier(comm)
    out["embedding"] = _embedding_rank(rank, n, *_embedding_inputs(n))
    return out


def _redistribute_all(rank: int, n: int, emulate: tuple[str, ...],
                      shared_memory: collectives.SharedMemoryCollectives | None = None) -> dict[str, Any]:
    """Run every pair; return per pair the local output, local input grad and the comm counters."""
    out: dict[str, Any] = {}
    for i, (src, dst, gp) in enumerate(PAIRS):
        try:
            out[_pair_id(src, dst, gp)] = _one_pair(rank, n, i, src, dst, gp, emulate, shared_memory)
        except Exception:  # noqa: BLE001 - reported per pair by the parent
            out[_pair_id(src, dst, gp)] = {"error": traceback.format_exc()}
    return out


def _one_pair(rank: int, n: int, i: int, src: Placement, dst: Placement, gp: bool,
              emulate: tuple[str, ...], shared_memory: collectives.SharedMemoryCollectives | None = None
              ) -> dict[str, Any]:
    x_full, g_full = _global(n, seed=i)
    comm = Comm.from_default_group(emulate=emulate)
    comm.shared_memory = shared_memory
    x = _local(x_full, src, rank, n, seed=1000 + i).requires_grad_()
    y = redistribute(x, src, dst, comm, grad_partial=gp)
    # Gradient arriving at y: partial summands if grad_partial, a shard for S(d), else (R or P
    # output: every summand's gradient is the whole gradient) the full G.
    if gp:
        g = _partial_parts(g_full, n, 2000 + i)[rank]
    else:
        g = _local(g_full, R if isinstance(dst, Partial) else dst, rank, n, 0)
    y.backward(g)
    return {
        "y": y.detach().clone(),
        "grad": x.grad.clone(),
        "contiguous": y.is_contiguous(),
        "counts": dict(comm.counts),
        "bytes": dict(comm.bytes),
        "backward_counts": dict(comm.backward_counts),
        "emulated": sorted(comm.emulate),
    }


def _embedding_inputs(n: int) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(vocab, padding_idx, weight, ids, upstream grad), the same in every process."""
    vocab = 4 * n + 3  # uneven on purpose: torch.chunk rows, the last shard is shorter
    padding_idx = vocab - 2  # upper half of the vocabulary, on the last rank
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(vocab, 6, generator=g)
    ids = torch.randint(0, vocab, (3, 9), generator=g)  # (B, S)
    ids[0, :3] = padding_idx
    ids[1, 0], ids[1, 1] = 0, vocab - 1
    grad = torch.randn(3, 9, 6, generator=g)  # (B, S, H)
    return vocab, padding_idx, weight, ids, grad


def _embedding_rank(rank: int, n: int, vocab: int, padding_idx: int, weight: torch.Tensor,
                    ids: torch.Tensor, grad: torch.Tensor) -> dict[str, Any]:
    real_op = _ensure_embedding_op()
    comm = Comm.from_default_group()
    start, end = vocab_range(vocab, rank, n)
    param = torch.nn.Parameter(weight[start:end].clone())
    emb = VocabParallelEmbedding(param, vocab, start, padding_idx=padding_idx)
    reduce = Redistribute(P, R, comm)
    y = reduce(emb(ids))  # (B, S, H)
    y.backward(grad)
    return {
        "y": y.detach(),
        "grad": param.grad.clone(),
        "same_param": emb.weight is param and next(emb.parameters()) is param,
        "local_padding_idx": emb.local_padding_idx,
        "range": (start, end),
        "counts": dict(comm.counts),
        "repr": repr(reduce),
        "real_op": real_op,
    }


def _ensure_embedding_op() -> bool:
    """Use ``autotp.ops.embedding`` when it exists (True); otherwise install a private stand-in."""
    try:
        import autotp.ops.embedding  # noqa: F401
    except ImportError:
        mod = types.ModuleType("autotp.ops.embedding")
        mod.vocab_parallel_embedding = _vocab_parallel_embedding  # type: ignore[attr-defined]
        sys.modules["autotp.ops.embedding"] = mod
        return False
    return True


def _vocab_parallel_embedding(indices: torch.Tensor, weight_local: torch.Tensor, vocab_start: int,
                              padding_idx: int | None = None) -> torch.Tensor:
    """Test-only copy of the op: look up owned ids, zeros elsewhere; ``padding_idx`` is global."""
    vocab_end = vocab_start + weight_local.shape[0]
    outside = (indices < vocab_start) | (indices >= vocab_end)
    local = (indices - vocab_start).masked_fill(outside, 0)
    local_pad = padding_idx - vocab_start if padding_idx is not None and vocab_start <= padding_idx < vocab_end else None
    out = F.embedding(local, weight_local, padding_idx=local_pad)  # (*, H)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _die_on_rank_1(rank: int, n: int) -> int:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def _fail_on_rank_1(rank: int, n: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # would hang forever without the harness killing it
    return rank


def _spin(rank: int, n: int, cpu_s: float) -> float:
    """Busy for ``cpu_s`` CPU seconds of this rank; returns the rank's CPU seconds so far."""
    import time

    while time.process_time() < cpu_s:
        pass
    return time.process_time()


# --------------------------------------------------------------------------------------------------
# Parent-side checks
# --------------------------------------------------------------------------------------------------


def _assemble(pieces: list[torch.Tensor], p: Placement) -> torch.Tensor:
    if isinstance(p, Shard):
        return torch.cat(pieces, p.dim)
    if isinstance(p, Partial):
        return torch.stack(pieces).sum(0)
    for piece in pieces[1:]:  # replicated: every rank must hold the same values
        torch.testing.assert_close(piece, pieces[0], rtol=0, atol=0)
    return pieces[0]


def _expected_counts(src: Placement, dst: Placement, gp: bool) -> tuple[dict[str, int], dict[str, int]]:
    fwd = kind_of(src, dst)
    bwd = collectives.backward_kind_of(src, dst, gp)
    return ({fwd: 1} if fwd else {}), ({bwd: 1} if bwd else {})


_CACHE: dict[int, list[dict[str, Any]]] = {}


def _results(n: int) -> list[dict[str, Any]]:
    """Per-rank results of :func:`_rank_program`, one spawn per world size for the whole file."""
    if n not in _CACHE:
        _CACHE[n] = run_ranks(_rank_program, n, timeout=90)
    return _CACHE[n]


@pytest.mark.parametrize("mode", [*EMULATE, "shared_memory"])
@pytest.mark.parametrize("n", [2, 4])
def test_redistribute_pairs(n: int, mode: str) -> None:
    """Every pair, through the process group's native collectives, the emulations, and the
    shared-memory transport (all-reduces in 64-byte pieces, small all-gathers; replicated results
    must be bitwise equal across ranks, which the rank-order sum guarantees)."""
    per_rank = [r[mode] for r in _results(n)]
    if mode == "shared_memory":
        assert all(r["shared_memory_calls"] > len(PAIRS) for r in _results(n))  # the pieces went through it
    failures = []
    for i, (src, dst, gp) in enumerate(PAIRS):
        name = _pair_id(src, dst, gp)
        recs = [r[name] for r in per_rank]
        errors = [r["error"] for r in recs if "error" in r]
        if errors:
            failures.append(f"{name}: raised on a rank:\n{errors[0]}")
            continue
        x_full, g_full = _global(n, seed=i)
        # Single-process reference of the same logical computation: identity on X.
        x_ref = x_full.clone().requires_grad_()
        x_ref.backward(g_full)
        # Exact where data only moves; SUM_TOL where ranks add summands (see module docstring).
        fwd_sums = isinstance(src, Partial)
        bwd_sums = gp
        exact = {"rtol": 0, "atol": 0}
        try:
            torch.testing.assert_close(_assemble([r["y"] for r in recs], dst), x_ref.detach(),
                                       **(SUM_TOL if fwd_sums else exact))
            # The gradient of an R or P input is the full gradient on every rank; of S(d), its shard.
            grad_place = src if isinstance(src, Shard) else R
            torch.testing.assert_close(_assemble([r["grad"] for r in recs], grad_place), x_ref.grad,
                                       **(SUM_TOL if bwd_sums else exact))
            fwd, bwd = _expected_counts(src, dst, gp)
            for r in recs:
                assert r["counts"] == fwd, ("forward counts", r["counts"], fwd)
                assert r["backward_counts"] == bwd, ("backward counts", r["backward_counts"], bwd)
                assert set(r["bytes"]) == set(fwd)
                assert r["contiguous"]
                assert set(r["emulated"]) == set(EMULATE.get(mode, ()))
        except AssertionError as err:
            failures.append(f"{name}: {err}")
    assert not failures, "\n".join(failures)


def test_bytes_counted_are_local_payload() -> None:
    n = 2
    rec = _results(n)[0]["native"][_pair_id(Shard(1), R, False)]
    x_local_bytes = 2 * n * 3 * 5 * n * 4  # (2n, 3n/n, 5n) fp32
    assert rec["bytes"] == {"all_gather": x_local_bytes}


@pytest.mark.parametrize("n", [2, 4])
def test_broadcast_object(n: int) -> None:
    assert [r["broadcast"] for r in _results(n)] == [{"from": 0}] * n


@pytest.mark.parametrize("n", [2, 4])
def test_vocab_parallel_embedding(n: int) -> None:
    vocab, padding_idx, weight, ids, grad = _embedding_inputs(n)
    per_rank = [r["embedding"] for r in _results(n)]

    w_ref = weight.clone().requires_grad_()
    y_ref = F.embedding(ids, w_ref, padding_idx=padding_idx)  # (B, S, H)
    y_ref.backward(grad)
    # Exact: for each id exactly one rank adds a nonzero row, the others add zeros.
    for r in per_rank:
        torch.testing.assert_close(r["y"], y_ref.detach(), rtol=0, atol=0)
        assert r["same_param"]
        assert r["counts"] == {"all_reduce": 1}
        assert "P -> R, all_reduce" in r["repr"]
    # Row gradients sum the same rows of G on one rank; SUM_TOL covers a different summation order
    # inside the embedding backward kernel.
    torch.testing.assert_close(torch.cat([r["grad"] for r in per_rank]), w_ref.grad, **SUM_TOL)
    owners = [r for r in per_rank if r["range"][0] <= padding_idx < r["range"][1]]
    assert len(owners) == 1 and owners[0] is per_rank[-1]
    local_pad = padding_idx - owners[0]["range"][0]
    assert owners[0]["local_padding_idx"] == local_pad
    assert torch.count_nonzero(owners[0]["grad"][local_pad]) == 0  # padding row gets no gradient
    assert all(r["local_padding_idx"] is None for r in per_rank[:-1])


def test_harness_reports_child_error_and_does_not_hang() -> None:
    # rank 0 blocks in a barrier that rank 1 never reaches: the harness must still come back.
    with pytest.raises(RankError, match=r"rank 1 of 2 failed first(.|\n)*boom on rank 1") as info:
        run_ranks(_fail_on_rank_1, 2, timeout=30)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RankError, match=r"rank 1 of 2 failed first(.|\n)*died without a result \(exit code 3\)"):
        run_ranks(_die_on_rank_1, 2, timeout=30)


def test_harness_adds_the_cpu_seconds_its_ranks_spent() -> None:
    """Forked from the forkserver, ranks are not the test's children: each reports its own CPU
    seconds (at least what it returns as spent in ``fn``) and the harness adds them up."""
    before = RANK_CPU.total_s
    spent = run_ranks(_spin, 2, 0.3)
    assert min(spent) >= 0.3
    assert RANK_CPU.total_s - before >= sum(spent)


def test_comm_is_shared_not_copied() -> None:
    comm = Comm.single()
    module = Redistribute(P, R, comm)
    assert copy.deepcopy(module).comm is comm


# --------------------------------------------------------------------------------------------------
# No process group needed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src,dst,gp", PAIRS, ids=[_pair_id(*p) for p in PAIRS])
def test_world_size_one_is_identity(src: Placement, dst: Placement, gp: bool) -> None:
    comm = Comm.single()
    x = torch.randn(_shape(1), requires_grad=True)
    y = redistribute(x, src, dst, comm, grad_partial=gp)
    assert y is x
    assert not comm.counts and not comm.backward_counts


@pytest.mark.parametrize("src", [R, Shard(0), Shard(1)])
def test_unsupported_pairs_raise(src: Placement) -> None:
    x = torch.randn(4, 4)
    with pytest.raises(AutoTPError, match="not supported"):
        redistribute(x, src, P, Comm.single())
    with pytest.raises(AutoTPError, match="not supported"):
        kind_of(src, P)
    with pytest.raises(AutoTPError, match="not supported"):
        Redistribute(src, P, Comm.single())
    assert cost_bytes(src, P, 100, 4) == float("inf")
    with pytest.raises(AutoTPError, match="grad_partial"):
        redistribute(x, R, Shard(0), Comm.single(), grad_partial=True)


def test_an_all_to_all_off_an_uneven_shard_raises() -> None:
    # An uneven shard (3 rows over 2 ranks) is only gathered or narrowed, never moved to another
    # dim; that is checked before any communication, so a fake two-rank Comm is enough here.
    comm = Comm.single()
    comm.world_size = 2
    with pytest.raises(ShardingError, match="split unevenly"):
        redistribute(torch.randn(2, 4), Shard(0), Shard(1), comm, size=3)


def test_kind_and_cost() -> None:
    n, b = 4, 1024.0
    assert kind_of(R, R) is None and cost_bytes(R, R, b, n) == 0
    assert kind_of(R, Shard(1)) is None and cost_bytes(R, Shard(1), b, n) == 0
    assert kind_of(P, R) == "all_reduce" and cost_bytes(P, R, b, n) == 2 * 3 / 4 * b
    assert kind_of(Shard(0), R) == "all_gather" and cost_bytes(Shard(0), R, b, n) == 3 / 4 * b
    assert kind_of(P, Shard(0)) == "reduce_scatter" and cost_bytes(P, Shard(0), b, n) == 3 / 4 * b
    assert kind_of(Shard(0), Shard(1)) == "all_to_all" and cost_bytes(Shard(0), Shard(1), b, n) == 3 / 16 * b
    assert kind_of(Shard(1), Shard(1)) is None and kind_of(P, P) is None
    assert cost_bytes(P, R, b, 1) == 0


def test_redistribute_repr() -> None:
    comm = Comm.single()
    assert Redistribute(Shard(2), R, comm).extra_repr() == "S(2) -> R, all_gather"
    assert Redistribute(R, Shard(0), comm).extra_repr() == "R -> S(0), narrow"
    assert Redistribute(R, R, comm, grad_partial=True).extra_repr() == "R -> R, identity, backward all_reduce"
    assert Redistribute(Shard(0), R, comm, True).extra_repr() == "S(0) -> R, all_gather, backward reduce_scatter"
    assert vocab_range(10, 3, 4) == (9, 10) and vocab_range(5, 3, 4) == (5, 5)


def test_ensure_process_group_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrun-like environment of one rank: env:// rendezvous, gloo picked on CPU."""
    if dist.is_initialized():
        pytest.skip("this pytest process already has a default process group")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(AutoTPError, match="torchrun"):
        collectives.ensure_process_group()
    with pytest.raises(AutoTPError, match="not initialized"):
        Comm.from_default_group()
    with socket.socket() as s:  # a port the OS hands out (env:// needs a number, not 0)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        collectives.ensure_process_group(None, datetime.timedelta(seconds=20), device="cpu")
        collectives.ensure_process_group()  # second call: no-op
        comm = Comm.from_default_group()
        assert (comm.backend, comm.rank, comm.world_size) == ("gloo", 0, 1)
        x = torch.randn(4, 6, requires_grad=True)
        assert redistribute(x, Shard(1), R, comm) is x  # world size 1 short-circuits
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
