"""Gradient groups of grouped kv heads under a dp x tp mesh (gloo, CPU, 8 ranks: dp=2 x tp=4).

With 2 kv heads at tp=4 each kv head is held by 2 consecutive tp ranks (``GroupedShard`` ``S(0/2)``),
and the k/v gradient is summed over those 2 ranks only (``collectives.ReduceOverChunkGroup``). Under
a mesh the subgroups must be made by every process of the world, for both dp replicas' tp groups
(``collectives.chunk_group`` gathers the tp groups' ranks first). Here each rank contributes
``global rank + 1`` as its gradient: the sum each rank gets must be exactly its own pair's, never
the other replica's or the whole tp group's (integers in fp32: exact). The training of a whole
model through grouped heads is checked at tp=4 in tests/distributed/test_kv_head_groups.py; 8
model ranks on this 2-core machine would cost minutes, this costs seconds.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.dist


def _rank(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.collectives import Comm, chunk_group, reduce_over_chunk_group

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    comm = Comm(mesh["tp"].get_group(), mesh.get_local_rank("tp"), 4)
    x = torch.zeros(3, requires_grad=True)
    reduce_over_chunk_group(x, comm, 2).backward(torch.full((3,), float(rank + 1)))
    return {"grad": x.grad.tolist(), "group": dist.get_process_group_ranks(chunk_group(comm, 2)),
            "made_once": chunk_group(comm, 2) is chunk_group(comm, 2)}


def test_each_kv_head_gradient_is_summed_over_its_own_pair_of_tp_ranks_in_each_dp_replica() -> None:
    results = run_ranks(_rank, 8)
    for rank, r in enumerate(results):
        pair = [rank - rank % 2, rank - rank % 2 + 1]  # tp ranks (0,1), (2,3) of each replica of 4
        assert r["group"] == pair
        assert r["grad"] == [float(sum(q + 1 for q in pair))] * 3
        assert r["made_once"]
