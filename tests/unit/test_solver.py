"""The solver on captured graphs, in one process (no ranks needed: solving is pure)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Any

import pytest
import torch

from autotp.collectives import kind_of
from autotp.passes.annotate import annotate
from autotp.passes.decompose import decompose
from autotp.passes.solve import ParamChoice, SolverOptions, solve
from autotp.placement import R, Shard, shard_candidates
from tests._tiny import tiny_model


def _capture(model: torch.nn.Module, first: dict[str, Any] | None = None,
             **inputs: Any) -> tuple[torch.fx.GraphModule, list]:
    """The graph Dynamo compiles for a call with ``inputs``; after a call with ``first`` (other
    sizes) when given, so that graph is the dynamic-shape recompile."""
    captured: list = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        if first is not None:
            compiled(**first)
        compiled(**inputs)
    return captured[-1]


def _plan(model: torch.nn.Module, world: int, recursion_limit: int | None = None, beam_width: int = 32,
          pinned: dict[str, Any] | None = None, first: dict[str, Any] | None = None,
          options: dict[str, Any] | None = None, **inputs: Any):
    """Solve one captured forward; ``pinned`` (placeholder name -> placement) fixes the parameters
    as a later graph of parallelize_model sees them, otherwise the solve decides them; ``first``:
    see :func:`_capture`; ``options``: more :class:`SolverOptions` fields."""
    gm, example = _capture(model, first, **inputs)
    shadow = decompose(gm, example)
    fixed, free, param_nodes = {}, {}, set()
    for (aten, dyn), value in zip(shadow.placeholders, example, strict=True):
        if isinstance(value, torch.nn.Parameter) and pinned is not None:
            fixed[aten] = pinned[dyn.name]
            param_nodes.add(aten)
        elif isinstance(value, torch.nn.Parameter):
            nbytes = value.numel() * value.element_size()
            free[aten] = ParamChoice([(R, nbytes * (world - 1) / world)]
                                     + [(s, 0.0) for s in shard_candidates(tuple(value.shape), world)],
                                     tuple(value.shape))
        else:
            fixed[aten] = R
    tokens = inputs["input_ids"].numel()
    limit = sys.getrecursionlimit()
    if recursion_limit:
        sys.setrecursionlimit(recursion_limit)  # the solver must not recurse per node
    try:
        start = time.perf_counter()
        solution = solve(shadow, SolverOptions(world_size=world, tokens=tokens, beam_width=beam_width, **(options or {})),
                         fixed, free, param_nodes | set(free))
        solution.trace.seconds = time.perf_counter() - start
    finally:
        sys.setrecursionlimit(limit)
    annotation = annotate(shadow, solution)
    collectives: Counter = Counter()
    shared = set()
    for node, plan in annotation.plans.items():
        leaves: list = []
        torch.fx.node.map_arg((node.args, node.kwargs), leaves.append)
        for (leaf, sub), e in plan.edges.items():
            key = (leaves[leaf], sub, e.src, e.dst)  # the rewrite shares one collective per key
            if e.src is not None and e.src != e.dst and kind_of(e.src, e.dst) and key not in shared:
                shared.add(key)
                collectives[kind_of(e.src, e.dst)] += 1
    params = {dyn.name: solution.placements[aten] for aten, dyn in shadow.placeholders
              if aten in free or aten in param_nodes}
    return solution, collectives, params


@pytest.mark.slow
def test_a_40_layer_model_solves_iteratively_and_reuses_repeated_blocks() -> None:
    model = tiny_model("llama", num_hidden_layers=40).eval()
    solution, collectives, params = _plan(model, 2, recursion_limit=200,
                                          input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)
    assert collectives == {"all_reduce": 2 * 40 + 1, "all_gather": 1}
    assert solution.trace.reused_nodes > 0.8 * len(solution.placements)  # ~38 of 40 blocks reused
    assert solution.trace.seconds < 120


def test_the_llama_plan_is_megatron_with_two_all_reduces_per_block_at_tp4() -> None:
    model = tiny_model("llama", num_hidden_layers=3).eval()
    _, collectives, params = _plan(model, 4, input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)
    assert collectives == {"all_reduce": 2 * 3 + 1, "all_gather": 1}
    by_suffix = {name.split("_modules_")[-1]: str(p) for name, p in params.items()}
    assert by_suffix["q_proj_parameters_weight_"] == "S(0)"
    assert by_suffix["o_proj_parameters_weight_"] == "S(1)"
    assert by_suffix["down_proj_parameters_weight_"] == "S(1)"
    assert by_suffix["embed_tokens_parameters_weight_"] == "S(0)"


@pytest.mark.parametrize("beam_width", [2, 32])
def test_a_long_prefill_with_pinned_megatron_weights_keeps_all_reduces_instead_of_scatter_gather_pairs(
        beam_width: int) -> None:
    """A reduce-scatter now and an all-gather later move the bytes of one all-reduce, plus one more
    collective; before its all-gather is paid the pair looks cheaper and spawns more partial plans,
    which used to crowd the all-reduce out of the beam (at the default width too). The beam keeps
    the best state for every live placement, so the cheaper plan survives even at width 2."""
    model = tiny_model("llama", num_hidden_layers=3).eval()
    _, warmup, megatron = _plan(model, 2, input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)
    assert warmup == {"all_reduce": 2 * 3 + 1, "all_gather": 1}
    prompt = (torch.arange(16) % 50 + 1).unsqueeze(0)  # (1, 16)
    _, prefill, _ = _plan(model, 2, beam_width=beam_width, pinned=megatron, input_ids=prompt, use_cache=False)
    assert prefill == {"all_reduce": 2 * 3 + 1, "all_gather": 1}


def test_the_plan_of_a_long_prompt_is_the_plan_of_a_short_one() -> None:
    """Every cost term is per token (a collective's latency included), so a 64-token first call
    stores the weights and reduces exactly as a 5-token one."""
    model = tiny_model("llama", num_hidden_layers=3).eval()
    short, short_collectives, short_params = _plan(model, 2, input_ids=torch.tensor([[1, 2, 3, 4, 5]]),
                                                   use_cache=False)
    prompt = (torch.arange(64) % 50 + 1).unsqueeze(0)  # (1, 64)
    long, long_collectives, long_params = _plan(model, 2, input_ids=prompt, use_cache=False)
    assert long_collectives == short_collectives == {"all_reduce": 2 * 3 + 1, "all_gather": 1}
    assert long_params == short_params
    assert long.cost == pytest.approx(short.cost, rel=1e-9)



#: sequence parallelism's objective (backend._sequence_parallel): full-size activations priced,
#: no latency per collective, so a reduce-scatter into sequence shards beats an all-reduce
SEQUENCE_PARALLEL = {"activation_weight": 1.0, "latency_bytes": 0.0}


@pytest.mark.parametrize(("dynamic", "shard_symbolic_dims", "splits_sequence"), [
    (False, False, True),  # a static 16-token graph: 16 divides by 2, the sequence is split
    (True, False, False),  # the same graph after a 5-token call: its length is a symbol, kept whole
    (True, True, True),    # unless the caller vouches that every length divides (sequence_parallel)
])
def test_a_dynamic_graph_splits_its_symbolic_length_only_when_every_length_is_known_to_divide(
        dynamic: bool, shard_symbolic_dims: bool, splits_sequence: bool) -> None:
    """Dynamo reuses a dynamic-shape graph for every length, so a plan that splits a length of 16
    would fail on 15 tokens (a reduce-scatter of an odd length)."""
    model = tiny_model("llama", num_hidden_layers=2).eval()
    _, _, megatron = _plan(model, 2, input_ids=torch.tensor([[1, 2, 3, 4, 5]]), use_cache=False)
    prompt = (torch.arange(16) % 50 + 1).unsqueeze(0)  # (1, 16)
    first = {"input_ids": torch.tensor([[1, 2, 3, 4, 5]]), "use_cache": False} if dynamic else None
    solution, collectives, _ = _plan(model, 2, pinned=megatron, first=first,
                                     options={**SEQUENCE_PARALLEL, "shard_symbolic_dims": shard_symbolic_dims},
                                     input_ids=prompt, use_cache=False)
    split = [n.name for n, p in solution.placements.items()  # values split on a dim of size 16 (the length)
             if isinstance(p, Shard) and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].shape[p.dim] == 16]
    assert bool(split) is splits_sequence, split[:5]
    assert "reduce_scatter" in collectives  # sequence parallelism still scatters (on the hidden dim if it must)
