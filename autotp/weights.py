"""Checkpoints and per-parameter metadata: where every weight lives and which slice each rank reads.

Design
======

``parallelize_model("org/name" or "/local/dir")`` never builds a full-size model in memory. It

1. **resolves files** (:func:`resolve_checkpoint`): a local folder is used as is and never written
   into; anything else is a Hub id resolved by ``huggingface_hub.snapshot_download`` (its cache
   layout, ``HF_HUB_OFFLINE`` / ``local_files_only`` and token handling are huggingface_hub's, not
   ours). Only configs, tokenizer files and one copy of the weights are fetched (safetensors, else
   ``pytorch_model*.bin``); huggingface_hub locks each file while it downloads it, so ranks that
   resolve at once never write one file twice. The download runs in
   two steps so that a repo holding both ``model-0000x-of-0000y.safetensors`` and a second copy in
   another layout (e.g. Mistral's ``consolidated.safetensors``) costs one copy: step one fetches the
   small files plus ``model.safetensors`` / the index, step two fetches exactly the shards the index
   names (pinned to the commit step one resolved), and only a repo without either falls back to
   ``*.safetensors``.
2. **builds the architecture on meta** (:func:`build_meta_model`): parameters on ``meta``, buffers
   real (accelerate's ``init_empty_weights`` keeps buffers off meta, so rotary ``inv_freq`` is
   computed exactly as in an eager model).
3. **describes every parameter** with a :class:`ParameterMeta`: global shape, dtype, checkpoint key
   (:func:`checkpoint_key`; names transformers renames or builds from several stored tensors on
   load, such as GPT-NeoX's ``embed_out`` or Mixtral's per-expert weights, come from transformers'
   own conversion mapping: :mod:`autotp.checkpoint_keys`, :meth:`Checkpoint.add_conversions_for`), tied group (:func:`tied_groups`), and, once the solver fixed it, its
   placement. ``ParameterMeta`` outlives graphs: later graphs solve with that placement pinned.
4. **materializes** each rank's shard (:meth:`ParameterMeta.load_local`): rank ``r`` of ``N`` reads
   only chunk ``r`` of ``torch.chunk(weight, N, dim)`` (readers in :mod:`autotp.weight_files`:
   positioned reads for safetensors, never a memory map, whose touched pages would count in the
   rank's RSS on top of the copy; a read-only mapping for ``.bin``), so peak memory per rank is
   about ``1/N`` of the sharded weights plus the replicated ones. In-memory models use
   :meth:`ParameterMeta.shard_from` instead; both cut with one slicing helper, so a sharded
   checkpoint and a sharded in-memory model agree bit for bit.

Slices follow ``torch.chunk`` semantics everywhere (chunk size ``ceil(size / N)``; trailing ranks
may get a short or even empty chunk), which is what the rule checks in ``tests/`` shard with.

:class:`Checkpoint` reads tensor names, shapes and dtypes from the file headers only, opens files
lazily, and counts what it reads (``bytes_read``, ``reads``) so tests can prove that a rank read
only its slices. Every read returns a fresh tensor that shares nothing with the file.

Surprises of this stack (torch 2.13, transformers 5.23, accelerate 1.15, huggingface_hub 2.4):

* ``accelerate.init_empty_weights`` re-wraps every parameter it sees registered, which breaks the
  ``lm_head.weight is embed_tokens.weight`` identity that transformers' ``tie_weights`` just
  created; ``find_tied_parameters`` then finds nothing. :func:`build_meta_model` re-ties after
  leaving the context, and :func:`tied_groups` also honours transformers' declared
  ``all_tied_weights_keys``, so models built elsewhere under ``init_empty_weights`` still group.
* ``huggingface_hub.constants.HF_HUB_OFFLINE`` is read once, at import; setting the environment
  variable later changes nothing (tests patch the constant too).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from autotp.checkpoint_files import bin_files as _bin_files
from autotp.checkpoint_files import safetensors_files as _safetensors_files
from autotp.checkpoint_keys import (
    Source,
    converted_sources,
    read_source,
    source_dtype,
    source_shape,
    stored_keys,
)
from autotp.errors import AutoTPError, CheckpointError, ShardingError
from autotp.placement import GroupedShard, HeadShard, Placement, Replicate, Shard, StridedShard, chunk_range
from autotp.weight_files import WeightFile, open_weight_file

__all__ = [
    "ALLOW_PATTERNS",
    "Checkpoint",
    "ParameterMeta",
    "SliceRead",
    "build_meta_model",
    "checkpoint_key",
    "chunk_range",
    "meta_buffers",
    "parameter_metas",
    "resolve_checkpoint",
    "tied_groups",
]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
BIN_WEIGHTS_NAME = "pytorch_model.bin"
BIN_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

#: Tokenizer files worth having next to the weights (``generate`` / the CLI need them).
TOKENIZER_PATTERNS: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_SMALL_FILES: tuple[str, ...] = (CONFIG_NAME, GENERATION_CONFIG_NAME, *TOKENIZER_PATTERNS)

#: Everything :func:`resolve_checkpoint` may fetch from the Hub (the union of its two steps).
ALLOW_PATTERNS: tuple[str, ...] = (
    *_SMALL_FILES, "*.safetensors", SAFE_WEIGHTS_INDEX_NAME, BIN_WEIGHTS_NAME, BIN_WEIGHTS_INDEX_NAME,
    "pytorch_model-*.bin",
)

_OTHER_WEIGHT_GLOBS = ("*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")


# --------------------------------------------------------------------------------------------------
# Resolving a model id or folder
# --------------------------------------------------------------------------------------------------


def resolve_checkpoint(
    model: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool = False,
    require_weights: bool = True,
    progress: bool = True,
) -> Path:
    """Return the folder holding ``model``'s config and safetensors weights.

    ``model`` is either an existing local folder (returned resolved, never written into) or a Hub id
    (``"org/name"``) fetched with ``huggingface_hub.snapshot_download`` into its usual cache
    (``cache_dir``, else ``HF_HUB_CACHE``). Offline mode (``HF_HUB_OFFLINE=1`` or
    ``local_files_only=True``) resolves from that cache only; huggingface_hub implements it.

    With ``require_weights=False`` a folder holding only ``config.json`` is accepted (planning from
    a config alone). ``progress=False`` silences huggingface_hub's download bars.

    Several processes on one machine (torchrun ranks) may call this at once: huggingface_hub holds a
    lock per file while it downloads it (``<cache>/.locks/<repo folder>/<blob>.lock``), so a file is
    fetched once and the others wait for it (autotp's own per-repo lock on top of that was dropped:
    it only serialized what the Hub's locks already make safe). Offline nothing is downloaded and no
    lock is taken, so a read-only shared cache works. Every failure is a
    :class:`~autotp.errors.CheckpointError` that names the id or folder and what to do.
    """
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        folder = path.resolve()
        _check_folder(folder, source=f"folder {folder}", require_weights=require_weights, repo_id=None)
        return folder
    if isinstance(model, os.PathLike) or _looks_like_path(text):
        what = "a file, not a folder" if path.exists() else "does not exist"
        raise CheckpointError(
            f"{text!r} {what}. Pass the folder written by save_pretrained (with config.json and "
            "model.safetensors), or a Hub id like 'org/name'."
        )
    folder = _download(
        text,
        revision=revision,
        cache_dir=cache_dir,
        token=token,
        local_files_only=local_files_only,
        progress=progress,
    )
    rev = f" (revision {revision!r})" if revision else ""
    _check_folder(folder, source=f"Hub repo {text!r}{rev}", require_weights=require_weights, repo_id=text)
    return folder


def _looks_like_path(text: str) -> bool:
    """A string meant as a filesystem path rather than a Hub id (``org/name`` has one slash)."""
    return (
        text.startswith((".", "/", "~"))
        or "\\" in text
        or text.count("/") > 1
        or (len(text) > 1 and text[1] == ":")  # Windows drive letter
    )


def _download(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: str | os.PathLike[str] | None,
    token: str | bool | None,
    local_files_only: bool,
    progress: bool = True,
) -> Path:
    """Fetch the small files, then exactly the weight files, with ``snapshot_download`` (see
    :func:`resolve_checkpoint`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
        validate_repo_id,
    )

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise CheckpointError(
            f"{repo_id!r} is neither an existing folder nor a valid Hub id ({e}). Pass a folder "
            "written by save_pretrained, or a Hub id like 'meta-llama/Llama-3.2-1B'."
        ) from e

    def fetch(patterns: Sequence[str], rev: str | None) -> Path:
        try:
            out = snapshot_download(
                repo_id,
                revision=rev,
                cache_dir=cache_dir,
                token=token,
                local_files_only=local_files_only,
                allow_patterns=list(patterns),
            )
        except Exception as e:  # every Hub failure becomes one actionable error
            raise _hub_error(repo_id, revision, cache_dir, e) from e
        return Path(out)

    was_disabled = are_progress_bars_disabled()
    with contextlib.ExitStack() as stack:
        if not progress and not was_disabled:
            disable_progress_bars()
            stack.callback(enable_progress_bars)
        return _fetch_weights(fetch, revision)


def _fetch_weights(fetch: Callable[[Sequence[str], str | None], Path], revision: str | None) -> Path:
    """Step one: small files + safetensors index / single file; step two: exactly the weights."""
    folder = fetch([*_SMALL_FILES, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME], revision)
    # The snapshot folder is named by the commit: pin step two to it (no second revision lookup).
    commit = folder.name
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        shard_files = sorted(set(_read_index(index).values()))
        if shard_files:
            folder = fetch(shard_files, commit)
    elif not (folder / SAFE_WEIGHTS_NAME).is_file():
        folder = fetch(["*.safetensors"], commit)
        if not _safetensors_files(folder):  # no safetensors at all: PyTorch pickles, index first
            folder = fetch([BIN_WEIGHTS_INDEX_NAME, BIN_WEIGHTS_NAME], commit)
            bin_index = folder / BIN_WEIGHTS_INDEX_NAME
            if bin_index.is_file():
                folder = fetch(sorted(set(_read_index(bin_index).values())), commit)
    return folder


def _hub_error(
    repo_id: str, revision: str | None, cache_dir: str | os.PathLike[str] | None, e: Exception
) -> CheckpointError:
    """Translate a huggingface_hub exception into a CheckpointError that says what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rev = revision or "main"
    cache = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    if isinstance(e, IncompleteSnapshotError):
        msg = (
            f"the cached snapshot of {repo_id!r} (revision {rev!r}) in {cache} is incomplete. Re-run "
            f"with network access (`hf download {repo_id}`), or with force_download=True if files are "
            "corrupt."
        )
    elif isinstance(e, LocalEntryNotFoundError):
        msg = (
            f"{repo_id!r} (revision {rev!r}) is not in the Hugging Face cache at {cache} and downloads "
            "are disabled (HF_HUB_OFFLINE=1 or local_files_only=True). Download it once with network "
            f"access (`hf download {repo_id}`), point cache_dir / HF_HUB_CACHE at the cache that holds "
            "it, or pass a local folder."
        )
    elif isinstance(e, GatedRepoError):
        msg = (
            f"{repo_id!r} is gated: accept its license on https://huggingface.co/{repo_id}, then pass "
            "token=... or run `hf auth login`."
        )
    elif isinstance(e, RepositoryNotFoundError):
        msg = (
            f"no Hub repo {repo_id!r}: check the spelling; a private repo needs token=... or `hf auth login`."
        )
    elif isinstance(e, RevisionNotFoundError):
        msg = f"{repo_id!r} has no revision {rev!r}: pass an existing branch, tag or commit hash."
    elif isinstance(e, HfHubHTTPError | OSError):
        msg = (
            f"could not fetch {repo_id!r} (revision {rev!r}): {type(e).__name__}: {e}. Check the "
            "network, retry, or set HF_HUB_OFFLINE=1 to use the local cache only."
        )
    else:
        msg = f"resolving {repo_id!r} (revision {rev!r}) failed: {type(e).__name__}: {e}"
    return CheckpointError(msg)


def _check_folder(folder: Path, *, source: str, require_weights: bool, repo_id: str | None) -> None:
    """A resolved folder must hold config.json and (unless told otherwise) safetensors weights."""
    if not (folder / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"no {CONFIG_NAME} in {source} ({folder}): autotp builds the architecture from the "
            "transformers config. Pass the folder written by save_pretrained."
        )
    if not require_weights or _safetensors_files(folder) or _bin_files(folder):
        return
    others = sorted({p.name for g in _OTHER_WEIGHT_GLOBS for p in folder.glob(g)})
    if repo_id is not None:
        fix = (
            f"this repo has no safetensors or .bin weights at that revision. Many repos have a conversion "
            f"in a pull request (try revision='refs/pr/1', see https://huggingface.co/{repo_id}"
            "/discussions), or convert it yourself: "
            f"AutoModelForCausalLM.from_pretrained({repo_id!r}).save_pretrained(OUT) writes "
            "model.safetensors; then pass OUT."
        )
    elif others:
        fix = (
            f"it holds {', '.join(others[:4])} instead. Convert the checkpoint with "
            f"AutoModelForCausalLM.from_pretrained({os.fspath(folder)!r}).save_pretrained(OUT) (which "
            "writes model.safetensors) and pass OUT."
        )
    else:
        fix = (
            "pass a folder with model.safetensors (or model-*.safetensors plus "
            "model.safetensors.index.json); to plan from the config alone, without weights, run "
            f"`autotp plan {os.fspath(folder)} --tp N` (or autotp.planner.plan_model)."
        )
    raise CheckpointError(f"no safetensors files (nor pytorch_model*.bin) in {source} ({folder}): {fix}")


def _read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json`` (tensor name -> file name)."""
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index} is not a valid safetensors index ({type(e).__name__}: {e}): re-download it "
            "(snapshot_download(..., force_download=True)) or regenerate it with save_pretrained."
        ) from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names.")
    return {str(k): str(v) for k, v in weight_map.items()}


