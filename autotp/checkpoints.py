"""Training checkpoints of a parallelized model: sharded save / reload, and a full export.

* :func:`save_checkpoint` / :func:`load_checkpoint` — the training state as the ranks hold it
  (every parameter's local shard, the optimizer's per-parameter state, the random generators), to
  reload at the **same** tp size and continue training bit for bit.
* :func:`save_pretrained` — a plain transformers checkpoint (config, safetensors, index), gathered
  one tensor at a time and written by rank 0, that ``AutoModelForCausalLM.from_pretrained`` loads,
  and that ``parallelize_model`` loads again at any tp size.

Design: per-rank safetensors, not ``torch.distributed.checkpoint``
==================================================================

DCP saves DTensors and ShardedTensors and reshards on load; a plain tensor it takes for a
replicated value (rank 0's copy wins). Using it would mean wrapping every local shard into a
DTensor for the save and back for the load. That fits ``Shard(d)`` but not the fused layouts
autotp stores (``StridedShard``: rank ``r`` holds chunk ``r`` of *each* segment of a fused
``q | k | v`` weight), which have no public DTensor placement: DCP would write them as if they were
plain chunks, silently wrong for a reshard. Its one gain, loading at another tp size, would also
need the optimizer state resharded with the same care. So autotp writes what each rank holds,
described by the ``ParameterMeta`` that placed it:

    <folder>/autotp_checkpoint.json                  world size; per parameter: placement
                                                     (``S(1|64+64+64)`` for fused), global shape,
                                                     dtype, tied names (rank 0 writes it)
    <folder>/rank-0000r-of-0000N.safetensors         rank r: ``model/<fqn>`` local shards,
                                                     ``optimizer/<fqn>/<state>`` tensors,
                                                     ``rng/<generator>`` states; the header's
                                                     metadata holds the optimizer's param groups
                                                     and any non-tensor state, by parameter name

A reload checks the world size and every parameter's placement against the running model (which
``parallelize_model`` planned the same way from the same config) and copies each shard **in place**
into the existing local ``Parameter`` (compiled graphs bind those objects). Optimizer state is keyed
by parameter name, not by position, so a reload works whatever order the user's param groups list
the parameters in, as long as they hold the same ones. Changing tp goes through
:func:`save_pretrained` (optimizer state is not resharded). Buffers are not saved: in the models
autotp serves they are constants rebuilt from the config (rotary frequencies, position ids).

Random state is part of the training state: with dropout, the continued run draws the same masks
only if every generator resumes where it stopped. The default CPU generator (and the current CUDA
device's) are saved per rank and restored unless ``rng=False``; the per-rank streams of sharded
regions are derived from them at each draw (``autotp/rng.py``), so they resume too.

The export gathers one parameter at a time to every rank (the all-gather the collectives already
have), reassembles fused layouts segment by segment, and rank 0 streams it into a safetensors file
(``autotp/safetensors_writer.py``) split into ``max_shard_size`` files by huggingface_hub's own
planner: peak memory is one full tensor per rank above the model's shards. A tied group is written
once, under its first name (``model.embed_tokens.weight``), as transformers saves it; the config's
``tie_word_embeddings`` ties it again on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from autotp.collectives import Comm, barrier, full_tensor
from autotp.context import TPContext, meta_of
from autotp.errors import AutoTPError, CheckpointError
from autotp.placement import Shard
from autotp.safetensors_writer import SafetensorsWriter
from autotp.weights import ParameterMeta

__all__ = ["load_checkpoint", "save_checkpoint", "save_pretrained"]

FORMAT = "autotp-sharded-v1"
INDEX_NAME = "autotp_checkpoint.json"


def _rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def _context(model: torch.nn.Module, what: str) -> TPContext:
    handle = getattr(model, "autotp", None)
    if handle is None:
        raise AutoTPError(f"{what} needs a model returned by autotp.parallelize_model (it has .autotp)")
    return handle.context


def _replicas(model: torch.nn.Module) -> tuple[int, Comm | None]:
    """On a device mesh: this rank's dp index (dp replica 0 writes, every replica holds the same
    shards) and a communicator over the whole world (its barrier waits for the writers); without
    a mesh ``(0, None)``. FSDP2's dp shards are refused: they are not the local shards this
    format describes."""
    layout = getattr(model.autotp, "layout", None)
    if layout is None or layout.mesh is None:
        return 0, None
    if layout.data_parallel == "fsdp":
        raise AutoTPError(
            "save_checkpoint / load_checkpoint / save_pretrained do not support data_parallel=\"fsdp\" yet: "
            "FSDP2 holds each tp shard split again over dp. Train with data_parallel=\"ddp\" to use them, "
            "or save FSDP2's state with torch.distributed.checkpoint on each tp group"
        )
    return layout.dp_rank(), Comm.from_default_group()


def _parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, ParameterMeta]]:
    """Each parameter once (a tied group under its first name), with its placed ``ParameterMeta``."""
    for fqn, p in model.named_parameters():
        meta = meta_of(p)
        if meta is None or meta.placement is None or meta.local is not p:
            raise AutoTPError(
                f"{fqn} is not a placed local shard (call the model once, e.g. parallelize_model's "
                "warm-up, before saving or loading a checkpoint)"
            )
        yield fqn, p, meta


# --------------------------------------------------------------------------------------------------
# Sharded training state
# --------------------------------------------------------------------------------------------------


def _optimizer_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The parameter name of each position ``optimizer.state_dict()`` numbers (param group order)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise AutoTPError(
                    "the optimizer holds a tensor that is not a parameter of this model; build it over "
                    "model.parameters() (the local shards)"
                )
            out.append(names[id(p)])
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise AutoTPError(f"optimizer setting {value!r} ({type(value).__name__}) cannot be saved in a checkpoint")


def _rng_tensors(ctx: TPContext) -> dict[str, torch.Tensor]:
    out = {"rng/cpu": torch.get_rng_state()}
    if ctx.comm.backend == "nccl" and torch.cuda.is_available():
        out["rng/cuda"] = torch.cuda.get_rng_state()
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    if "rng/cpu" in tensors:
        torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])


def save_checkpoint(model: torch.nn.Module, folder: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True) -> Path:
    """Save this rank's training state into ``folder`` (call on every rank; see the module
    docstring for the layout). Returns the folder."""
    ctx = _context(model, "save_checkpoint")
    comm, rank, world = ctx.comm, ctx.rank, ctx.world_size
    replica, everyone = _replicas(model)
    folder = Path(folder)
    params = list(_parameters(model))
    names = {id(p): fqn for fqn, p, _ in params}
    tensors: dict[str, torch.Tensor] = {f"model/{fqn}": p.detach() for fqn, p, _ in params}
    meta_json: dict[str, Any] = {"format": FORMAT, "rank": rank, "world_size": world}
    if optimizer is not None:
        state = optimizer.state_dict()
        order = _optimizer_names(optimizer, names)
        scalars: dict[str, dict[str, Any]] = {}
        for index, values in state["state"].items():
            fqn = order[index]
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{fqn}/{key}"] = value.detach()
                else:
                    scalars.setdefault(fqn, {})[key] = value
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
                  for g in state["param_groups"]]
        meta_json["optimizer"] = {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}
    if rng:
        tensors.update(_rng_tensors(ctx))

    if replica != 0:  # dp replicas hold the same shards: replica 0 writes them
        barrier(everyone)
        return folder
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        index = {
            "format": FORMAT,
            "world_size": world,
            "parameters": {fqn: {"placement": str(meta.placement), "global_shape": list(meta.global_shape),
                                 "dtype": str(p.dtype).removeprefix("torch."), "tied": list(meta.tied)}
                           for fqn, p, meta in params},
        }
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
    barrier(comm)  # the folder exists before the other ranks write into it
    specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    metadata = {"format": "pt", "autotp": json.dumps(meta_json, default=_json_default)}
    with SafetensorsWriter(folder / _rank_file(rank, world), specs, metadata) as writer:
        for name, t in tensors.items():
            writer.write(name, t)
    barrier(everyone or comm)  # every file is complete when any rank returns
    return folder


def _read_index(folder: Path, world: int) -> dict[str, Any]:
    path = folder / INDEX_NAME
    if not path.is_file():
        raise CheckpointError(f"{folder} is not an autotp checkpoint: {INDEX_NAME} is missing "
                              "(write one with autotp.save_checkpoint)")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
    if index["world_size"] != world:
        raise AutoTPError(
            f"{folder} was saved at tp={index['world_size']} and this model runs at tp={world}: a sharded "
            f"checkpoint reloads only at the same tp size. Launch {index['world_size']} ranks, or export it "
            "with autotp.save_pretrained and parallelize_model the export (optimizer state is not resharded)"
        )
    return index


def load_checkpoint(model: torch.nn.Module, folder: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True) -> None:
    """Load what :func:`save_checkpoint` wrote into ``model`` (in place) and ``optimizer``, on
    every rank, at the tp size it was saved with."""
    ctx = _context(model, "load_checkpoint")
    rank, world = ctx.rank, ctx.world_size
    _replicas(model)  # every dp replica reads the same files
    folder = Path(folder)
    index = _read_index(folder, world)
    params = list(_parameters(model))
    saved = index["parameters"]
    problems = []
    for fqn, _, meta in params:
        entry = saved.get(fqn)
        if entry is None:
            problems.append(f"{fqn} is not in the checkpoint")
        elif entry["placement"] != str(meta.placement) or tuple(entry["global_shape"]) != meta.global_shape:
            problems.append(f"{fqn} was saved {entry['placement']} {tuple(entry['global_shape'])}, the model "
                            f"holds it {meta.placement} {meta.global_shape}")
    extra = set(saved) - {fqn for fqn, _, _ in params}
    problems += [f"{fqn} is in the checkpoint but not in the model" for fqn in sorted(extra)]
    if problems:
        raise AutoTPError(f"{folder} does not match this model: {'; '.join(problems[:5])}. Load it into the "
                          "model it was saved from (same config, same tp, same overrides).")
    path = folder / _rank_file(rank, world)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: every rank's file is needed")
    with safe_open(os.fspath(path), framework="pt") as f:
        meta_json = json.loads((f.metadata() or {}).get("autotp", "{}"))
        if meta_json.get("rank") != rank:
            raise CheckpointError(f"{path} says it holds rank {meta_json.get('rank')}, not rank {rank}")
        with torch.no_grad():
            for fqn, p, _ in params:
                p.copy_(f.get_tensor(f"model/{fqn}"))  # in place: compiled graphs bind this Parameter
        if optimizer is not None:
            _load_optimizer(optimizer, f, meta_json, {id(p): fqn for fqn, p, _ in params}, path)
        if rng:
            _restore_rng({k: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")})


def _load_optimizer(optimizer: torch.optim.Optimizer, f: Any, meta_json: dict[str, Any],
                    names: dict[int, str], path: Path) -> None:
    saved = meta_json.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{path} holds no optimizer state (save_checkpoint was called without one)")
    if saved["class"] != type(optimizer).__name__:
        raise AutoTPError(f"{path} holds {saved['class']} state, the optimizer is {type(optimizer).__name__}")
    order = _optimizer_names(optimizer, names)
    position = {fqn: i for i, fqn in enumerate(order)}
    current = optimizer.state_dict()["param_groups"]
    if [sorted(g["params"]) for g in saved["param_groups"]] != [sorted(order[i] for i in g["params"])
                                                               for g in current]:
        raise AutoTPError(f"{path}: the optimizer's param groups hold other parameters than when it was saved")
    groups = []
    for saved_group, group in zip(saved["param_groups"], current, strict=True):
        restored = {k: (tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v)
                    for k, v in saved_group.items() if k != "params"}
        groups.append({**group, **restored, "params": group["params"]})
    state: dict[int, dict[str, Any]] = {}
    for key in f.keys():
        if key.startswith("optimizer/"):
            fqn, _, name = key.removeprefix("optimizer/").rpartition("/")
            state.setdefault(position[fqn], {})[name] = f.get_tensor(key)
    for fqn, values in saved["scalars"].items():
        state.setdefault(position[fqn], {}).update(values)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# --------------------------------------------------------------------------------------------------
# Full transformers export
# --------------------------------------------------------------------------------------------------


def _full_tensor(local: torch.Tensor, meta: ParameterMeta, comm: Comm) -> torch.Tensor:
    """The whole parameter, on every rank, from the ranks' local shards."""
    placement = meta.placement
    if not isinstance(placement, Shard):
        return local.detach()
    return full_tensor(local.detach(), placement, comm, size=meta.global_shape[placement.dim])


