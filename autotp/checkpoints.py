"""Training checkpoints of a parallelized model: save / resume at any tp and dp size, and a full export.

* :func:`save_checkpoint` / :func:`load_checkpoint` — the training state (every parameter, the
  optimizer's per-parameter state, the random generator) saved at one tp x dp layout and resumed
  at any other: a tp=2 run continues at tp=4, a DDP mesh continues on one tp group.
* :func:`save_pretrained` — a plain transformers checkpoint (config, safetensors, index), gathered
  one tensor at a time and written by rank 0, that ``AutoModelForCausalLM.from_pretrained`` loads,
  and that ``parallelize_model`` loads again at any tp size.

Design: the one-process layout, keyed by FQN, not ``torch.distributed.checkpoint``
==================================================================================

A checkpoint holds every tensor as one process would hold it (the full parameter, the full
``exp_avg``), under the model's own names, so it does not depend on the layout that wrote it: a
rank resumes by reading *its* rows of each tensor for the placement its own plan chose, exactly as
``parallelize_model`` reads a rank's slices of the weights (``ParameterMeta.load_local``, one read
per contiguous run; a fused ``StridedShard`` reads chunk ``rank`` of each segment). The placement
may differ between the two runs (another tp, another plan) without any resharding logic.

Why not DCP: ``torch.distributed.checkpoint`` reshards DTensors, so every local shard would have
to be wrapped as one, and the fused layouts autotp stores (``StridedShard``: rank ``r`` holds chunk
``r`` of *each* segment of a ``q | k | v`` weight, segments unequal under GQA) have no DTensor
placement (``_StridedShard`` is private and assumes equal segments): DCP would take them for plain
chunks and reshard them silently wrong. The price of the full layout is the save: each tensor is
all-gathered over the tp group (one full tensor per rank at a time, as :func:`save_pretrained`)
and written by one rank, where DCP writes in parallel; the load reads only a rank's rows.

    <folder>/autotp_checkpoint.json   format; the layout that saved it (tp, dp); per parameter its
                                      global shape, dtype and tied names; the optimizer's class,
                                      param groups (by parameter name) and non-tensor state
    <folder>/state.safetensors        ``model/<fqn>`` full parameters, ``optimizer/<fqn>/<state>``
                                      full states, ``rng/<generator>`` (tp rank 0 of dp replica 0
                                      writes it, streamed one tensor at a time)

Optimizer state: a tensor state of its parameter's local shape (Adam's moments, SGD's momentum:
elementwise) is the shard of the one-process state and is gathered and resharded with the
parameter; a 0-dim one (Adam's ``step``) is alike on every rank and saved once; any other shape
(a factored state) cannot be resharded by position and is refused at save with its name. State is
keyed by parameter name, not position, so param groups may list the parameters in any order, as
long as they hold the same ones.

Random state: the default CPU generator (and the current CUDA device's) is the replicated stream,
alike on every rank of a tp group by construction (``autotp/rng.py``: each sharded region's
per-rank stream is derived from it at every draw), so one saved state resumes every rank of any
layout; it is restored unless ``rng=False``. On a mesh, dp replicas resume with replica 0's state.

Buffers are not saved: in the models autotp serves they are constants rebuilt from the config
(rotary frequencies, position ids). Under FSDP2 each parameter and state (a ``DTensor`` split
again over ``mesh["dp"]``) is first all-gathered over dp, and a load keeps this dp rank's chunk.

The export gathers one parameter at a time to every rank (the all-gather the collectives already
have), reassembles fused layouts segment by segment, and rank 0 streams it into a safetensors file
(``autotp/safetensors_writer.py``) split into ``max_shard_size`` files by huggingface_hub's own
planner: peak memory is one full tensor per rank above the model's shards. A tied group is written
once, under its first name (``model.embed_tokens.weight``), as transformers saves it; the config's
``tie_word_embeddings`` ties it again on load.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autotp.collectives import Comm, barrier, full_tensor
from autotp.context import TPContext, meta_of
from autotp.errors import AutoTPError, CheckpointError
from autotp.placement import GroupedShard, HeadShard, Shard
from autotp.safetensors_writer import SafetensorsWriter
from autotp.weights import Checkpoint, ParameterMeta

__all__ = ["load_checkpoint", "save_checkpoint", "save_pretrained"]

FORMAT = "autotp-full-v2"
INDEX_NAME = "autotp_checkpoint.json"
STATE_NAME = "state.safetensors"

#: one tensor of the saved state: its name in the file, this rank's value, and the meta of the
#: parameter whose placement it shares (None: the value is whole on every rank)
_Entry = tuple[str, torch.Tensor, ParameterMeta | None]


def _context(model: torch.nn.Module, what: str) -> TPContext:
    handle = getattr(model, "autotp", None)
    if handle is None:
        raise AutoTPError(f"{what} needs a model returned by autotp.parallelize_model (it has .autotp)")
    return handle.context


def _replicas(model: torch.nn.Module) -> tuple[int, Comm | None]:
    """On a device mesh: this rank's dp index (dp replica 0 writes; under DDP every replica holds
    the same shards, under FSDP2 each tensor is first gathered over dp, :func:`_over_tp`) and a
    communicator over the whole world (its barrier waits for the writers); without a mesh
    ``(0, None)``."""
    layout = getattr(model.autotp, "layout", None)
    if layout is None or layout.mesh is None:
        return 0, None
    return layout.dp_rank(), Comm.from_default_group()


def _over_tp(value: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``value`` over tensor parallelism: FSDP2's ``DTensor`` (a parameter
    or its optimizer state, split again over ``mesh["dp"]``) all-gathered over dp (every rank of
    the dp group joins), anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _into(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's tensor-parallel piece) laid out like ``target``: for FSDP2's
    ``DTensor``, this dp rank's ``Shard(0)`` chunk as a ``DTensor`` on the same mesh."""
    if not isinstance(target, DTensor):
        return value
    mesh = target.device_mesh
    chunk = value.chunk(mesh.size(), 0)[mesh.get_local_rank()]  # DTensor's Shard(0): torch.chunk
    return DTensor.from_local(chunk.contiguous(), mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())


