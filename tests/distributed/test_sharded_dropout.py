"""Dropout on a sharded activation draws each rank's own numbers (``autotp/rng.py``), at tp=2.

A column-parallel linear (identity weight) feeds dropout on its sharded output, and a row-parallel
linear (identity weight) sums the shards back, so the result is the dropped input itself: zeros
exactly where the masks of the two ranks dropped. With one stream for both ranks, rank 1's features
would be dropped exactly where rank 0's are (same numbers for different chunks); with per-rank
streams the two halves' patterns differ. The result is replicated, so both ranks return the same
tensor. Statistics: 64 x 64 elements at p = 0.5 keep a fraction within 5 standard errors of 0.5
(5 * sqrt(0.25 / 4096) = 0.039; a false failure about once in 1.7 million runs); the two halves'
masks agree on every element with probability 2**-2048 if they are independent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.dist

WIDTH, ROWS, P = 64, 64, 0.5


def _rank(rank: int, world: int, trace: str) -> dict:
    from autotp.backend import make_backend
    from autotp.collectives import Comm
    from autotp.config import AutoTPConfig
    from autotp.context import TPContext

    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Dropout(P),
                              torch.nn.Linear(WIDTH, WIDTH, bias=False))
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(WIDTH))
        net[2].weight.copy_(torch.eye(WIDTH))
    net.train()
    ctx = TPContext(comm=Comm.from_default_group(), config=AutoTPConfig(
        trace_dir=Path(trace), overrides={"0": "colwise", "2": "rowwise"}))
    compiled = torch.compile(net, backend=make_backend(ctx))
    torch.manual_seed(0)  # alike on every rank
    out = compiled(torch.ones(ROWS, WIDTH))
    rewrites: dict[str, int] = {}
    for summary in sorted(Path(trace, f"rank{rank}").glob("graph*/summary.json")):
        for tag, count in json.loads(summary.read_text()).get("local_rewrites", {}).items():
            rewrites[tag] = rewrites.get(tag, 0) + count
    return {"out": out.detach(), "rewrites": rewrites}


def test_dropout_on_a_sharded_activation_draws_each_ranks_own_mask(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(_rank, 2, str(tmp_path), timeout=600)
    assert rank0["rewrites"].get("rank_rng", 0) >= 1, rank0["rewrites"]  # the dropout ran on a rank stream
    torch.testing.assert_close(rank0["out"], rank1["out"], atol=0, rtol=0)  # replicated result, same bits
    kept = rank0["out"] != 0
    assert set(rank0["out"][kept].unique().tolist()) == {1 / (1 - P)}  # inverted dropout scaling
    assert abs(kept.float().mean().item() - (1 - P)) < 0.039
    half = WIDTH // 2
    assert not torch.equal(kept[:, :half], kept[:, half:])  # rank 0's features and rank 1's dropped apart
