"""Write a safetensors file one tensor at a time.

``safetensors.torch.save_file`` takes the whole dict and serializes it into one buffer, so a file
costs its full size in memory twice. The format needs only the names, dtypes and shapes up front
(an 8-byte little-endian header length, a JSON header with each tensor's byte range, padded with
spaces to a multiple of 8, then the raw little-endian bytes in header order), so
:class:`SafetensorsWriter` writes the header from those and then each tensor's bytes as it
arrives: the caller holds one tensor at a time. Files it writes load with ``safetensors``,
``transformers`` and autotp's own reader.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from autotp.errors import AutoTPError
from autotp.weight_files import ST_DTYPES

_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in ST_DTYPES.items()}


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """``with SafetensorsWriter(path, specs, metadata) as w: w.write(name, tensor)`` for each name
    of ``specs`` (name -> (shape, dtype)), in that order."""

    def __init__(self, path: str | os.PathLike, specs: Mapping[str, tuple[Sequence[int], torch.dtype]],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self.specs = {name: (tuple(int(s) for s in shape), dtype) for name, (shape, dtype) in specs.items()}
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, (shape, dtype) in self.specs.items():
            if dtype not in _CODES:
                raise AutoTPError(f"{name}: safetensors cannot store dtype {dtype}")
            size = _nbytes(shape, dtype)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._order = list(self.specs)
        self._next = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close() / __exit__
        self._file.write(struct.pack("<Q", len(text)))
        self._file.write(text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes; names must come in the order of ``specs``."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing"
            raise AutoTPError(f"{self.path}: wrote {name!r} out of order, expected {expected}")
        shape, dtype = self.specs[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise AutoTPError(f"{self.path}: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the header "
                              f"says {shape} {dtype}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (numel,)
        if flat.numel():
            self._file.write(memoryview(flat.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._order):
            raise AutoTPError(f"{self.path}: closed after {self._next} of {len(self._order)} tensors")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._file.close()
            return
        self.close()
