"""A plain call is completed into the warm-up's prefill keywords only where it means the same
computation (autotp/prefill_call.py); every other call passes through unchanged."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from transformers import DynamicCache

from autotp.prefill_call import PrefillCall

IDS = torch.tensor([[5, 17, 99]])


def forward(input_ids=None, attention_mask=None, cache=None, labels=None, use_cache=None, **kwargs):
    """The shape of a transformers causal LM's forward (keywords only matter here)."""


SIGNATURE = inspect.signature(forward)
CONFIG = SimpleNamespace(use_cache=True, return_dict=True)


def _prefill() -> PrefillCall:
    call = PrefillCall.record((), {"input_ids": torch.tensor([[1, 2, 3, 4, 5]]), "cache": DynamicCache(),
                                   "use_cache": True, "return_dict": True})
    assert call is not None
    return call


def test_a_keyword_call_gets_a_fresh_empty_cache_and_the_config_defaults_in_the_prefill_order() -> None:
    prefill = _prefill()
    args, kwargs = prefill.complete(SIGNATURE, (), {"input_ids": IDS}, CONFIG)
    assert args == ()
    assert list(kwargs) == ["input_ids", "cache", "use_cache", "return_dict"]
    assert kwargs["input_ids"] is IDS and kwargs["use_cache"] is True and kwargs["return_dict"] is True
    assert isinstance(kwargs["cache"], DynamicCache) and kwargs["cache"].get_seq_length() == 0
    again = prefill.complete(SIGNATURE, (), {"input_ids": IDS}, CONFIG)[1]["cache"]
    assert again is not kwargs["cache"]  # each call fills its own cache


def test_positional_ids_are_bound_to_their_name_and_none_is_the_models_default() -> None:
    args, kwargs = _prefill().complete(SIGNATURE, (IDS,), {"attention_mask": None, "use_cache": True}, CONFIG)
    assert args == () and list(kwargs) == ["input_ids", "cache", "use_cache", "return_dict"]


def test_calls_that_mean_something_else_pass_through_unchanged() -> None:
    prefill = _prefill()
    mask = torch.ones_like(IDS)
    cache = DynamicCache()
    for args, kwargs in [
        ((), {"input_ids": IDS, "attention_mask": mask}),  # a mask the prefill did not pass
        ((), {"input_ids": IDS, "labels": IDS}),  # a loss
        ((), {"input_ids": IDS, "use_cache": False}),  # no cache: another graph
        ((), {"input_ids": IDS, "cache": cache}),  # the caller's own cache (a decode step)
        ((), {"input_ids": IDS, "output_hidden_states": True}),  # a keyword the prefill did not pass
        ((), {}),  # no ids
        ((IDS, mask), {}),  # a positional mask
    ]:
        assert prefill.complete(SIGNATURE, args, kwargs, CONFIG) == (args, kwargs)


def test_a_left_out_constant_is_filled_only_where_the_config_default_is_the_prefills_value() -> None:
    prefill = _prefill()
    for config in (SimpleNamespace(use_cache=False, return_dict=True), SimpleNamespace(use_cache=True,
                                                                                      return_dict=False),
                   SimpleNamespace()):
        assert prefill.complete(SIGNATURE, (), {"input_ids": IDS}, config) == ((), {"input_ids": IDS})
    # passed explicitly at the prefill's value, the config's default does not matter
    kwargs = prefill.complete(SIGNATURE, (), {"input_ids": IDS, "use_cache": True, "return_dict": True},
                              SimpleNamespace())[1]
    assert list(kwargs) == ["input_ids", "cache", "use_cache", "return_dict"]


def test_a_prefill_that_cannot_be_described_records_nothing() -> None:
    assert PrefillCall.record((IDS,), {}) is None  # positional
    assert PrefillCall.record((), {"input_ids": IDS, "callback": object()}) is None
