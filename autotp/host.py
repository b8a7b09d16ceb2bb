"""What this host gives its ranks: how many ranks it runs and how many cores they may use.

Two decisions read these: each CPU rank's thread count (``api.threads_per_rank``: the cores
divided among the ranks) and whether one rank traces for all (``shared_frames.trace_once_default``:
on where the ranks outnumber the cores). Both read them here, so that they agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["local_ranks", "usable_cores"]


def local_ranks(environ: Mapping[str, str], world_size: int) -> int:
    """The ranks this host runs, at least 1: ``LOCAL_WORLD_SIZE`` (set by torchrun and autotp's own
    launchers) where it is set to a number, else ``world_size`` (one host)."""
    try:
        local = int(environ.get("LOCAL_WORLD_SIZE", "") or world_size)
    except ValueError:
        local = world_size
    return max(local, 1)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container's or ``taskset``'s
    limit), else every core the OS reports."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
