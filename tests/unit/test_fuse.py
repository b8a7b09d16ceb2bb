"""The fuse pass on small hand-built graphs (one process, no group).

Tolerance: one GEMM over the concatenated weight computes the same dot products as the separate
GEMMs, but the kernel may block them differently: fp32 ``atol=1e-6, rtol=1e-5``.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from autotp.passes.fuse import fuse_sibling_matmuls


class Siblings(nn.Module):
    """q/k/v-like linears on one input (k, v with biases: not groupable with q), a gate/up pair,
    and a linear on another input."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q = nn.Parameter(torch.randn(12, 10, generator=g))
        self.k = nn.Parameter(torch.randn(6, 10, generator=g))
        self.v = nn.Parameter(torch.randn(6, 10, generator=g))
        self.kb = nn.Parameter(torch.randn(6, generator=g))
        self.vb = nn.Parameter(torch.randn(6, generator=g))
        self.gate = nn.Parameter(torch.randn(14, 12, generator=g))
        self.up = nn.Parameter(torch.randn(14, 12, generator=g))
        self.other = nn.Parameter(torch.randn(5, 14, generator=g))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = F.linear(x, self.q).view(-1)  # (B*S*12,): a merging view, fine on a strided piece after fusion
        k = F.linear(x, self.k, self.kb)
        v = F.linear(x, self.v, self.vb)
        h = q.view(-1, 12)  # (B*S, 12)
        a = F.linear(h, self.gate)
        b = F.linear(h, self.up)
        return q, k, v, F.linear(F.silu(a) * b, self.other)


def _traced(module: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """A GraphModule with Dynamo-style ``example_value`` metadata on every node."""
    gm = torch.fx.symbolic_trace(module)

    class Record(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            n.meta["example_value"] = out
            return out

    Record(gm).run(x)
    return gm


def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.linear, torch._C._nn.linear))


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_siblings_become_one_linear_with_equal_results_and_no_extra_memory() -> None:
    module = Siblings().eval()
    x = torch.randn(2, 3, 10)
    with torch.no_grad():
        expected = module(x)
        gm = _traced(module, x)
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert _linears(gm) == 6
    report = fuse_sibling_matmuls(gm)
    assert [g["weights"] for g in report.fused] == [["k", "v"], ["gate", "up"]]
    assert report.removed_matmuls == 2 and _linears(gm) == 4
    with torch.no_grad():
        got = gm(x)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    # the fused buffers own the storage; the parameters are views into it (no second copy)
    assert gm.autotp_fused_gate.untyped_storage().data_ptr() == module.gate.untyped_storage().data_ptr()
    assert module.up.storage_offset() == module.gate.numel()
    assert _storage_bytes(list(module.parameters())) == param_bytes
    assert isinstance(module.up, nn.Parameter) and module.up.requires_grad


def test_a_second_graph_reuses_the_fused_storage() -> None:
    module = Siblings().eval()
    x = torch.randn(1, 4, 10)
    with torch.no_grad():
        first, second = _traced(module, x), _traced(module, x)
    fuse_sibling_matmuls(first)
    ptr = module.gate.untyped_storage().data_ptr()
    report = fuse_sibling_matmuls(second)
    assert [g["storage"] for g in report.fused] == ["view", "view"]
    assert module.gate.untyped_storage().data_ptr() == ptr
    assert second.autotp_fused_gate.untyped_storage().data_ptr() == ptr
    with torch.no_grad():
        torch.testing.assert_close(second(x)[3], first(x)[3], atol=0, rtol=0)


def test_training_graphs_are_not_fused() -> None:
    module = Siblings()
    x = torch.randn(2, 3, 10)
    gm = _traced(module, x)  # grad enabled: outputs require grad
    report = fuse_sibling_matmuls(gm)
    assert not report.fused and len(report.skipped) == 2
    assert all("training" in s["reason"] for s in report.skipped)
    assert _linears(gm) == 6