# --------------------------------------------------------------------------------------------------
# Checkpoint: names, shapes and dtypes from headers; sliced reads
# --------------------------------------------------------------------------------------------------

class SliceRead(NamedTuple):
    """One read: ``dim`` None is a full read (then ``start`` and ``stop`` are 0)."""

    name: str
    dim: int | None
    start: int
    stop: int


def _slice_index(ndim: int, dim: int | None, start: int, stop: int) -> tuple[slice, ...]:
    """The index selecting ``[start, stop)`` of ``dim`` (everything when ``dim`` is None).

    The one slicing helper: used on safetensors slices (checkpoint reads) and on in-memory tensors
    (:meth:`ParameterMeta.shard_from`), so both paths cut identical chunks.
    """
    if dim is None:
        return (slice(None),) * ndim
    return (slice(None),) * dim + (slice(start, stop),)


def _copy_out(view: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A fresh contiguous tensor holding ``view`` (converted to ``dtype``); one copy, no aliasing."""
    out = torch.empty(tuple(view.shape), dtype=dtype or view.dtype, device=view.device)
    out.copy_(view)
    return out


class Checkpoint:
    """A checkpoint folder: safetensors (one ``model.safetensors``, a sharded set with
    ``model.safetensors.index.json``, or every ``*.safetensors``) or, when it has none, PyTorch
    pickles (``pytorch_model.bin`` or a sharded set with ``pytorch_model.bin.index.json``).

    Names, shapes and dtypes come from the headers; no tensor data is read until
    :meth:`read` / :meth:`read_slice`. Files are opened on first use (readers in
    :mod:`autotp.weight_files`: ``pread`` for safetensors, a read-only mapping for ``.bin``) and
    cached; :meth:`close` (or leaving a ``with`` block) releases them, and a later read reopens
    lazily. Nothing is ever written into the folder.

    ``bytes_read`` counts the bytes of tensor data requested (in the stored dtype) and ``reads``
    records every request as a :class:`SliceRead`, so a test can prove a rank read only its slices.
    ``on_read`` (settable) is called with each :class:`SliceRead` (a progress bar's hook).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        path = Path(folder).expanduser()
        self.bytes_read: int = 0
        self.reads: list[SliceRead] = []
        self.on_read: Callable[[SliceRead], None] | None = None
        self._handles: dict[str, WeightFile] = {}
        self._info: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._converted: dict[str, Source] = {}
        if path.is_file() and path.suffix in (".safetensors", ".bin"):
            self.folder = path.parent.resolve()
            self._weight_map = self._map_from_headers([path.name])
            return
        if not path.is_dir():
            raise CheckpointError(
                f"checkpoint folder {path} does not exist: pass a folder with model.safetensors."
            )
        self.folder = path.resolve()
        index = next((self.folder / n for n in (SAFE_WEIGHTS_INDEX_NAME, BIN_WEIGHTS_INDEX_NAME)
                      if (self.folder / n).is_file()), None)
        if index is not None and (index.name == SAFE_WEIGHTS_INDEX_NAME or not _safetensors_files(self.folder)):
            self._weight_map = _read_index(index)
            missing = sorted({f for f in self._weight_map.values() if not (self.folder / f).is_file()})
            if missing:
                raise CheckpointError(
                    f"{index} names {len(missing)} file(s) that are not in {self.folder}: "
                    f"{', '.join(missing[:5])}. The download is incomplete: re-download "
                    "(snapshot_download(..., force_download=True) or `hf download REPO`) and check "
                    "free disk space."
                )
        elif (self.folder / SAFE_WEIGHTS_NAME).is_file():
            self._weight_map = self._map_from_headers([SAFE_WEIGHTS_NAME])
        elif files := [p.name for p in _safetensors_files(self.folder)]:
            self._weight_map = self._map_from_headers(files)
        elif (self.folder / BIN_WEIGHTS_NAME).is_file():
            self._weight_map = self._map_from_headers([BIN_WEIGHTS_NAME])
        else:
            raise CheckpointError(
                f"no weights in {self.folder}: pass a folder with model.safetensors (or "
                "model-*.safetensors plus model.safetensors.index.json), or pytorch_model.bin."
            )

    def add_conversions(self, sources: Mapping[str, Source]) -> None:
        """Know the parameters transformers builds from other keys (renamed or converted, see
        :mod:`autotp.checkpoint_keys`) by their model names: :meth:`keys`, :meth:`shape`,
        :meth:`dtype` and :meth:`read_slice` then serve them, reading only the stored rows a slice
        needs. A model name wins over a stored key of the same name, as in transformers."""
        self._converted.update(sources)

    def add_conversions_for(self, model: torch.nn.Module) -> None:
        """:meth:`add_conversions` with the renamings and converters transformers applies when it
        loads this checkpoint into ``model`` (:func:`autotp.checkpoint_keys.converted_sources`)."""
        self.add_conversions(converted_sources(model, list(self._weight_map)))

    # -- discovery ---------------------------------------------------------------------------------

    def _map_from_headers(self, files: list[str]) -> dict[str, str]:
        weight_map: dict[str, str] = {}
        for fname in files:
            for key in self._handle(fname).keys():
                if key in weight_map:
                    raise CheckpointError(
                        f"tensor {key!r} is stored in both {weight_map[key]} and {fname} in "
                        f"{self.folder}: remove the stray file, or add a model.safetensors.index.json."
                    )
                weight_map[key] = fname
        return weight_map

    def _handle(self, fname: str) -> WeightFile:
        handle = self._handles.get(fname)
        if handle is None:
            handle = self._handles[fname] = open_weight_file(self.folder / fname)
        return handle

    def _file_name(self, name: str) -> str:
        fname = self._weight_map.get(name)
        if fname is None:
            raise self._missing(name)
        return fname

    def _missing(self, name: str) -> CheckpointError:
        close = difflib.get_close_matches(name, self._weight_map.keys(), n=5, cutoff=0.6)
        files = self.files
        shown = ", ".join(files[:5]) + (f", ... ({len(files) - 5} more)" if len(files) > 5 else "")
        hint = f" Close matches: {close}." if close else ""
        return CheckpointError(
            f"no tensor {name!r} in the checkpoint at {self.folder} ({len(self._weight_map)} tensors in "
            f"{shown}).{hint} If only a prefix differs (e.g. 'model.'), map names with checkpoint_key(); "
            "if the checkpoint belongs to another architecture, check config.json."
        )

    # -- queries -----------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every tensor name, in the order of the index / headers, then the converted names."""
        return [*self._weight_map, *(k for k in self._converted if k not in self._weight_map)]

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map or name in self._converted

    def __len__(self) -> int:
        return len(self._weight_map)

    @property
    def files(self) -> list[str]:
        """The weight files (names relative to :attr:`folder`), sorted."""
        return sorted(set(self._weight_map.values()))

    def file_of(self, name: str) -> Path:
        """The file that stores ``name`` (for a converted name, its first stored tensor)."""
        if name in self._converted:
            name = stored_keys(self._converted[name])[0]
        return self.folder / self._file_name(name)

    def _meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        info = self._info.get(name)
        if info is None:
            fname = self._file_name(name)
            try:
                info = self._handle(fname).info(name)
            except KeyError as e:
                raise CheckpointError(
                    f"{self.folder / fname} does not contain {name!r} although the index says so: "
                    "the index and the shards disagree. Re-download the checkpoint "
                    "(snapshot_download(..., force_download=True))."
                ) from e
            self._info[name] = info
        return info

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of ``name`` (from the header; no data read)."""
        if name in self._converted:
            return source_shape(self._converted[name], self._meta)
        return self._meta(name)[0]

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` (from the header; no data read)."""
        if name in self._converted:
            return source_dtype(self._converted[name], self._meta)
        return self._meta(name)[1]

    def nbytes(self, name: str) -> int:
        """Bytes of data ``name`` occupies in its file(s)."""
        return _numel(self.shape(name)) * self.dtype(name).itemsize

    # -- reads -------------------------------------------------------------------------------------

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``name`` (converted to ``dtype`` when given), as a fresh tensor."""
        return self.read_slice(name, None, 0, 0, dtype=dtype)

    def read_slice(
        self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows/columns ``[start, stop)`` of ``dim`` of ``name``; only those bytes are requested.

        ``dim`` None reads the whole tensor (``start``/``stop`` ignored). The slice is copied out of
        file into a fresh contiguous tensor (never a view of a mapping) and converted to ``dtype``
        afterwards, so a conversion holds at most the slice twice, never the full tensor.
        A converted name (:meth:`add_conversions`) reads the stored rows its slice needs.

        ``out`` (a tensor of the slice's shape, in ``dtype``) receives the slice and is returned:
        a stored-dtype slice into a contiguous CPU ``out`` is read straight into it, with no
        intermediate tensor; anything else is read as above and copied in.
        """
        source = self._converted.get(name)
        if source is not None:
            value = read_source(source, self._read_stored, self._meta, dim, start, stop, dtype)
            return value if out is None else out.copy_(value)
        return self._read_stored(name, dim, start, stop, dtype, out)

    def _read_stored(
        self, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape, stored = self._meta(name)
        if dim is None:
            start = stop = 0
            numel = _numel(shape)
        else:
            if not 0 <= dim < len(shape):
                raise ValueError(f"dim {dim} out of range for {name!r} of shape {shape}")
            if not 0 <= start <= stop <= shape[dim]:
                raise ValueError(
                    f"slice [{start}, {stop}) out of range for dim {dim} of {name!r} of shape {shape}"
                )
            numel = _numel(shape) // shape[dim] * (stop - start) if shape[dim] else 0
        direct = out is not None and out.dtype == stored and out.device.type == "cpu" and out.is_contiguous()
        value = self._handle(self._file_name(name)).read(name, dim, start, stop, out if direct else None)
        if out is not None and not direct:
            value = out.copy_(value)  # converts per slice; the stored-dtype slice is freed right after
        elif dtype is not None and dtype != stored:
            value = value.to(dtype)  # per slice: the stored-dtype slice is freed right after
        self.bytes_read += numel * stored.itemsize
        record = SliceRead(name, dim, start, stop)
        self.reads.append(record)
        if self.on_read is not None:
            self.on_read(record)
        return value

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the open files (a later read reopens them)."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            with contextlib.suppress(Exception):
                handle.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = {}  # file handles do not pickle; each process reopens lazily
        state["on_read"] = None
        return state

    def __repr__(self) -> str:
        return f"Checkpoint({os.fspath(self.folder)!r}, tensors={len(self)}, files={len(self.files)})"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# --------------------------------------------------------------------------------------------------
# Names: parameter FQN -> checkpoint key; tied groups
# --------------------------------------------------------------------------------------------------


def checkpoint_key(fqn: str, checkpoint_keys: Collection[str], base_model_prefix: str | None) -> str | None:
    """The checkpoint key holding parameter ``fqn``, or None.

    Tries the exact name, then the name without the model's ``base_model_prefix`` (a checkpoint of
    the bare base model, e.g. ``LlamaModel``), then with it (a head model's checkpoint loaded into
    the base model). A tied parameter may have no key of its own: resolve it through its group
    (see :func:`parameter_metas`).
    """
    if fqn in checkpoint_keys:
        return fqn
    if base_model_prefix:
        head = base_model_prefix + "."
        candidate = fqn[len(head) :] if fqn.startswith(head) else head + fqn
        if candidate in checkpoint_keys:
            return candidate
    return None


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Groups (each sorted, len >= 2) of parameter FQNs that are one tensor.

    Merges three sources: ``accelerate.utils.find_tied_parameters`` (shared parameter objects),
    grouping by ``id(param)`` (the same test, kept as the fallback should accelerate's helper fail),
    and transformers' declared ``all_tied_weights_keys`` ``{target: source}`` for pairs that are
    both on meta: a model built under ``init_empty_weights`` has lost the identity (accelerate
    re-wraps the parameters) but not the declaration. Real tensors count as tied only when they are
    one object, so a model whose user untied the weights is not regrouped by its config.
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    try:
        from accelerate.utils import find_tied_parameters

        for group in find_tied_parameters(model):
            for name in group[1:]:
                union(group[0], name)
    except Exception:  # the identity pass below covers the same ground
        pass
    first_by_id: dict[int, str] = {}
    for name, p in named.items():
        first = first_by_id.setdefault(id(p), name)
        if first != name:
            union(first, name)
    declared = getattr(model, "all_tied_weights_keys", None)
    if isinstance(declared, dict):
        for target, source in declared.items():
            if target in named and source in named and named[target].is_meta and named[source].is_meta:
                union(target, source)
    groups: dict[str, list[str]] = {}
    for name in list(parent):
        groups.setdefault(find(name), []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


# --------------------------------------------------------------------------------------------------
# ParameterMeta
# --------------------------------------------------------------------------------------------------


def _config_hint(fqn: str) -> str:
    """Which config fields set the dimensions of a parameter, guessed from its name."""
    name = fqn.lower()
    if any(k in name for k in ("embed", "lm_head", "wte", "word_embeddings", "output.weight")):
        return "vocab_size / hidden_size"
    if any(k in name for k in ("k_proj", "v_proj", "key", "value")):
        return "num_key_value_heads / head_dim / hidden_size"
    if any(k in name for k in ("q_proj", "o_proj", "qkv", "attn", "attention", "query")):
        return "num_attention_heads / head_dim / hidden_size"
    if any(k in name for k in ("mlp", "gate", "up_proj", "down_proj", "fc", "ffn", "expert")):
        return "intermediate_size / hidden_size"
    return "hidden_size"


@dataclass
class ParameterMeta:
    """Everything autotp knows about one parameter (one tensor, however many names it has).

    ``placement`` is None until the solver fixes it; the first graph that touches a parameter fixes
    it and later graphs solve with it pinned. ``tied`` lists every FQN of the tensor when it is tied
    (empty otherwise). ``local`` is this rank's shard once the materialize pass stored it; the
    methods here return shards and never store them. A fused layout (QKV) is a
    :class:`~autotp.placement.StridedShard` placement: each rank reads chunk ``rank`` of every
    segment (one slice read per segment), or its heads of each where the segments are split in
    whole heads (GPT-2 XL's 25), and all of a segment the placement keeps whole (Falcon's one k and
    one v head), and concatenates them; ``strided`` says so.
    """

    fqn: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    checkpoint_key: str | None = None
    checkpoint: Checkpoint | None = field(default=None, repr=False, compare=False)
    placement: Placement | None = None
    tied: tuple[str, ...] = ()
    strided: bool = False
    local: torch.Tensor | None = field(default=None, repr=False, compare=False)
    style: str | None = None
    #: the session (``autotp.context.TPContext``) whose graphs placed this parameter, once one has
    session: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)

    @property
    def is_strided(self) -> bool:
        """True for a fused (strided) layout, by placement or by the ``strided`` flag."""
        return self.strided or isinstance(self.placement, StridedShard)

    @property
    def shard_dim(self) -> int | None:
        """The sharded tensor dim, or None when replicated / not yet placed."""
        p = self.placement
        if p is None or isinstance(p, Replicate):
            return None
        if isinstance(p, (Shard, GroupedShard, HeadShard)):
            if p.dim >= len(self.global_shape):
                raise ShardingError(
                    f"{self.fqn}: placement {p} names dim {p.dim} but the parameter has shape {self.global_shape}."
                )
            return p.dim
        raise ShardingError(
            f"{self.fqn}: placement {p} cannot describe stored weights; a parameter is Replicate or Shard(dim)."
        )

    def index_range(self, rank: int, world_size: int) -> tuple[int, int] | None:
        """``[start, stop)`` of this rank's chunk on :attr:`shard_dim` (torch.chunk), None if replicated;
        a grouped shard's is its group's chunk (kv heads shared by ``N / groups`` ranks), a head
        shard's the rows or columns of this rank's heads."""
        dim = self.shard_dim
        if dim is None:
            return None
        if isinstance(self.placement, HeadShard):
            return self.placement.index_range(self.global_shape[dim], rank, world_size)
        if isinstance(self.placement, GroupedShard):
            return chunk_range(self.global_shape[dim], self.placement.group(rank, world_size), self.placement.groups)
        return chunk_range(self.global_shape[dim], rank, world_size)

    def local_shape(self, world_size: int, rank: int = 0) -> tuple[int, ...]:
        """Shape of ``rank``'s shard (ranks differ only when the dim does not divide evenly)."""
        dim = self.shard_dim
        if dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        if isinstance(self.placement, StridedShard):  # its whole segments too: q_r | k | v
            shape[dim] = self.placement.local_length(world_size, rank)
            return tuple(shape)
        start, stop = self.index_range(rank, world_size)
        shape[dim] = stop - start
        return tuple(shape)

    def _cut(self, rank: int, world_size: int) -> tuple[int | None, int, int]:
        rng = self.index_range(rank, world_size)
        if rng is None:
            return None, 0, 0
        return self.shard_dim, rng[0], rng[1]

    def _pieces(self, rank: int, world_size: int) -> tuple[int | None, list[tuple[int, int]]]:
        """The shard dim and the ``[start, stop)`` ranges this rank reads along it, in local order:
        one chunk, or for a fused (strided) layout chunk ``rank`` of each segment."""
        p = self.placement
        if isinstance(p, StridedShard) and self.shard_dim is not None:
            if not p.fits(self.global_shape[p.dim], world_size):
                raise ShardingError(f"{self.fqn}: fused segments {p.segments} do not tile dim {p.dim} of "
                                    f"{self.global_shape} in multiples of {world_size}.")
            return p.dim, p.pieces(rank, world_size)
        dim, start, stop = self._cut(rank, world_size)
        return dim, [(start, stop)]

    def load_local(
        self,
        rank: int,
        world_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read exactly ``rank``'s shard from the checkpoint, as ``dtype`` (default :attr:`dtype`).

        ``out`` (the local shape, in ``dtype``; its device wins over ``device``) receives the shard
        and is returned: materialize passes rows of a fused group's buffer, so the group is laid
        out once, without a second copy (``autotp/passes/materialize.py``)."""
        if self.checkpoint is None or self.checkpoint_key is None:
            also = f" (tied with {', '.join(t for t in self.tied if t != self.fqn)})" if self.tied else ""
            raise CheckpointError(
                f"{self.fqn}{also} has no checkpoint key, so it cannot be loaded: the checkpoint lacks "
                "it. Check that the checkpoint matches config.json (tie_word_embeddings for lm_head), "
                "or initialize the parameter instead of loading it."
            )
        stored = self.checkpoint.shape(self.checkpoint_key)
        if stored != self.global_shape:
            raise CheckpointError(
                f"{self.fqn}: the model expects shape {self.global_shape} but {self.checkpoint_key!r} in "
                f"{self.checkpoint.file_of(self.checkpoint_key)} has shape {stored}. The config and the "
                f"weights disagree: check config.json's {_config_hint(self.fqn)}."
            )
        dim, pieces = self._pieces(rank, world_size)
        if out is not None:
            if tuple(out.shape) != self.local_shape(world_size, rank):
                raise ValueError(f"{self.fqn}: out has shape {tuple(out.shape)}, the shard "
                                 f"{self.local_shape(world_size, rank)}")  # internal
            at = 0
            for start, stop in pieces:  # fused: q_r | k_r | v_r, each into its place
                target = out if dim is None else out.narrow(dim, at, stop - start)
                self.checkpoint.read_slice(self.checkpoint_key, dim, start, stop, dtype=out.dtype,
                                           out=target)
                if dim is not None:
                    at += stop - start
            return out
        parts = [self.checkpoint.read_slice(self.checkpoint_key, dim, start, stop, dtype=dtype or self.dtype)
                 for start, stop in pieces]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim)  # fused: q_r | k_r | v_r
        return out if device is None else out.to(device)

    def shard_from(
        self, full: torch.Tensor, rank: int, world_size: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A contiguous copy of ``rank``'s chunk of the in-memory tensor ``full``."""
        if tuple(full.shape) != self.global_shape:
            raise ShardingError(
                f"{self.fqn}: expected a tensor of shape {self.global_shape}, got {tuple(full.shape)}."
            )
        dim, pieces = self._pieces(rank, world_size)
        if len(pieces) > 1:  # fused: chunk ``rank`` of each segment, concatenated
            return torch.cat([_copy_out(full.detach()[_slice_index(full.dim(), dim, a, b)], dtype)
                              for a, b in pieces], dim)
        start, stop = pieces[0]
        view = full.detach()[_slice_index(full.dim(), dim, start, stop)]
        return _copy_out(view, dtype)

    @property
    def is_tied(self) -> bool:
        return len(self.tied) > 1


def parameter_metas(
    model: torch.nn.Module,
    checkpoint: Checkpoint | None = None,
    *,
    base_model_prefix: str | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
) -> dict[str, ParameterMeta]:
    """One :class:`ParameterMeta` per parameter tensor, keyed by every FQN (tied names share one).

    A tied tensor takes the key of whichever name of its group the checkpoint holds (the embedding
    for an lm_head tied to it). With ``strict`` a parameter the checkpoint lacks raises
    :class:`~autotp.errors.CheckpointError`; otherwise its ``checkpoint_key`` stays None.
    """
    prefix = base_model_prefix if base_model_prefix is not None else getattr(model, "base_model_prefix", "")
    group_of: dict[str, tuple[str, ...]] = {}
    for group in tied_groups(model):
        for name in group:
            group_of[name] = tuple(group)
    if checkpoint is not None:
        checkpoint.add_conversions_for(model)
    keys = set(checkpoint.keys()) if checkpoint is not None else set()
    metas: dict[str, ParameterMeta] = {}
    missing: list[str] = []
    for fqn, p in model.named_parameters():
        if fqn in metas:
            continue
        group = group_of.get(fqn, ())
        key = None
        if checkpoint is not None:
            for name in (fqn, *(g for g in group if g != fqn)):
                key = checkpoint_key(name, keys, prefix)
                if key is not None:
                    break
            if key is None:
                missing.append(fqn)
        meta = ParameterMeta(
            fqn=fqn,
            global_shape=tuple(p.shape),
            dtype=dtype or p.dtype,
            checkpoint_key=key,
            checkpoint=checkpoint,
            tied=group,
        )
        for name in group or (fqn,):
            metas.setdefault(name, meta)
    if missing and strict and checkpoint is not None:
        if len(missing) == 1:
            raise checkpoint._missing(missing[0])
        raise CheckpointError(
            f"{len(missing)} parameters have no tensor in the checkpoint at {checkpoint.folder}: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. First one: "
            f"{checkpoint._missing(missing[0])}"
        )
    return metas


# --------------------------------------------------------------------------------------------------
# The architecture on meta
# --------------------------------------------------------------------------------------------------


def _config_dtype(config: Any) -> torch.dtype | None:
    value = getattr(config, "dtype", None)
    if isinstance(value, str) and value != "auto":
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _architecture_class(config: Any) -> tuple[str, Any]:
    """The transformers class named by ``config.architectures[0]`` (or the causal-LM class of its
    ``model_type`` when the config names none)."""
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    if names:
        name = names[0]
    else:
        from autotp.compat import causal_lm_class_name

        model_type = getattr(config, "model_type", None)
        name = causal_lm_class_name(model_type or "")
        if name is None:
            raise AutoTPError(
                f"the config (model_type {model_type!r}) names no architecture: set "
                "config.architectures = ['<Name>ForCausalLM'] to a class transformers ships."
            )
    cls = getattr(transformers, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
        return name, cls
    return name, None


def build_meta_model(
    config: Any, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False
) -> torch.nn.Module:
    """Build ``config``'s architecture with parameters on ``meta`` and real buffers, in eval mode.

    The class is ``getattr(transformers, config.architectures[0])``. As in transformers, a config
    with ``auto_map`` (remote code) uses that code only with ``trust_remote_code=True``, through
    ``AutoModelForCausalLM.from_config``; without it a natively supported architecture is used and
    any other raises :class:`~autotp.errors.AutoTPError`.

    Parameters get ``dtype`` (default: the config's ``dtype``, else torch's default dtype).
    Buffers stay real because ``init_empty_weights`` leaves buffers alone, so rotary ``inv_freq`` is
    computed exactly as in an eager model (transformers computes it in float32 whatever the default
    dtype). Any buffer that still ends up on meta is recomputed when it is a rotary one
    (:func:`_rebuild_rope_buffers`); the rest are reported with a warning and must come from the
    checkpoint (persistent buffers are saved in it). Tied weights are re-tied after leaving the
    ``init_empty_weights`` context (which breaks their identity).
    """
    import transformers
    from accelerate import init_empty_weights

    name, cls = _architecture_class(config)
    auto_map = getattr(config, "auto_map", None) or {}
    param_dtype = dtype or _config_dtype(config) or torch.get_default_dtype()
    if not param_dtype.is_floating_point:
        raise AutoTPError(f"dtype must be a floating dtype, got {param_dtype}")

    def construct() -> torch.nn.Module:
        if auto_map and trust_remote_code:
            auto_name = next(
                (k for k in ("AutoModelForCausalLM", "AutoModel") if k in auto_map), next(iter(auto_map))
            )
            auto_cls = getattr(transformers, auto_name)
            return auto_cls.from_config(config, trust_remote_code=True)
        if cls is None:
            if auto_map:
                raise AutoTPError(
                    f"architecture {name!r} is defined by remote code in the checkpoint (config.auto_map "
                    f"{sorted(auto_map)}); read that code, then pass trust_remote_code=True."
                )
            known = [n for n in dir(transformers) if n.endswith(("ForCausalLM", "LMHeadModel", "Model"))]
            close = difflib.get_close_matches(name, known, n=3)
            raise AutoTPError(
                f"transformers {transformers.__version__} has no architecture {name!r} (from "
                f"config.architectures).{f' Close matches: {close}.' if close else ''} Upgrade transformers, "
                "fix config.architectures, or pass trust_remote_code=True for a checkpoint that ships "
                "its modeling code."
            )
        return cls(config)

    try:
        with _default_dtype(param_dtype), init_empty_weights():
            model = construct()
    except AutoTPError:
        raise
    except Exception as e:
        raise AutoTPError(
            f"building {name!r} from its config failed: {type(e).__name__}: {e}. Check config.json."
        ) from e
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # init_empty_weights re-wrapped the tied parameters: tie them again
    leftover = _rebuild_rope_buffers(model)
    if leftover:
        warnings.warn(
            f"{name}: buffers {leftover[:5]} are on meta after building; they must be loaded from the "
            "checkpoint or recomputed before running.",
            stacklevel=2,
        )
    model.eval()
    return model


def meta_buffers(model: torch.nn.Module) -> list[str]:
    """Names of the buffers that live on the meta device."""
    return [n for n, b in model.named_buffers() if b.device.type == "meta"]


def _rebuild_rope_buffers(model: torch.nn.Module) -> list[str]:
    """Recompute rotary ``inv_freq`` buffers left on meta; return the meta buffers that remain.

    transformers' rotary modules keep ``config`` and ``rope_type`` and compute ``inv_freq`` with
    ``compute_default_rope_parameters`` or ``ROPE_INIT_FUNCTIONS[rope_type]``; rerun that on CPU.
    """
    if not meta_buffers(model):
        return []
    from autotp.compat import rope_init_functions

    ROPE_INIT_FUNCTIONS = rope_init_functions()  # noqa: N806 - transformers' name
    for module in model.modules():
        inv = module._buffers.get("inv_freq")
        cfg = getattr(module, "config", None)
        if inv is None or inv.device.type != "meta" or cfg is None:
            continue
        rope_type = getattr(module, "rope_type", "default")
        fn = ROPE_INIT_FUNCTIONS.get(rope_type) or getattr(module, "compute_default_rope_parameters", None)
        if fn is None:
            continue
        try:
            inv_freq, scaling = fn(cfg, device=torch.device("cpu"))
        except Exception:  # leave it on meta; the caller is warned
            continue
        module._buffers["inv_freq"] = inv_freq
        if module._buffers.get("original_inv_freq") is not None:
            module._buffers["original_inv_freq"] = inv_freq.clone()
        if hasattr(module, "attention_scaling"):
            module.attention_scaling = scaling
    return meta_buffers(model)
