"""The device mesh a parallelized model runs on: which ranks form its tensor-parallel group, and
which its data-parallel group.

A :class:`~torch.distributed.device_mesh.DeviceMesh` with dims named ``"dp"`` and ``"tp"``
(``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))``) lays the world out as
``dp`` replicas of one ``tp``-rank tensor-parallel group: tensor parallelism runs on
``mesh["tp"]``'s process group (autotp's :class:`~autotp.collectives.Comm` wraps that sub-group,
so a shard index is the rank *within* the tp group), data parallelism on ``mesh["dp"]`` through
torch's own engines (:mod:`autotp.data_parallel`). Without a mesh, the whole world is the tp group.

:func:`check_layout` is pure: it reads the mesh's shape and names (no collective) and refuses, as
one :class:`~autotp.errors.AutoTPError` naming the fix, a mesh without the named dims, a mesh that
does not cover the world, a ``tp_size`` that disagrees with the mesh and an unknown
``data_parallel``. ``parallelize_model`` calls it before any file is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotp.errors import AutoTPError

__all__ = ["DATA_PARALLEL", "MeshLayout", "check_data_parallel", "check_layout", "check_tp_size"]

#: the data-parallel engines ``parallelize_model(data_parallel=...)`` accepts (None: no engine)
DATA_PARALLEL = ("fsdp", "ddp")

#: the mesh dim names autotp reads: the axis tensor parallelism runs on, and the data-parallel one
TP_AXIS, DP_AXIS = "tp", "dp"

_MESH_HINT = ("build it with torch.distributed.device_mesh.init_device_mesh(device, (dp, tp), "
              "mesh_dim_names=(\"dp\", \"tp\"))")


@dataclass(frozen=True)
class MeshLayout:
    """The checked layout: ``tp_size`` ranks per tensor-parallel group, ``dp_size`` replicas.
    ``mesh`` is the user's mesh (None: the whole world is the tp group), ``data_parallel`` the
    engine that averages gradients over ``mesh["dp"]`` (None: none)."""

    tp_size: int
    dp_size: int
    mesh: Any = None
    data_parallel: str | None = None

    def tp_group(self) -> Any:
        """The process group tensor parallelism runs on (None: the default group)."""
        return None if self.mesh is None else self.mesh[TP_AXIS].get_group()

    def dp_rank(self) -> int:
        """This rank's index along ``"dp"`` (0 without a mesh or a ``"dp"`` dim)."""
        dp = self.dp_mesh()
        return 0 if dp is None else int(dp.get_local_rank())

    def dp_mesh(self) -> Any:
        """The 1-D data-parallel sub-mesh (None without a ``"dp"`` dim)."""
        if self.mesh is None or DP_AXIS not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh[DP_AXIS]


def check_data_parallel(value: Any) -> str | None:
    """``data_parallel`` as given, or an AutoTPError naming the values that exist."""
    if value is None or value in DATA_PARALLEL:
        return value
    raise AutoTPError(
        f"data_parallel={value!r} is not a data-parallel engine; use one of {list(DATA_PARALLEL)} "
        "(torch's FSDP2 fully_shard or DistributedDataParallel over mesh[\"dp\"]) or None"
    )


def check_layout(mesh: Any, world_size: int, data_parallel: Any) -> MeshLayout:
    """Check the mesh and ``data_parallel`` against the world, before any file is read.

    ``mesh=None``: the whole world is the tp group, and ``data_parallel`` needs a mesh. With a
    mesh: its dims are named ``"tp"`` (and ``"dp"``, which ``data_parallel`` needs; a 1-D
    ``("tp",)`` mesh is allowed) and it covers every rank of the world once.
    """
    data_parallel = check_data_parallel(data_parallel)
    if mesh is None:
        if data_parallel is not None:
            raise AutoTPError(
                f"data_parallel={data_parallel!r} needs a device mesh with a \"dp\" dim: pass "
                f"mesh=...; {_MESH_HINT}"
            )
        return MeshLayout(tp_size=world_size, dp_size=1)
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise AutoTPError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}; {_MESH_HINT}")
    names = tuple(mesh.mesh_dim_names or ())
    allowed = ((TP_AXIS,), (DP_AXIS, TP_AXIS))
    if names not in allowed:
        raise AutoTPError(
            f"the device mesh has dims {names or '(unnamed)'}; autotp needs them named (\"dp\", \"tp\") "
            f"(or (\"tp\",) alone): tensor parallelism runs on mesh[\"tp\"], data parallelism on "
            f"mesh[\"dp\"]; {_MESH_HINT}"
        )
    shape = dict(zip(names, (int(s) for s in mesh.mesh.shape), strict=True))
    tp, dp = shape[TP_AXIS], shape.get(DP_AXIS, 1)
    if dp * tp != world_size or int(mesh.mesh.numel()) != world_size:
        raise AutoTPError(
            f"the device mesh is dp={dp} x tp={tp} = {dp * tp} ranks but the world has {world_size}; "
            f"the mesh must hold every rank once: launch with `torchrun --nproc-per-node {dp * tp}` "
            "or build the mesh with dp x tp equal to the world size"
        )
    if data_parallel is not None and DP_AXIS not in names:
        raise AutoTPError(
            f"data_parallel={data_parallel!r} needs a \"dp\" dim in the device mesh, which has dims {names}; "
            f"{_MESH_HINT}"
        )
    return MeshLayout(tp_size=tp, dp_size=dp, mesh=mesh, data_parallel=data_parallel)


def check_tp_size(layout: MeshLayout, tp_size: int | None) -> None:
    """A ``tp_size`` the user gave must be the tp group's size: the world's without a mesh (run
    after the config's divisibility check, which names the valid sizes), ``mesh["tp"]``'s with one."""
    if tp_size is None or tp_size == layout.tp_size:
        return
    if layout.mesh is not None:
        raise AutoTPError(f"tp_size={tp_size} disagrees with the mesh's \"tp\" dim ({layout.tp_size}); "
                          "pass one of them")
    raise AutoTPError(
        f"tp_size={tp_size} but the process group has {layout.tp_size} ranks; launch with "
        f"`torchrun --nproc-per-node {tp_size}` (without a mesh autotp uses the whole group for tensor "
        f"parallelism), or pass mesh=... with a \"tp\" dim of {tp_size} and a \"dp\" dim for the other "
        f"ranks; {_MESH_HINT}"
    )
