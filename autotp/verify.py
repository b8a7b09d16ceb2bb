"""``verify=True``: check a plan against a replicated run on its first call, node by node.

The first call of a verified graph runs twice on every rank: the original Dynamo graph with full
(replicated) parameters, and the rewritten graph on local shards. Then, in graph order, every
tensor a Dynamo node produced on shards is brought to its full value — ``Shard(d)`` gathered,
``Partial`` summed — and compared with the replicated value. The first node that differs beyond
the tolerance raises :class:`~autotp.errors.AutoTPError` naming the node, its op, its placement
and the difference: a wrong rule or rewrite is reported where it happens, not as a wrong logit
forty layers later. Every rank runs the same comparisons (one collective per non-replicated
node), so all of them raise, or none. Later calls run the rewritten graph only.

Costs of the first call: one replicated forward (full parameters, read once more from the
checkpoint) and one gather per node; a debugging aid, off by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from autotp.collectives import Comm, full_tensor
from autotp.errors import AutoTPError
from autotp.placement import R, Replicate, Shard

#: (rtol, atol) relative to the reference tensor's largest magnitude, per dtype
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-9, 1e-10),
             torch.bfloat16: (2e-2, 1e-2), torch.float16: (5e-3, 1e-3)}


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps every node's value by node name."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _full(local: torch.Tensor, placement: Any, comm: Comm, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole value (global ``shape``: a shard may be uneven) from this rank's piece."""
    return full_tensor(local, placement, comm, size=shape[placement.dim] if isinstance(placement, Shard) else None)


def _differs(full: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The largest absolute difference when it exceeds the tolerance, else None."""
    if full.shape != ref.shape:
        return float("inf")
    if not full.dtype.is_floating_point:
        return None if torch.equal(full, ref) else float((full != ref).sum())
    rtol, atol = TOLERANCE.get(ref.dtype, (1e-4, 1e-5))
    ref64, full64 = ref.detach().double(), full.detach().double()
    scale = float(ref64.abs().max()) if ref64.numel() else 0.0
    diff = float((full64 - ref64).abs().max()) if ref64.numel() else 0.0
    if diff != diff or diff > atol + rtol * max(scale, 1.0):  # NaN counts as a difference
        return diff
    return None


def verified(run: Callable[..., Any], reference: torch.fx.GraphModule, rewritten: torch.fx.GraphModule,
             placements: dict[str, Any], full_params: dict[int, Callable[[], torch.Tensor]],
             comm: Comm) -> Callable[..., Any]:
    """``run`` whose first call is checked against ``reference`` (see the module docstring).

    ``placements``: Dynamo node name -> output placement (a tuple for multi-output nodes);
    ``full_params``: argument position -> a function returning that parameter's full tensor.
    """
    state = {"done": False}

    def call(*args: Any) -> Any:
        if state["done"]:
            return run(*args)
        state["done"] = True
        ref_args = list(args)
        for i, load in full_params.items():
            ref_args[i] = load()
        with torch.no_grad():
            ref = _Recorder(reference)
            ref.run(*ref_args)
            local = _Recorder(rewritten)
            local.run(*args)
            _compare(reference, ref.values, local.values, placements, comm)
        return run(*args)

    return call


def _compare(reference: torch.fx.GraphModule, ref_values: dict[str, Any], local_values: dict[str, Any],
             placements: dict[str, Any], comm: Comm) -> None:
    for n in reference.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        ref, local, placement = ref_values.get(n.name), local_values.get(n.name), placements.get(n.name)
        pairs = ([(ref, local, placement)] if isinstance(ref, torch.Tensor) else
                 list(zip(ref, local, placement if isinstance(placement, tuple) else [placement] * len(ref),
                          strict=False))
                 if isinstance(ref, (tuple, list)) and isinstance(local, (tuple, list)) else [])
        for k, (r, lo, p) in enumerate(pairs):
            if not isinstance(r, torch.Tensor) or not isinstance(lo, torch.Tensor):
                continue
            full = _full(lo, p if p is not None else R, comm, tuple(r.shape))
            diff = _differs(full, r)
            if diff is not None:
                where = f"{n.name}" + (f"[{k}]" if len(pairs) > 1 else "")
                shown = p if p is not None and not isinstance(p, Replicate) else "R"
                raise AutoTPError(
                    f"verify: the parallel plan diverges from the replicated run first at Dynamo node "
                    f"{where} ({n.op} {getattr(n.target, '__name__', n.target)}), placed {shown}: max |difference| "
                    f"{diff:.3g} (shape {tuple(full.shape)} vs {tuple(r.shape)}). Earlier nodes agree. This is "
                    "a bug in an autotp rule or rewrite for that op: run with trace_dir= and report the "
                    "trace; overrides= can pin the parameters around it to 'replicate' meanwhile."
                )
