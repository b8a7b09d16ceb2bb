"""Eager attention stays tensor-parallel at any batch size (planner only, meta device, no weights).

Eager attention merges (batch, heads) into one dim (``view(B*H, S, D)`` then ``bmm``; BLOOM's alibi
is ``(H, 1, S)`` repeated ``B`` times). With heads sharded that merged dim is a strided shard
(``B`` segments of ``H``, ``autotp/ops/shape.py``), so attention runs on each rank's heads and a
batch-2 forward needs no more communication than the batch-1 warm-up that fixed the plan. Before,
the batch-2 graph gathered q, k and v (or all-to-all'd them) in every block.

Configs: the tiny ones of ``tests/_tiny.py`` at tp=2, and Gemma-2-9B's and BLOOM-7B1's real widths
with 2 layers at tp 2 and 4 (the batch-1 plans of real widths: ``test_plans_at_real_widths.py``).
Asserted: a batch-2 forward is Megatron's, 2 all-reduces per block and nothing else in a block,
and at most one all-gather in the whole forward (the logits, at the model boundary).

Tolerances: none, these are exact counts of the collectives the planned program issues.
"""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from autotp.planner import plan_model
from tests._tiny import tiny_config


def _eager(config: Any) -> Any:
    config._attn_implementation = "eager"  # Gemma-2 needs it for its logit soft-capping
    return config


def _real(arch: str) -> Any:
    """A public model's widths with 2 layers (nothing read from the Hub)."""
    if arch == "gemma2":  # Gemma-2-9B
        config = transformers.Gemma2Config(hidden_size=3584, num_attention_heads=16, num_key_value_heads=8,
                                           head_dim=256, intermediate_size=14336, vocab_size=256000,
                                           num_hidden_layers=2)
        config.architectures = ["Gemma2ForCausalLM"]
    else:  # BLOOM-7B1
        config = transformers.BloomConfig(hidden_size=4096, n_head=32, n_layer=2, vocab_size=250880)
        config.architectures = ["BloomForCausalLM"]
    return _eager(config)


def _assert_megatron_at_batch_2(config: Any, tp: int) -> None:
    report = plan_model(config, tp, batch=2, decode=False)
    assert list(report.block_collectives().values()) == [{layer: {"all_reduce": 2} for layer in range(2)}]  # one stack
    gathers = [s["origin"] for s in report.forward.sites if s["kind"] == "all_gather"]
    assert len(gathers) <= 1, gathers


@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_a_batch_2_forward_of_a_tiny_model_with_eager_attention_is_megatron(arch: str) -> None:
    _assert_megatron_at_batch_2(_eager(tiny_config(arch)), 2)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_a_batch_2_forward_at_real_widths_is_megatron(arch: str, tp: int) -> None:
    _assert_megatron_at_batch_2(_real(arch), tp)
