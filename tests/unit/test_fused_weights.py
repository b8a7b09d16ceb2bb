"""A fused (strided) parameter layout is read slice by slice: rank r gets chunk r of every segment.

Exact comparisons: reading is data movement only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from autotp.errors import ShardingError
from autotp.placement import StridedShard, parse
from autotp.weights import Checkpoint, ParameterMeta

SEGMENTS = (16, 8, 8)  # q | k | v of a GQA projection with 8-wide kv


def _expected(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Chunk ``rank`` of each segment, concatenated (what each rank's local matmul needs)."""
    return torch.cat([seg.chunk(world, dim)[rank] for seg in full.split(list(SEGMENTS), dim)], dim)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_each_rank_reads_its_chunk_of_every_segment_and_nothing_else(tmp_path: Path, world: int, dim: int) -> None:
    full = torch.randn(32, 12) if dim == 0 else torch.randn(12, 32)
    save_file({"qkv.weight": full}, str(tmp_path / "model.safetensors"))
    for rank in range(world):
        ckpt = Checkpoint(tmp_path)
        meta = ParameterMeta(fqn="qkv.weight", global_shape=tuple(full.shape), dtype=torch.float32,
                             checkpoint_key="qkv.weight", checkpoint=ckpt, placement=StridedShard(dim, SEGMENTS))
        local = meta.load_local(rank, world)
        assert torch.equal(local, _expected(full, dim, rank, world))
        assert torch.equal(meta.shard_from(full, rank, world), local)  # in-memory path agrees bit for bit
        assert ckpt.bytes_read == local.numel() * 4 and len(ckpt.reads) == len(SEGMENTS)
        assert meta.is_strided and meta.local_shape(world, rank) == tuple(local.shape)


def test_segments_that_do_not_tile_the_dim_are_refused() -> None:
    meta = ParameterMeta(fqn="qkv.weight", global_shape=(30, 4), dtype=torch.float32,
                         placement=StridedShard(0, (16, 9, 5)))
    with pytest.raises(ShardingError, match="segments"):
        meta.shard_from(torch.zeros(30, 4), 0, 2)


def test_a_strided_placement_prints_and_parses_back() -> None:
    p = StridedShard(1, SEGMENTS)
    assert str(p) == "S(1|16+8+8)" and parse(str(p)) == p and p != parse("S(1)")
