"""Eager attention stays tensor-parallel at any batch size (planner only, meta device, no weights).

Eager attention merges (batch, heads) into one dim (``view(B*H, S, D)`` then ``bmm``; BLOOM's alibi
is ``(H, 1, S)`` repeated ``B`` times). With heads sharded that merged dim is a strided shard
(``B`` segments of ``H``, ``autotp/ops/shape.py``), so attention runs on each rank's heads and a
batch-2 forward needs no more communication than the batch-1 warm-up that fixed the plan. Before,
the batch-2 graph gathered q, k and v (or all-to-all'd them) in every block.

Configs: the tiny ones of ``tests/_tiny.py`` (asserted to be Megatron's: 2 all-reduces per block,
nothing else), and Gemma-2-9B's and BLOOM-7B1's real widths with 2 layers (asserted: the batch-2
forward's collectives per block equal the batch-1 forward's, whatever plan the warm-up chose).
"""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from autotp.planner import plan_model
from tests._tiny import tiny_config
from tests.distributed.test_architectures import collectives_per_block

TP = 2


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


def _blocks(config: Any, batch: int) -> dict[int, dict[str, int]]:
    report = plan_model(config, TP, batch=batch, decode=False)
    return collectives_per_block(report.forward.sites)


@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_a_batch_2_forward_of_a_tiny_model_with_eager_attention_is_megatron(arch: str) -> None:
    assert _blocks(_eager(tiny_config(arch)), batch=2) == {layer: {"all_reduce": 2} for layer in range(2)}


@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_a_batch_2_forward_at_real_widths_communicates_no_more_per_block_than_batch_1(arch: str) -> None:
    one, two = _blocks(_real(arch), batch=1), _blocks(_real(arch), batch=2)
    assert two == one
    assert not any(kinds.get("all_to_all") for kinds in two.values())
