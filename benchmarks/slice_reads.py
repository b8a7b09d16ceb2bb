"""What reading one rank's slice of a safetensors tensor costs in resident memory, by reader.

    python benchmarks/slice_reads.py --mb 256 --rounds 2 --out benchmarks/results/slice_reads.json

One fp32 tensor of ``--mb`` megabytes (rows x 16384) is written to a temporary file; each reader
then reads half of it on dim 1 (a row-parallel shard at tp=2: every row contributes a piece, the
worst case for a reader that cannot skip bytes) in a fresh process, and touches every page of the
result. Readers:

* ``autotp``: :class:`autotp.weight_files.SafetensorsFile` (positioned reads of exactly the
  slice's runs, straight into the output tensor);
* ``safetensors_pread``: ``safe_open(path, framework="pt", backend="pread").get_slice(name)[...]``;
* ``safetensors_mmap``: ``safe_open(path, framework="pt").get_slice(name)[...]`` (the default
  memory map).

Reported per reader: how much the process's peak RSS (``VmHWM``) grew during the read (the slice
itself is ``slice_mb``), its file-backed RSS after the read, and the seconds, medians over
``--rounds`` alternating launches. The modules are imported before the first reading, so
imports do not count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.fspath(Path(__file__).resolve().parent))

from _record import Provenance, launch, memory, write_result  # noqa: E402

READERS = ("autotp", "safetensors_pread", "safetensors_mmap")


def _worker(path: str, reader: str, result: str) -> None:
    import torch
    from safetensors import safe_open

    from autotp.weight_files import SafetensorsFile

    before = memory()
    start = time.perf_counter()
    if reader == "autotp":
        f = SafetensorsFile(Path(path))
        shape, _ = f.info("w")
        x = f.read("w", 1, 0, shape[1] // 2)
        f.close()
    else:
        options = {"backend": "pread"} if reader == "safetensors_pread" else {}
        with safe_open(path, framework="pt", **options) as f:
            sl = f.get_slice("w")
            x = sl[:, : sl.get_shape()[1] // 2].contiguous()
    x.add_(0)  # every page of the result touched
    seconds = time.perf_counter() - start
    after = memory()
    Path(result).write_text(
        json.dumps(
            {
                "seconds": seconds,
                "slice_bytes": x.numel() * x.element_size(),
                "peak_grew_bytes": after["peak_rss"] - before["peak_rss"],
                "rss_file_bytes": after["rss_file"],
                "checksum": float(x.double().sum()),
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", nargs=3, metavar=("PATH", "READER", "RESULT"), help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=256, help="size of the tensor in MB (fp32)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="slice_reads.json")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    provenance = Provenance.start(argv)
    import torch
    from safetensors.torch import save_file

    cols = 16384
    rows = max(args.mb * 10**6 // (4 * cols), 2)
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in READERS}
    with tempfile.TemporaryDirectory(prefix="autotp-slices-") as tmp:
        path = Path(tmp, "w.safetensors")
        torch.manual_seed(0)
        save_file({"w": torch.randn(rows, cols)}, os.fspath(path))
        for round_ in range(args.rounds):
            for reader in READERS:
                result = Path(tmp, f"{reader}-{round_}.json")
                launch(
                    1,
                    [
                        os.fspath(Path(__file__).resolve()),
                        "--worker",
                        os.fspath(path),
                        reader,
                        os.fspath(result),
                    ],
                    label=reader,
                )
                runs[reader].append(json.loads(result.read_text()))
    readers = {
        reader: {
            "slice_mb": rs[0]["slice_bytes"] / 1e6,
            "peak_grew_mb": statistics.median(r["peak_grew_bytes"] for r in rs) / 1e6,
            "peak_grew_in_slices": statistics.median(r["peak_grew_bytes"] for r in rs) / rs[0]["slice_bytes"],
            "rss_file_mb": statistics.median(r["rss_file_bytes"] for r in rs) / 1e6,
            "seconds": statistics.median(r["seconds"] for r in rs),
            "runs": rs,
        }
        for reader, rs in runs.items()
    }
    same = len({r["checksum"] for rs in runs.values() for r in rs}) == 1
    report = write_result(
        args.out,
        {
            "tensor_shape": [rows, cols],
            "dtype": "float32",
            "slice": "half of dim 1",
            "rounds": args.rounds,
            "same_values": same,
            "readers": readers,
        },
        provenance,
    )
    for reader, r in report["readers"].items():
        print(
            f"{reader:>18}: peak +{r['peak_grew_mb']:.0f} MB for a {r['slice_mb']:.0f} MB slice "
            f"({r['peak_grew_in_slices']:.2f}x), {r['seconds']:.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