def _parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, ParameterMeta]]:
    """Each parameter once (a tied group under its first name), with its placed ``ParameterMeta``."""
    for fqn, p in model.named_parameters():
        meta = meta_of(p)
        owned = meta is not None and (meta.local is p or isinstance(p, DTensor))  # FSDP2: the dp shard
        if meta is None or meta.placement is None or not owned:
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


def _optimizer_entries(optimizer: torch.optim.Optimizer,
                       params: list[tuple[str, torch.nn.Parameter, ParameterMeta]]) -> tuple[list[_Entry], dict[str, Any]]:
    """The optimizer's tensor states as entries (see the module docstring for which are resharded)
    and what the index keeps of the rest: class, param groups by name, non-tensor state."""
    by_name = {fqn: (p, meta) for fqn, p, meta in params}
    order = _optimizer_names(optimizer, {id(p): fqn for fqn, p, _ in params})
    state = optimizer.state_dict()
    entries: list[_Entry] = []
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        fqn = order[index]
        p, meta = by_name[fqn]
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                scalars.setdefault(fqn, {})[key] = value
            elif value.shape == p.shape:
                entries.append((f"optimizer/{fqn}/{key}", value, meta))  # elementwise: sharded like p
            elif value.dim() == 0:
                entries.append((f"optimizer/{fqn}/{key}", value, None))  # alike on every rank
            else:
                raise AutoTPError(
                    f"{type(optimizer).__name__} state {key!r} of {fqn} has shape {tuple(value.shape)}, neither "
                    f"its parameter's ({tuple(p.shape)}) nor a scalar, so it cannot be saved in a layout any "
                    "tp size can resume from. Use an elementwise optimizer (AdamW, SGD) or save its state yourself"
                )
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[i] for i in g["params"]]}
              for g in state["param_groups"]]
    return entries, {"class": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}


