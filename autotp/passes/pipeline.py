"""The pass runner: times each pass, lints the graph after passes that change it, and names the
failing pass (and the ones that ran before it) when something breaks inside autotp."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.fx

from autotp.errors import AutoTPError, PassError


class PassRunner:
    def __init__(self, debug_folder: Path | None = None) -> None:
        self.done: list[str] = []
        self.debug_folder = debug_folder
        #: wall seconds per pass name (summed if a pass runs twice)
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any, lint: torch.fx.GraphModule | None = None) -> Any:
        start = time.perf_counter()
        try:
            result = fn(*args)
            if lint is not None:
                lint.graph.lint()
        except AutoTPError:
            raise
        except Exception as e:
            raise PassError(
                f"autotp pass '{name}' failed (passes that ran before it: {', '.join(self.done) or 'none'}): "
                f"{type(e).__name__}: {e}"
            ) from e
        self.done.append(name)
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
        return result
