"""The pass runner: times each pass, lints the graph after passes that change it, and names the
failing pass (and the ones that ran before it) when something breaks inside autotp."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.fx

from autotp.errors import AutoTPError, PassError


class PassRunner:
    def __init__(self, debug_folder: Path | None = None) -> None:
        self.done: list[str] = []
        self.debug_folder = debug_folder

    def run(self, name: str, fn: Callable[..., Any], *args: Any, lint: torch.fx.GraphModule | None = None) -> Any:
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
        return result
