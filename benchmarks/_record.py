"""What every benchmark shares: the record of how a result was made, memory readings, statistics,
launching an engine in its own process, and matplotlib.

A result a skeptic can check says which code, which command, which libraries and which machine made
it, and how busy that machine was. :class:`Provenance` collects that once per run and every script
puts it under ``"provenance"`` in its JSON (:func:`write_result`):

* ``commit`` (``git rev-parse HEAD``) and ``dirty`` (uncommitted changes to the code under ``autotp/`` or
  ``benchmarks/``, not their results), ``date`` (UTC, ISO 8601, at the start) and ``duration_s``;
* ``command``: the command line as typed, ``python benchmarks/<script>.py ...``, so the result can
  be made again (a path inside the repository relative to it, another absolute path as
  ``.../<name>``);
* ``versions``: python, torch, transformers, safetensors, huggingface_hub, numpy, autotp;
* ``machine``: cores (``os.cpu_count``), the CPU model, total memory, the platform, and the load
  averages (1, 5, 15 minutes) at the start and at the end: on a shared machine, a run whose load
  average was well above zero measured other jobs as much as the engines.

No path of the machine is recorded (checkpoints are named by :func:`checkpoint_name`).

Memory (:func:`memory`) is read from ``/proc/self/status`` (``VmHWM``: peak resident set;
``VmRSS``; ``RssAnon``: anonymous resident memory, i.e. heap and tensors, not file pages that the
kernel can drop) and ``/proc/self/smaps_rollup`` (``Anonymous``), in bytes; each engine reads its
own in its own process, so no baseline pays for another engine's work.

Engines run in separate processes (:func:`launch`), one launch after the other, alternating across
rounds (A B C A B C), so that drift on the machine hits all of them alike; :func:`stats` gives
median, min, max and spread (max - min) of every timing.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Provenance", "checkpoint_name", "launch", "memory", "pyplot", "stats", "write_result"]

ROOT = Path(__file__).resolve().parent.parent
#: what the benchmarks write, not the code that makes a result: a fresh result file of an earlier
#: command of the same session does not make the next result's code dirty
_OUTPUTS = (":(exclude)benchmarks/results", ":(exclude)benchmarks/coverage.jsonl")
#: distributions whose versions every result records (absent ones are recorded as None)
PACKAGES = ("torch", "transformers", "safetensors", "huggingface_hub", "numpy", "autotp")


def _git(*cmd: str) -> str:
    try:
        return subprocess.run(
            ["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _portable(arg: str) -> str:
    """An argument as recorded: a path inside the repository relative to it, another absolute path
    by its last part only (a result names no folder of the machine that made it)."""
    head, eq, value = arg.rpartition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    if os.path.isabs(value):
        path = Path(value)
        value = os.fspath(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else f".../{path.name}"
    return f"{head}{eq}{value}"


def _command(argv: list[str]) -> str:
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        script = Path(script.name)
    if script.name == "__main__.py" or script.suffix != ".py":  # python -m benchmarks.x
        return shlex.join(["python", "-m", __package__ or "benchmarks", *map(_portable, argv)])
    return shlex.join(["python", os.fspath(script), *map(_portable, argv)])


class Provenance:
    """Started when a benchmark starts (:meth:`start`), finished when it writes its result
    (:meth:`finish`): the commit, date, command, versions and machine of the run."""

    def __init__(self, argv: list[str] | None = None) -> None:
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.started = time.time()
        self.load_start = os.getloadavg()

    @classmethod
    def start(cls, argv: list[str] | None = None) -> Provenance:
        return cls(argv)

    def finish(self) -> dict[str, Any]:
        return {
            "commit": _git("rev-parse", "HEAD") or None,
            "dirty": bool(_git("status", "--porcelain", "--", "autotp", "benchmarks", *_OUTPUTS)),
            "date": datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "duration_s": round(time.time() - self.started, 1),
            "command": _command(self.argv),
            "versions": _versions(),
            "machine": {
                "cores": os.cpu_count(),
                "cpu": _cpu_model(),
                "memory_bytes": _memory_total(),
                "platform": platform.platform(terse=True),
                "load_average": {"start": list(self.load_start), "end": list(os.getloadavg())},
            },
        }


def write_result(
    path: str | os.PathLike[str], result: dict[str, Any], provenance: Provenance
) -> dict[str, Any]:
    """Write ``result`` with its provenance (first key) as indented JSON; the object written."""
    out = {"provenance": provenance.finish(), **result}
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return out


def checkpoint_name(folder: str | os.PathLike[str]) -> str:
    """The benchmark checkpoint's name (its folder's last part): what a result records, not the path."""
    return Path(folder).name


def _proc_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0]) * 1024  # kB
    except OSError:
        pass
    return out


def memory() -> dict[str, int | None]:
    """This process's memory now, in bytes: ``peak_rss`` (VmHWM), ``rss`` (VmRSS), ``rss_anon``
    (RssAnon), ``rss_file`` (RssFile: mapped file pages) and ``anonymous`` (smaps_rollup's
    Anonymous); None where /proc does not say."""
    status = _proc_fields("/proc/self/status", ("VmHWM", "VmRSS", "RssAnon", "RssFile"))
    rollup = _proc_fields("/proc/self/smaps_rollup", ("Anonymous",))
    return {
        "peak_rss": status.get("VmHWM"),
        "rss": status.get("VmRSS"),
        "rss_anon": status.get("RssAnon"),
        "rss_file": status.get("RssFile"),
        "anonymous": rollup.get("Anonymous"),
    }


def stats(values: list[float]) -> dict[str, Any]:
    """Median, min, max and spread (max - min) of ``values``, and the values themselves."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "spread": max(values) - min(values),
        "n": len(values),
        "all": values,
    }


def launch(ranks: int, worker: list[str], env: dict[str, str] | None = None, label: str = "") -> float:
    """Run ``worker`` (a script and its arguments) in a fresh process (``ranks == 1``) or under
    torch's elastic launcher on ``ranks`` local processes, each with ``cores // ranks`` threads
    unless ``OMP_NUM_THREADS`` is set; the wall seconds from launch to exit. A failure raises with
    the end of the output."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // ranks, 1)))
    if ranks == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            *worker,
        ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return wall


def pyplot() -> Any:
    """matplotlib's pyplot with the file-only backend, or None (and a note) when matplotlib is not
    installed (it comes with the ``[plot]`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed: no PNG (pip install -e ".[plot]")')
        return None
    return plt