def _write_full(path: Path, entries: Sequence[_Entry], comm: Comm, writes: bool,
                metadata: dict[str, str] | None = None) -> None:
    """Gather each entry to its full tensor (every rank of the tp group joins, in entry order)
    and, when ``writes``, stream it into the safetensors file ``path``: one full tensor at a time."""
    writer = None
    if writes:
        specs = {name: (meta.global_shape if meta is not None else tuple(t.shape), t.dtype)  # DTensor: over dp
                 for name, t, meta in entries}
        writer = SafetensorsWriter(path, specs, metadata or {"format": "pt"})
    try:
        for name, t, meta in entries:
            piece = _over_tp(t.detach())
            full = _full_tensor(piece, meta, comm) if meta is not None else piece
            if writer is not None:
                writer.write(name, full)
            del full
    finally:
        if writer is not None:
            writer.close()


def save_checkpoint(model: torch.nn.Module, folder: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True) -> Path:
    """Save the training state into ``folder`` in the one-process layout (call on every rank; see
    the module docstring), so that :func:`load_checkpoint` resumes it at any tp and dp size.
    Returns the folder."""
    ctx = _context(model, "save_checkpoint")
    comm = ctx.comm
    replica, everyone = _replicas(model)
    folder = Path(folder)
    params = list(_parameters(model))
    entries: list[_Entry] = [(f"model/{fqn}", p, meta) for fqn, p, meta in params]
    layout = getattr(model.autotp, "layout", None)
    index: dict[str, Any] = {
        "format": FORMAT,
        "saved_at": {"tp": ctx.world_size, "dp": layout.dp_size if layout is not None else 1},
        "parameters": {fqn: {"global_shape": list(meta.global_shape), "dtype": str(p.dtype).removeprefix("torch."),
                             "tied": list(meta.tied)} for fqn, p, meta in params},
    }
    if optimizer is not None:
        optimizer_entries, index["optimizer"] = _optimizer_entries(optimizer, params)
        entries += optimizer_entries
    if rng:
        entries += [(name, t, None) for name, t in _rng_tensors(ctx).items()]
    writes = ctx.rank == 0 and replica == 0  # one writer: tp rank 0 of dp replica 0
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
    # every replica joins the gathers (FSDP2's over dp need every rank; DDP's replicas only repeat them)
    _write_full(folder / STATE_NAME, entries, comm, writes)
    if writes:  # last: a folder with the index holds a whole checkpoint
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=1, default=_json_default) + "\n")
    barrier(everyone or comm)  # every file is complete when any rank returns
    return folder


def _read_index(folder: Path) -> dict[str, Any]:
    path = folder / INDEX_NAME
    if not path.is_file():
        raise CheckpointError(f"{folder} is not an autotp checkpoint: {INDEX_NAME} is missing "
                              "(write one with autotp.save_checkpoint)")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r} (a checkpoint of "
                              "an older autotp: resume it with that version, or export it with save_pretrained)")
    if not (folder / STATE_NAME).is_file():
        raise CheckpointError(f"{folder / STATE_NAME} is missing: the save did not finish")
    return index


def _check_parameters(folder: Path, index: dict[str, Any],
                      params: list[tuple[str, torch.nn.Parameter, ParameterMeta]]) -> None:
    saved = index["parameters"]
    problems = []
    for fqn, _, meta in params:
        entry = saved.get(fqn)
        if entry is None:
            problems.append(f"{fqn} is not in the checkpoint")
        elif tuple(entry["global_shape"]) != meta.global_shape:
            problems.append(f"{fqn} was saved with shape {tuple(entry['global_shape'])}, the model has "
                            f"{meta.global_shape}")
    extra = set(saved) - {fqn for fqn, _, _ in params}
    problems += [f"{fqn} is in the checkpoint but not in the model" for fqn in sorted(extra)]
    if problems:
        raise AutoTPError(f"{folder} does not match this model: {'; '.join(problems[:5])}. Load it into a "
                          "model built from the same config.")


