"""The inner compiler: what runs this rank's rewritten graph (``AutoTPConfig.compile_inner``).

* ``"eager"``: the rewritten Dynamo ``GraphModule`` itself, as FX Python code; each collective is
  a :class:`~autotp.layers.Redistribute` module (an autograd Function around ``torch.distributed``).
* ``"inductor"``: a copy of the rewritten graph whose ``Redistribute`` modules are replaced by
  :class:`FunctionalRedistribute` (``autotp.collectives.functional_redistribute``:
  ``torch.distributed._functional_collectives`` + ``wait_tensor``), handed to
  ``torch.compile(..., backend="inductor")``. Dynamo traces that copy (the collectives become
  ``_c10d_functional`` graph ops that inductor lowers and may reorder around compute), guards on
  its local shapes and makes lengths that change (a decode step's cache) dynamic after one
  recompile. The compile happens at the first call, outside the outer Dynamo trace, on the real
  local inputs.

Inductor gets inference graphs only (no value requires grad): the functional collectives have no
autograd conjugates here. A graph it cannot take runs eagerly, with the reason in
``CompiledGraph.inner`` and the trace (``inner.json``): a training graph, a layer that communicates
inside (``ShardedSoftmax``, ``VocabParallelLoss``) or that owns a random stream, or a failure of
Dynamo / inductor at a call (the error is kept; the eager graph is then used for good). What Dynamo
cannot trace (a symbolic size computation) is a graph break, not a fallback.
Never a silently different program: both paths run the same ops and the same collectives.

Counting: compiled code does not run Python per collective, so under inductor each call adds the
graph's collectives by kind to ``Comm.counts``; ``Comm.bytes`` is not counted there.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn

from autotp.collectives import Comm, functional_redistribute, kind_of
from autotp.compat import TorchDynamoException
from autotp.layers import Redistribute, VocabParallelEmbedding
from autotp.placement import Placement
from autotp.plan import gradient_node

INNER_COMPILERS = ("eager", "inductor")

#: submodules the rewrite may insert that inductor can take as they are (pure local compute)
_LOCAL_MODULES = (VocabParallelEmbedding,)


class FunctionalRedistribute(nn.Module):
    """:class:`~autotp.layers.Redistribute` for a traced inner graph: forward only, through
    functional collectives."""

    def __init__(self, src: Placement, dst: Placement, comm: Comm, size: int | None = None) -> None:
        super().__init__()
        self.src, self.dst, self.comm, self.size = src, dst, comm, size

    def forward(self, x: Tensor) -> Tensor:
        return functional_redistribute(x, self.src, self.dst, self.comm, self.size)

    def extra_repr(self) -> str:
        return f"{self.src} -> {self.dst}, {kind_of(self.src, self.dst) or 'local'} (functional)"


def _blocker(gm: torch.fx.GraphModule) -> str | None:
    """Why inductor cannot take this graph, or None."""
    trains = gradient_node(gm)
    if trains is not None:
        return f"training graph ({trains.name} requires grad): functional collectives have no backward here"
    for n in gm.graph.nodes:
        if n.op == "call_module":
            module = gm.get_submodule(str(n.target))
            if isinstance(module, Redistribute):
                continue  # in an inference graph a grad_partial edge is its forward: identity or gather
            if not isinstance(module, _LOCAL_MODULES):
                return f"{n.name}: {type(module).__name__} communicates or draws random numbers inside"
    return None


def functional_copy(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, collections.Counter]:
    """A copy of ``gm`` whose collectives are :class:`FunctionalRedistribute` modules, and the
    collectives one call issues, by kind."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    inner = torch.fx.GraphModule(gm, graph)
    counts: collections.Counter = collections.Counter()
    for n in inner.graph.nodes:
        if n.op != "call_module":
            continue
        module = inner.get_submodule(str(n.target))
        if isinstance(module, Redistribute):
            name = f"{n.target}_functional"
            inner.add_submodule(name, FunctionalRedistribute(module.src, module.dst, module.comm, module.size))
            n.target = name
            kind = kind_of(module.src, module.dst)
            if kind:
                counts[kind] += 1
    inner.graph.lint()
    inner.recompile()
    if hasattr(inner, "real_recompile"):
        # a lazy GraphModule's forward is a stub in torch/fx (a Dynamo skipfile): with fullgraph=True
        # Dynamo would find no frame to compile; generate the real forward now
        inner.real_recompile()
    return inner, counts


def inner_compile(gm: torch.fx.GraphModule, compiler: str, comm: Comm) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The callable that runs ``gm`` on this rank, and what was decided (for the trace)."""
    if compiler == "eager":
        return gm.forward, {"compiler": "eager"}
    if comm.simulated:
        return gm.forward, {"compiler": "eager", "requested": compiler, "fallback": "simulated group (planning)"}
    reason = _blocker(gm)
    if reason is not None:
        return gm.forward, {"compiler": "eager", "requested": compiler, "fallback": reason}
    inner, counts = functional_copy(gm)
    forward = inner.forward

    def call_inner(*args: Any) -> Any:
        return forward(*args)

    # not fullgraph: what Dynamo cannot put in a graph (a symbolic size sum in a dynamic decode
    # graph) becomes a graph break, run by Python between compiled pieces, instead of a fallback
    compiled = torch.compile(call_inner, backend="inductor", dynamic=None)
    info: dict[str, Any] = {"compiler": compiler, "collectives_per_call": dict(counts)}
    state: dict[str, Any] = {}

    def run(*args: Any) -> Any:
        if not state.get("fell_back"):
            try:
                out = compiled(*args)
            except TorchDynamoException as e:
                # compiling (or recompiling for a new shape) failed; the graph is a pure function of
                # its inputs on every rank alike, so every rank reruns it eagerly the same way
                warnings.warn(f"autotp: inductor could not compile a graph ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); running it eagerly", stacklevel=2)
                info.update(compiler="eager", fallback=f"inductor failed: {type(e).__name__}: {str(e)[:500]}")
                state["fell_back"] = True
                return gm.forward(*args)  # the Redistribute modules count their own collectives
            comm.counts.update(counts)
            return out
        return gm.forward(*args)

    return run, info
