"""Options of the speed work: inner compiler choice, fusion switch, backend options, defaults."""

from __future__ import annotations

import pytest
import torch

from autotp.api import DEFAULT_COMPILE_INNER, default_compile_inner
from autotp.backend import autotp_backend
from autotp.config import AutoTPConfig
from autotp.errors import AutoTPError


def test_compile_inner_values() -> None:
    assert AutoTPConfig(compile_inner="inductor").compile_inner == "inductor"
    assert AutoTPConfig().fuse is True and AutoTPConfig(fuse=False).fuse is False
    with pytest.raises(AutoTPError, match="compile_inner"):
        AutoTPConfig(compile_inner="tvm")


def test_default_inner_compiler_per_device() -> None:
    assert default_compile_inner(torch.device("cpu")) == DEFAULT_COMPILE_INNER["cpu"]
    assert default_compile_inner(torch.device("cuda", 0)) == DEFAULT_COMPILE_INNER["cuda"]


def test_backend_options_are_checked() -> None:
    with pytest.raises(AutoTPError, match="unknown autotp backend options"):
        autotp_backend(torch.fx.symbolic_trace(torch.nn.Identity()), [], options={"fusion": True})


class _Siblings(torch.nn.Module):
    """Two linears reading one input: what the fuse pass turns into one GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], dim=-1)


def test_backend_options_reach_the_graph(tmp_path) -> None:
    import json

    torch.manual_seed(0)
    model, x = _Siblings(), torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    fusion = {}
    for fuse in (True, False):
        torch._dynamo.reset()
        folder = tmp_path / f"fuse_{fuse}"
        compiled = torch.compile(model, backend="autotp", options={"fuse": fuse, "trace_dir": str(folder)})
        with torch.no_grad():  # fusion applies to inference graphs only
            torch.testing.assert_close(compiled(x), expected, atol=1e-6, rtol=1e-5)
        fusion[fuse] = json.loads((folder / "rank0" / "graph000" / "fusion.json").read_text())
    torch._dynamo.reset()
    assert fusion[True]["fused_groups"] == 1  # the default fuses the siblings ...
    assert fusion[False] == {"disabled": True}  # ... and the option turned the pass off in that graph


def test_threads_per_rank() -> None:
    from autotp.api import threads_per_rank

    cpu = torch.device("cpu")
    assert threads_per_rank(cpu, {"LOCAL_WORLD_SIZE": "2"}, 2, 16) == 8
    assert threads_per_rank(cpu, {}, 4, 16) == 4  # no launcher variable: the group's size
    assert threads_per_rank(cpu, {"LOCAL_WORLD_SIZE": "4"}, 8, 2) == 1  # never 0
    assert threads_per_rank(cpu, {"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}, 2, 16) is None  # user wins
    assert threads_per_rank(torch.device("cuda", 0), {}, 2, 16) is None
