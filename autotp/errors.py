"""Errors autotp raises for bad input. Each message names the cause and what to do about it."""

from __future__ import annotations


class AutoTPError(RuntimeError):
    """Base error: something about the model, the checkpoint or the arguments cannot be honoured."""


class ShardingError(AutoTPError):
    """A tensor cannot be split over the requested number of ranks."""


class SolverError(AutoTPError):
    """The placement solver found no valid plan for a graph."""


class CheckpointError(AutoTPError):
    """The checkpoint is missing, incomplete, or disagrees with the config."""


class PassError(AutoTPError):
    """A compiler pass produced an invalid graph (a bug in autotp, reported with the pass name)."""


def divisors_up_to(n: int, limit: int = 64) -> list[int]:
    """Valid tensor-parallel sizes for a dimension of size ``n`` (its divisors, capped for messages)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
