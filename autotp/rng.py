"""Random numbers in a tensor-parallel program: one stream for replicated regions, one per rank
for sharded regions.

A replicated value must be the same on every rank, so a random op that produces one (a dropout
mask of a replicated or partial activation) draws from the default generator, which the user
seeds alike on every rank (``torch.manual_seed(seed)``, as for one process). A random op on a
shard must draw *its own* numbers: with the default generator every rank would draw the same
numbers for different chunks (rank 1's heads would drop exactly where rank 0's do).

The solver marks such ops with the local rewrite ``rank_rng`` (``autotp/ops/random.py``) and the
rewrite runs their Dynamo node inside :func:`rank_stream`: a 63-bit seed is drawn from the default
generator (every rank draws the same one and advances alike, so replicated regions stay in sync),
mixed with the rank, and the device's default generator is seeded with the mix for the duration
of the node and restored afterwards. The streams are therefore a pure function of the user's seed,
the rank and the position of the op in the program: no global state, nothing to set up, and a
checkpoint that saves the default generators resumes them too. One draw and one generator seed
per sharded random node is the cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

#: odd 64-bit constant (the golden ratio's), spreads consecutive ranks over the seed space
_MIX = 0x9E3779B97F4A7C15
_SEED_BOUND = 2**63


def rank_seed(drawn: int, rank: int) -> int:
    """The seed of ``rank``'s stream for one sharded random op, from the number all ranks drew."""
    return (drawn + _MIX * (rank + 1)) % _SEED_BOUND


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


@contextlib.contextmanager
def rank_stream(rank: int, device: torch.device) -> Iterator[None]:
    """Run the body with ``device``'s default generator on this rank's own stream."""
    drawn = int(torch.randint(0, _SEED_BOUND - 1, (), dtype=torch.int64))  # same on every rank
    generator = _generator(device)
    saved = generator.get_state()
    generator.manual_seed(rank_seed(drawn, rank))
    try:
        yield
    finally:
        generator.set_state(saved)


def _device_of(values: Any) -> torch.device:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


class RankStreamCall(torch.nn.Module):
    """A Dynamo node (function or method call) run on this rank's own random stream."""

    def __init__(self, target: Any, is_method: bool, rank: int) -> None:
        super().__init__()
        self.target = target
        self.is_method = is_method
        self.rank = rank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with rank_stream(self.rank, _device_of([*args, *kwargs.values()])):
            if self.is_method:
                return getattr(args[0], self.target)(*args[1:], **kwargs)
            return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        name = self.target if self.is_method else getattr(self.target, "__name__", repr(self.target))
        return f"{name}, rank={self.rank}"
