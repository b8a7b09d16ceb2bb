"""A repeated decoder layer is traced once (``autotp/regions.py``) and planned per call
(``autotp/passes/inline.py``), with the tokens and logits of the plain model.

One process: the regions are a Dynamo-level change, so a capturing backend sees them. Tolerance:
none; a region runs the layer's own code on the same tensors, so every logit is bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from autotp.api import _layer_regions_wish
from autotp.compat import pickle_graph, unpickle_graph
from autotp.passes.inline import inline_subgraphs, is_subgraph_call
from autotp.plan_cache import graph_fingerprint
from autotp.planner import _module_path
from autotp.regions import MIN_LAYERS, install_layer_regions, regional_layers
from tests._capture import captured_graphs
from tests._tiny import tiny_model

PROMPT = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40]])


def _generate(model: torch.nn.Module, forward: object = None) -> object:
    if forward is not None:
        model.forward = forward
    with torch.no_grad():
        return model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=5, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)


def _graphs(model: torch.nn.Module) -> list[torch.fx.GraphModule]:
    fn = type(model).forward.__get__(model)
    return [gm for gm, _ in captured_graphs(fn, lambda compiled: _generate(model, compiled), dynamic=None)]


def _calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_subgraph_call(n))


#: a regional run: the generate's output, and each graph Dynamo traced as (its call count and bodies
#: as traced, the graph with every call inlined)
Regional = tuple[object, list[tuple[int, list[str], torch.fx.GraphModule]]]


def _regional_generate(arch: str, layers: int) -> Regional:
    """A generate of a tiny ``arch`` with ``layers`` layers and regions, compiled with what autotp's
    backend does first (every region call replaced by its body) and run: its output, and what each
    graph held before and after inlining."""
    model = tiny_model(arch, num_hidden_layers=layers).eval()
    install_layer_regions(model)
    graphs = []

    def inlining_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        calls, bodies = _calls(gm), [name for name, _ in gm.named_children()]
        assert inline_subgraphs(gm) == calls
        graphs.append((calls, bodies, gm))
        return gm.forward

    torch._dynamo.reset()
    out = _generate(model, torch.compile(type(model).forward.__get__(model), backend=inlining_backend, dynamic=None))
    return out, graphs


#: architecture -> layers of its regional run: 3, and Gemma-2's 4 (2 sliding-window layers, 2 global)
REGIONAL = {"llama": 3, "gemma2": 4, "mixtral": 3, "gpt2": 3, "bloom": 3, "falcon": 3}



@pytest.fixture(scope="module")
def regional() -> Callable[[str], Regional]:
    """``regional(arch)``: :func:`_regional_generate` of ``arch`` at :data:`REGIONAL`'s depth, once per
    module: the tokens-and-logits test compares its output, the other tests read its graphs (a
    second trace of the same generate cost as much and showed the same graphs)."""
    runs: dict[str, Regional] = {}

    def run(arch: str) -> Regional:
        if arch not in runs:
            runs[arch] = _regional_generate(arch, REGIONAL[arch])
        return runs[arch]

    return run


@pytest.fixture(scope="module")
def regional_llama(regional: Callable[[str], Regional]) -> list[tuple[int, list[str], torch.fx.GraphModule]]:
    """Each graph of a generate of a 3-layer tiny Llama with regions: its call count and bodies as
    Dynamo traced it, then the graph with every call inlined (as autotp's backend gets it)."""
    return regional("llama")[1]


def test_each_graph_traces_one_layer_body_and_calls_it_once_per_layer(regional_llama: list) -> None:
    assert len(regional_llama) == 3  # the prefill, the first decode step and the symbolic one
    for calls, bodies, _ in regional_llama:
        assert len(bodies) == 1, f"one traced body per graph, got {bodies}"
        assert calls == 3


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "mixtral"])
def test_every_layer_goes_through_its_region_whatever_its_cache_is_called_and_however_it_is_passed(
        regional: Callable[[str], Regional], arch: str) -> None:
    # GPT-2's blocks take the cache by position, BLOOM's (as GPT-NeoX's) as ``layer_past``; BLOOM's
    # return (hidden states, attention weights). Falcon's (``layer_past`` and such a tuple too) are
    # not reused in the symbolic decode graph: its linear layers read ``self.weight.T``, a value
    # Dynamo computes outside the body and cannot map to another layer's, so each body is traced
    # anew there (``compat.stamped_regions_keep_bound_sizes``), as without regions; its tokens and
    # logits are checked with the others'
    _, graphs = regional(arch)
    assert graphs and [(calls, len(bodies)) for calls, bodies, _ in graphs] == [(REGIONAL[arch], 1)] * len(graphs)


