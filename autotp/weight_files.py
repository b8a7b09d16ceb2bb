"""Readers for one weight file: names, shapes and dtypes from its header; slices read on demand.

Two formats, one interface (:class:`WeightFile`): ``keys()``, ``info(name) -> (shape, dtype)``,
``read(name, dim, start, stop) -> tensor`` (a fresh contiguous tensor in the stored dtype holding
``[start, stop)`` of ``dim``, or the whole tensor when ``dim`` is None) and ``close()``.

Design: what a slice read costs in resident memory
==================================================

* **safetensors** (:class:`SafetensorsFile`) are read with positioned reads (``os.preadv``) into
  the output tensor's own buffer, never through a memory map. A page of a mapping counts in the
  process's resident set (``VmRSS`` / ``VmHWM``) once it is touched and stays counted while the
  mapping lives; with ``safe_open`` + ``get_slice`` a rank therefore held its copied shard *and*
  the mapped pages it was copied from (for a slice on dim 1, every page of the tensor, since each
  row contributes a piece), about 1.0x the checkpoint at tp=2 instead of 0.5x. A ``pread`` goes
  through the page cache, which is shared, reclaimable and not part of any process's RSS. A slice
  on dim ``d`` is ``prod(shape[:d])`` contiguous runs of ``(stop - start) * prod(shape[d+1:])``
  elements; a run of at least :data:`SHORT_RUN_BYTES` is read in one system call straight into
  place (no scratch buffer, exactly the slice's bytes requested). Shorter runs (a row-parallel
  slice of a narrow matrix: 4 KB runs for the 150m benchmark model at tp=2, ~170 per tensor) are
  read as blocks of whole rows, up to :data:`BLOCK_BYTES` each, into one scratch buffer and copied
  into place: one system call per block instead of one per run (a row-parallel load's reads took
  ~2.7x the CPU of reading the same bytes on dim 0) for at most ``BLOCK_BYTES`` of scratch, and
  pages the runs would mostly have touched anyway. The header is parsed and validated here (offsets
  inside the file, byte counts matching shape x dtype), so a truncated or corrupt file is named
  before any tensor is read.

  Why not safetensors' own reader, now that ``safe_open(..., backend="pread")`` exists (0.8.0):
  measured by ``benchmarks/slice_reads.py`` (``benchmarks/results/slice_reads.json``: half of a
  256 MB fp32 tensor on dim 1, the row-parallel case), reading the slice grew the peak RSS by 1.03x
  the slice with this reader, 3.01x with ``backend="pread"`` (it reads the whole tensor, then
  slices) and 3.04x with the default memory map. This reader also fills a caller's buffer
  (``out=``: fused q|k|v and gate|up groups are read into place), which ``get_slice`` cannot.
* **PyTorch ``.bin``** (:class:`TorchFile`) files are pickles in a zip; they are opened with
  ``torch.load(mmap=True, weights_only=True)`` (no code runs; tensors are views of a file mapping,
  nothing is copied at load), and a slice is copied out of the mapping. The mapped pages a slice
  read touches do count in RSS until :meth:`TorchFile.close` drops the mapping; ``Checkpoint``
  users close once every shard is loaded. Files in the legacy (pre-zip) format cannot be mapped
  and are loaded whole, with a warning saying how to convert them.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from autotp.errors import CheckpointError

__all__ = ["SafetensorsFile", "TorchFile", "WeightFile", "open_weight_file"]

#: safetensors dtype codes -> torch dtypes (those this torch build has)
ST_DTYPES: dict[str, torch.dtype] = {
    code: dt
    for code, name in {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "U16": "uint16",
        "I16": "int16",
        "U32": "uint32",
        "I32": "int32",
        "U64": "uint64",
        "I64": "int64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
}

#: a safetensors header larger than this is treated as corrupt (the format's own limit is 100 MB)
_MAX_HEADER = 100_000_000


class WeightFile(Protocol):
    """What :class:`~autotp.weights.Checkpoint` needs from one file."""

    path: Path

    def keys(self) -> list[str]: ...

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]: ...

    def read(self, name: str, dim: int | None, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor: ...

    def close(self) -> None: ...


def open_weight_file(path: Path) -> WeightFile:
    """The reader for ``path``: safetensors by its suffix, a PyTorch pickle otherwise."""
    return SafetensorsFile(path) if path.suffix == ".safetensors" else TorchFile(path)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _corrupt(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable safetensors file ({why}): it is truncated or corrupt. "
        "Re-download it (snapshot_download(..., force_download=True) or "
        f"`hf download REPO --force-download`) and check free disk space (df -h {path.parent})."
    )


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``fd`` at ``offset``; return the bytes read (short only at end of file)."""
    done = 0
    while done < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv (Windows)
            os.lseek(fd, offset + done, os.SEEK_SET)
            n = os.readv(fd, [buf[done:]])
        if n == 0:
            break
        done += n
    return done