def _read_local(state: Checkpoint, name: str, meta: ParameterMeta | None, rank: int, world: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows of the saved full tensor ``name`` for ``meta``'s placement (into ``out``
    when given), read as ``parallelize_model`` reads weights: only those rows."""
    if meta is None:
        value = state.read(name)
        return value if out is None else out.copy_(value)
    stored = dataclasses.replace(meta, checkpoint=state, checkpoint_key=name, dtype=state.dtype(name), local=None)
    return stored.load_local(rank, world, out=out)


def load_checkpoint(model: torch.nn.Module, folder: str | os.PathLike,
                    optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True) -> None:
    """Load what :func:`save_checkpoint` wrote into ``model`` (in place) and ``optimizer``, on
    every rank, at any tp and dp size: each rank reads its rows of every tensor for the placement
    it holds the parameter at."""
    ctx = _context(model, "load_checkpoint")
    rank, world = ctx.rank, ctx.world_size
    _replicas(model)  # every dp replica reads the same file
    folder = Path(folder)
    index = _read_index(folder)
    params = list(_parameters(model))
    _check_parameters(folder, index, params)
    with Checkpoint(folder / STATE_NAME) as state:
        with torch.no_grad():
            for fqn, p, meta in params:  # in place: compiled graphs bind this Parameter
                if isinstance(p, DTensor):  # FSDP2: this dp rank's rows of the tp piece
                    p.to_local().copy_(_into(p, _read_local(state, f"model/{fqn}", meta, rank, world)).to_local())
                else:
                    _read_local(state, f"model/{fqn}", meta, rank, world, out=p.data)
        if optimizer is not None:
            _load_optimizer(optimizer, state, index, params, rank, world, folder)
        if rng:
            _restore_rng({k: state.read(k) for k in state.keys() if k.startswith("rng/")})


def _load_optimizer(optimizer: torch.optim.Optimizer, state: Checkpoint, index: dict[str, Any],
                    params: list[tuple[str, torch.nn.Parameter, ParameterMeta]], rank: int, world: int,
                    folder: Path) -> None:
    saved = index.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{folder} holds no optimizer state (save_checkpoint was called without one)")
    if saved["class"] != type(optimizer).__name__:
        raise AutoTPError(f"{folder} holds {saved['class']} state, the optimizer is {type(optimizer).__name__}")
    order = _optimizer_names(optimizer, {id(p): fqn for fqn, p, _ in params})
    position = {fqn: i for i, fqn in enumerate(order)}
    by_name = {fqn: (p, meta) for fqn, p, meta in params}
    current = optimizer.state_dict()["param_groups"]
    if [sorted(g["params"]) for g in saved["param_groups"]] != [sorted(order[i] for i in g["params"])
                                                               for g in current]:
        raise AutoTPError(f"{folder}: the optimizer's param groups hold other parameters than when it was saved")
    groups = []
    for saved_group, group in zip(saved["param_groups"], current, strict=True):
        restored = {k: (tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v)
                    for k, v in saved_group.items() if k != "params"}
        groups.append({**group, **restored, "params": group["params"]})
    values: dict[int, dict[str, Any]] = {}
    for key in state.keys():
        if key.startswith("optimizer/"):
            fqn, _, name = key.removeprefix("optimizer/").rpartition("/")
            p, meta = by_name[fqn]
            if state.shape(key) == meta.global_shape:  # elementwise: sharded like its parameter
                value = _into(p, _read_local(state, key, meta, rank, world))
            else:  # a scalar, alike on every rank
                value = _read_local(state, key, None, rank, world)
            values.setdefault(position[fqn], {})[name] = value
    for fqn, scalars in saved["scalars"].items():
        values.setdefault(position[fqn], {}).update(scalars)
    optimizer.load_state_dict({"state": values, "param_groups": groups})


# --------------------------------------------------------------------------------------------------
# Full transformers export
# --------------------------------------------------------------------------------------------------


def _full_tensor(local: torch.Tensor, meta: ParameterMeta, comm: Comm) -> torch.Tensor:
    """The whole parameter, on every rank, from the ranks' local shards."""
    placement = meta.placement
    if not isinstance(placement, (Shard, GroupedShard, HeadShard)):  # grouped: kv heads held per group of ranks
        return local.detach()
    size = meta.global_shape[placement.dim] if isinstance(placement, Shard) else None  # uneven: trimmed
    return full_tensor(local.detach(), placement, comm, size=size)


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
    for filename, names in split.filename_to_tensors.items():  # every rank joins each gather
        _write_full(folder / filename, [(name, *values[name]) for name in names], comm, writes)
    barrier(everyone or comm)  # the writer has finished when any rank returns
    return folder