def _inlining_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """What autotp's backend does first: every region call replaced by its body."""
    inline_subgraphs(gm)
    return gm.forward


@pytest.mark.parametrize("arch", list(REGIONAL))
def test_a_generate_through_inlined_regions_gives_the_plain_models_tokens_and_logits_exactly(
        regional: Callable[[str], Regional], arch: str) -> None:
    reference = _generate(tiny_model(arch, num_hidden_layers=REGIONAL[arch]).eval())
    out, _ = regional(arch)
    assert torch.equal(out.sequences, reference.sequences)
    for step, (a, b) in enumerate(zip(out.logits, reference.logits, strict=True)):
        assert torch.equal(a, b), f"{arch}: decode step {step} differs by {(a - b).abs().max().item()}"


def test_inlined_regions_run_the_tensor_ops_dynamo_traces_without_them_in_order_and_in_their_modules(
        regional_llama: list) -> None:
    plain = tiny_model("llama", num_hidden_layers=3).eval()

    def ops(gm: torch.fx.GraphModule) -> list[tuple[str, str | None]]:
        # tensor ops only: with symbolic sizes a body reads its inputs' sizes on its own
        # (dead size getitems), where the one inlined trace computed them once (sym_sum)
        return [(str(n.target), _module_path(n) if n.meta.get("nn_module_stack") else None)
                for n in gm.graph.nodes
                if n.op in ("call_function", "call_method") and isinstance(n.meta.get("example_value"), torch.Tensor)]

    for without, (_, _, inlined) in zip(_graphs(plain), regional_llama, strict=True):
        assert not list(inlined.named_children()) and _calls(inlined) == 0
        assert ops(inlined) == ops(without)


def test_sliding_window_layers_go_through_regions_and_each_kind_gets_its_own_body_where_they_differ(
        regional: Callable[[str], Regional]) -> None:
    # Gemma-2 alternates sliding-window layers (a DynamicSlidingWindowLayer cache) and global ones
    _, graphs = regional("gemma2")  # 4 layers: the prefill and the decode graphs
    assert len(graphs) > 1
    for calls, _, _ in graphs:
        assert calls == 4  # every layer, none inlined
    # the prefill's 8 tokens overfill the window of 4: a decode step's sliding layers hold 3
    # positions, its global ones 8 or more, so the two kinds are two bodies from then on
    assert [len(bodies) for _, bodies, _ in graphs] == [1] + [2] * (len(graphs) - 1)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "gradient-checkpointed"])
def test_a_training_step_without_a_cache_goes_through_one_body_unless_checkpointed(checkpointed: bool) -> None:
    model = tiny_model("llama", num_hidden_layers=3).train()
    reference = tiny_model("llama", num_hidden_layers=3).train()
    if checkpointed:  # transformers checkpoints each layer's call: the layer runs its own forward
        model.activation_checkpointing_enable()
    install_layer_regions(model)
    labels = PROMPT.clone()
    graphs = []

    def inlining_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append((_calls(gm), len(list(gm.named_children()))))
        return _inlining_backend(gm, example_inputs)

    torch._dynamo.reset()
    loss = torch.compile(model, backend=inlining_backend)(input_ids=PROMPT, labels=labels, use_cache=False).loss
    loss.backward()
    ref = reference(input_ids=PROMPT, labels=labels, use_cache=False).loss
    ref.backward()
    assert graphs and all(calls == (0 if checkpointed else 3) for calls, _ in graphs), graphs
    assert torch.equal(loss.detach(), ref.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), name


def test_an_encoders_layers_go_through_one_body() -> None:
    model = tiny_model("bert", num_hidden_layers=3).eval()
    reference = tiny_model("bert", num_hidden_layers=3).eval()
    install_layer_regions(model)
    graphs = []

    def inlining_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append((_calls(gm), len(list(gm.named_children()))))
        return _inlining_backend(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=inlining_backend)(input_ids=PROMPT).last_hidden_state
        want = reference(input_ids=PROMPT).last_hidden_state
    assert graphs == [(3, 1)]
    assert torch.equal(out, want)


def test_models_without_one_stack_of_cached_layers_are_left_alone() -> None:
    assert regional_layers(tiny_model("t5")) == []  # an encoder-decoder: two stacks
    model = tiny_model("llama")
    before = [type(layer) for layer in model.model.layers]
    assert install_layer_regions(model, min_layers=MIN_LAYERS) == 0  # 2 layers: too shallow by default
    assert [type(layer) for layer in model.model.layers] == before
    assert install_layer_regions(model) == 2 and install_layer_regions(model) == 2
    assert [type(layer).__mro__[1] for layer in model.model.layers] == before  # swapped once, not twice