#: runs of a slice shorter than this are read in blocks of whole rows (see the module docstring)
SHORT_RUN_BYTES = 64 * 1024
#: the most bytes one block read of short runs spans (its scratch buffer)
BLOCK_BYTES = 4 * 1024 * 1024


class SafetensorsFile:
    """One ``.safetensors`` file, read with ``pread`` (see the module docstring for why)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        try:
            self._fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise _corrupt(path, f"{type(e).__name__}: {e}") from e
        try:
            self._entries, self._data_start = self._parse_header()
        except BaseException:
            self.close()
            raise

    def _parse_header(self) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype, int, int]], int]:
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, 8, 0)
        if len(raw) < 8:
            raise _corrupt(self.path, f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise _corrupt(self.path, f"the header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (ValueError, UnicodeDecodeError) as e:
            raise _corrupt(self.path, f"header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise _corrupt(self.path, "header is not a JSON object")
        data_start = 8 + n
        entries: dict[str, tuple[tuple[int, ...], torch.dtype, int, int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                code, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
            except (KeyError, TypeError, ValueError) as e:
                raise _corrupt(self.path, f"bad header entry for {name!r}: {e}") from e
            dtype = ST_DTYPES.get(code)
            if dtype is None:
                raise CheckpointError(f"{name!r} in {self.path} has dtype {code}, which torch cannot load.")
            if end - begin != _numel(shape) * dtype.itemsize or begin < 0:
                raise _corrupt(self.path, f"{name!r}: byte range [{begin}, {end}) does not fit shape {list(shape)} {code}")
            if data_start + end > size:
                raise _corrupt(self.path, f"{name!r} ends at byte {data_start + end} but the file has {size}")
            entries[str(name)] = (shape, dtype, data_start + begin, data_start + end)
        return entries, data_start

    def keys(self) -> list[str]:
        return list(self._entries)

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype, _, _ = self._entries[name]
        return shape, dtype

    def read(self, name: str, dim: int | None, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``dim`` (None: all) of ``name``, read straight into ``out``
        when given (a contiguous CPU tensor of the slice's shape and stored dtype), else into a
        fresh tensor."""
        shape, dtype, begin, _ = self._entries[name]
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        if dim is None:
            out_shape, runs, run_len, stride, first = shape, 1, _numel(shape), 0, 0
        else:
            inner = _numel(shape[dim + 1 :])
            out_shape = (*shape[:dim], stop - start, *shape[dim + 1 :])
            runs, run_len, stride, first = _numel(shape[:dim]), (stop - start) * inner, shape[dim] * inner, start * inner
        if out is None:
            out = torch.empty(out_shape, dtype=dtype)
        elif (tuple(out.shape) != tuple(out_shape) or out.dtype != dtype or out.device.type != "cpu"
              or not out.is_contiguous()):
            raise ValueError(f"cannot read {name!r}{list(out_shape)} {dtype} into {out.dtype}{list(out.shape)} "
                             f"on {out.device} (contiguous: {out.is_contiguous()})")  # internal
        item = dtype.itemsize
        if out.numel() == 0:
            return out
        nbytes = run_len * item
        if runs > 1 and nbytes < SHORT_RUN_BYTES:
            self._read_short_runs(name, out.view(-1).view(torch.uint8).view(runs, nbytes), begin + first * item,
                                  stride * item)
            return out
        buf = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
        for i in range(runs):  # each run straight into its place in ``out``
            offset = begin + (first + i * stride) * item
            if _pread_into(self._fd, buf[i * nbytes : (i + 1) * nbytes], offset) != nbytes:
                raise _corrupt(self.path, f"short read of {name!r}: the file changed or was truncated")
        return out

    def _read_short_runs(self, name: str, out: torch.Tensor, offset: int, row_bytes: int) -> None:
        """``out`` (runs, run bytes: uint8) from the runs at ``offset``, ``row_bytes`` apart, read in
        blocks of whole rows of at most :data:`BLOCK_BYTES` (one ``pread`` each) and copied into place."""
        runs, nbytes = out.shape
        rows = max(1, min(runs, (BLOCK_BYTES - nbytes) // row_bytes + 1))
        scratch = np.empty((rows - 1) * row_bytes + nbytes, dtype=np.uint8)
        target = out.numpy()
        for i in range(0, runs, rows):
            k = min(rows, runs - i)
            span = (k - 1) * row_bytes + nbytes
            if _pread_into(self._fd, memoryview(scratch)[:span], offset + i * row_bytes) != span:
                raise _corrupt(self.path, f"short read of {name!r}: the file changed or was truncated")
            # (k, run bytes) rows of the block; numpy's copy: one memcpy per row, no thread pool
            np.copyto(target[i : i + k], np.lib.stride_tricks.as_strided(scratch, (k, nbytes), (row_bytes, 1)))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class TorchFile:
    """One PyTorch pickle (``pytorch_model*.bin``): ``torch.load(mmap=True, weights_only=True)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tensors: dict[str, torch.Tensor] | None = None
        self._load()

    def _load(self) -> dict[str, torch.Tensor]:
        if self._tensors is not None:
            return self._tensors
        fix = (
            "Re-download it, or convert the checkpoint once with AutoModelForCausalLM.from_pretrained(SRC)"
            ".save_pretrained(OUT) (which writes model.safetensors) and pass OUT."
        )
        try:
            try:
                obj = torch.load(os.fspath(self.path), map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                obj = torch.load(os.fspath(self.path), map_location="cpu", weights_only=True)
                warnings.warn(  # only once the legacy file did load: a corrupt one is an error below
                    f"{self.path} is in PyTorch's legacy (pre-zip) format, which cannot be memory-mapped: "
                    f"it is loaded whole on every rank. Convert it to safetensors to load only slices. {fix}",
                    stacklevel=3,
                )
        except Exception as e:  # pickle, zip and weights_only errors alike
            raise CheckpointError(
                f"{self.path} is not a readable PyTorch checkpoint ({type(e).__name__}: {str(e)[:300]}): it is "
                f"truncated, corrupt, or holds more than tensors (only weights_only loads are allowed). {fix}"
            ) from e
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(
                f"{self.path} does not hold a flat state dict (name -> tensor). {fix}"
            )
        self._tensors = {str(k): v for k, v in obj.items()}
        return self._tensors

    def keys(self) -> list[str]:
        return list(self._load())

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = self._load()[name]
        return tuple(int(s) for s in t.shape), t.dtype

    def read(self, name: str, dim: int | None, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._load()[name]
        view = t if dim is None else t.narrow(dim, start, stop - start)
        if out is None:
            out = torch.empty(tuple(view.shape), dtype=view.dtype)
        out.copy_(view)  # one copy out of the mapping; the result shares nothing with it
        return out

    def close(self) -> None:
        """Drop the tensors and with them the file mapping (and its pages in RSS)."""
        self._tensors = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_tensors": None}