def save_pretrained(model: torch.nn.Module, folder: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB") -> Path:
    """Export the full model as a transformers checkpoint in ``folder`` (call on every rank; rank 0
    writes). ``from_pretrained(folder)`` loads it; so does ``parallelize_model`` at any tp size."""
    from huggingface_hub import split_torch_state_dict_into_shards

    ctx = _context(model, "save_pretrained")
    comm = ctx.comm
    replica, everyone = _replicas(model)
    writes = ctx.rank == 0 and replica == 0  # one writer: tp rank 0 of dp replica 0
    folder = Path(folder)
    values: dict[str, tuple[torch.Tensor, ParameterMeta | None]] = {
        fqn: (p, meta) for fqn, p, meta in _parameters(model)}
    persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
    for name, buf in model.named_buffers():
        if name in persistent and buf.device.type != "meta":
            values[name] = (buf, None)
    stand_ins = {name: torch.empty(meta.global_shape if meta else t.shape, dtype=t.dtype, device="meta")
                 for name, (t, meta) in values.items()}
    split = split_torch_state_dict_into_shards(stand_ins, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "config", None)
        if config is None:
            raise AutoTPError("save_pretrained exports transformers models (the model has no .config)")
        config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for filename, names in split.filename_to_tensors.items():
        writer = None
        if writes:
            specs = {n: (tuple(stand_ins[n].shape), stand_ins[n].dtype) for n in names}
            writer = SafetensorsWriter(folder / filename, specs, {"format": "pt"})
        try:
            for name in names:
                t, meta = values[name]
                full = _full_tensor(t, meta, comm) if meta is not None else t.detach()  # every rank joins
                if writer is not None:
                    writer.write(name, full)
                del full
        finally:
            if writer is not None:
                writer.close()
    barrier(everyone or comm)  # the writer has finished when any rank returns
    return folder
