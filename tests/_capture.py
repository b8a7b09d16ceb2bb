"""The graphs Dynamo hands a backend, for tests that decompose, solve or inspect them directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["captured_graphs"]


def captured_graphs(fn: Any, run: Callable[[Callable[..., Any]], Any], *,
                    dynamic: bool | None = None) -> list[tuple[torch.fx.GraphModule, list[Any]]]:
    """Every graph (with its example inputs) Dynamo compiles, in order, while ``run`` calls ``fn``
    compiled with ``fullgraph=True`` and a backend that keeps them; under ``torch.no_grad``. Dynamo's
    caches are reset first, so what earlier tests compiled neither counts nor is reused."""
    captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        run(torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic))
    return captured