def test_the_cache_layer_state_the_wrapper_sets_outside_the_region_is_what_dynamic_layer_initializes() -> None:
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    before = set(vars(layer))
    layer.lazy_initialization(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    changed = {name for name, value in vars(layer).items() if name not in before or value is not None}
    assert changed == {"device", "keys", "values", "is_initialized"}


@pytest.mark.parametrize("initialized", [False, True], ids=["fresh", "initialized-empty"])
@pytest.mark.parametrize("prompt", [2, 3, 6])  # inside the window of 4, filling it, overfilling it
def test_the_sliding_window_layer_state_the_wrapper_sets_is_what_two_updates_leave(prompt: int,
                                                                                   initialized: bool) -> None:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from autotp.regions import _hold_window

    states = [torch.randn(1, 2, n, 4) for n in (prompt, 1)]  # a prefill's keys, then a decode step's
    plain, held = DynamicSlidingWindowLayer(sliding_window=4), DynamicSlidingWindowLayer(sliding_window=4)
    if initialized:  # initialized before the first update (the planner's cache): 1-d empty keys
        plain.lazy_initialization(states[0], states[0])
        held.lazy_initialization(states[0], states[0])
    for new in states:
        want_keys, want_values = plain.update(new, -new)
        region = DynamicLayer()  # what the region's stand-in does: the past and the new states concatenated
        if held.is_initialized:
            region.lazy_initialization(new, -new)
            region.keys, region.values = held.keys, held.values
        keys, values = region.update(new, -new)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)  # what the attention reads
        _hold_window(held, keys, values)
        assert held.cumulative_length == plain.cumulative_length
        assert torch.equal(held.keys, plain.keys) and torch.equal(held.values, plain.values)
        assert (held.is_initialized, held.device) == (plain.is_initialized, plain.device)
        assert torch.equal(held._sliding_window_tensor, plain._sliding_window_tensor)
        assert held.get_mask_sizes(1) == plain.get_mask_sizes(1)


def test_layer_regions_are_left_to_the_depth_unless_the_option_or_the_environment_says() -> None:
    assert _layer_regions_wish(None, {}) is None  # parallelize_model: on from regions.MIN_LAYERS layers
    assert _layer_regions_wish(None, {"AUTOTP_LAYER_REGIONS": "0"}) is False
    assert _layer_regions_wish(None, {"AUTOTP_LAYER_REGIONS": "off"}) is False
    assert _layer_regions_wish(None, {"AUTOTP_LAYER_REGIONS": "1"}) is True
    assert _layer_regions_wish(False, {"AUTOTP_LAYER_REGIONS": "1"}) is False
    assert _layer_regions_wish(True, {"AUTOTP_LAYER_REGIONS": "0"}) is True


def test_an_inlined_graph_keys_the_plan_cache_as_its_stored_copy_does(regional_llama: list) -> None:
    # a warm launch plans the stored (pickled) graph: its key must be the one the cold launch
    # stored its plan under, symbolic decode graphs included (their bodies read torch.Size values)
    for _, _, gm in regional_llama:
        assert graph_fingerprint(unpickle_graph(pickle_graph(gm))) == graph_fingerprint(gm)


@pytest.mark.parametrize("flow", ["batch 1 then batch 2", "32 tokens then 8"])
def test_recompiles_that_specialize_a_size_a_region_read_compile_and_match_the_plain_model(flow: str) -> None:
    # torch 2.13 failed these before autotp.compat.stamped_regions_keep_bound_sizes: a recompile
    # specialized a size the first layer's region read, and stamping out the next layer's call
    # raised KeyError (the batch at 2 where transformers compares it; a new prompt length)
    plain = tiny_model("llama").eval()
    model = tiny_model("llama").eval()
    install_layer_regions(model)
    torch._dynamo.reset()
    model.forward = torch.compile(type(model).forward.__get__(model), backend=_inlining_backend, dynamic=None)
    with torch.no_grad():
        for n in ((32, 8) if flow == "batch 1 then batch 2" else (32,)):
            ids = torch.arange(n).view(1, n) % 100
            assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    if flow == "batch 1 then batch 2":
        assert torch.equal(_generate(model).sequences, _generate(plain).sequences)
    else:
        prompt = PROMPT[:1]
        with torch.no_grad():
            out, ref = (m.generate(prompt, max_new_tokens=5, do_sample=False) for m in (model, plain))
        assert torch.equal(out, ref)
