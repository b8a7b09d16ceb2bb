"""Past Dynamo's recompile limit autotp raises, never runs the forward uncompiled on its shards.

Dynamo runs a frame's own Python code once it has compiled ``torch._dynamo.config.recompile_limit``
versions of it; autotp's modules hold shards, so that code would compute without the collectives
(logits of the right shape, off by up to ~0.5 on this tiny Llama). With the plan cache on (stored
graphs) and off, and for an encoder-decoder's encoder, which is compiled apart; under the caller's own
``torch.compile(..., backend="autotp")`` the sharded modules refuse to run uncompiled, and the refusal
names the limit. Compared with one plain
transformers process: the first call's logits within atol 1e-5 / rtol 1e-4 (fp32, the row-parallel
sums reorder additions).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]


def _calls_past_a_limit_of_one(rank: int, world: int, folder: str, cache: str) -> dict:
    import os

    import torch._dynamo.config as dynamo_config
    from transformers import AutoModelForCausalLM

    from autotp import parallelize_model
    from autotp.errors import AutoTPError

    os.environ["AUTOTP_CACHE"] = cache  # this rank's process only
    model = parallelize_model(folder, tp_size=world)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad(), dynamo_config.patch(recompile_limit=1):
        first = model(input_ids=ids).logits
        try:
            model(input_ids=ids, output_hidden_states=True)  # a second version of the forward
        except AutoTPError as error:
            refused = str(error)
        else:
            refused = None
        want = reference(input_ids=ids).logits
    return {"first_error": float((first - want).abs().max()), "refused": refused,
            "first": first, "want": want}


@pytest.mark.parametrize("cache", ["1", "0"], ids=["cache-on", "cache-off"])  # stored graphs, or none (it ran uncompiled)
def test_a_call_past_the_recompile_limit_raises_on_every_rank_instead_of_running_uncompiled(tmp_path: Path,
                                                                                             cache: str) -> None:
    folder = save_tiny("llama", tmp_path / "llama")
    for got in run_ranks(_calls_past_a_limit_of_one, 2, str(folder), cache):
        torch.testing.assert_close(got["first"], got["want"], atol=1e-5, rtol=1e-4)
        assert got["refused"] is not None, "the second version ran uncompiled"
        assert "recompile_limit (1)" in got["refused"] and "wrong results" in got["refused"]


def _encoder_calls_past_a_limit_of_one(rank: int, world: int, folder: str) -> dict:
    import torch._dynamo.config as dynamo_config
    from transformers import AutoModelForSeq2SeqLM

    from autotp import parallelize_model
    from autotp.errors import AutoTPError

    model = parallelize_model(folder, tp_size=world)
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad(), dynamo_config.patch(recompile_limit=1):
        first = model.get_encoder()(input_ids=ids).last_hidden_state
        try:
            model.get_encoder()(input_ids=ids, output_hidden_states=True)  # a second version of the encoder
        except AutoTPError as error:
            refused = str(error)
        else:
            refused = None
        want = reference.get_encoder()(input_ids=ids).last_hidden_state
    return {"refused": refused, "first": first, "want": want}


def test_an_encoder_call_past_the_recompile_limit_raises_too(tmp_path: Path) -> None:
    """An encoder-decoder's encoder is compiled apart from the forward (``api._compile_encoder``),
    for ``generate``'s ``get_encoder()``; it ran uncompiled past the limit."""
    folder = save_tiny("t5", tmp_path / "t5")
    for got in run_ranks(_encoder_calls_past_a_limit_of_one, 2, str(folder)):
        torch.testing.assert_close(got["first"], got["want"], atol=1e-5, rtol=1e-4)
        assert got["refused"] is not None, "the encoder's second version ran uncompiled"
        assert "recompile_limit (1)" in got["refused"]


def _compiled_calls_past_a_limit_of_one(rank: int, world: int, folder: str) -> dict:
    import torch._dynamo.config as dynamo_config
    from transformers import AutoModelForCausalLM

    from autotp.errors import AutoTPError

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.forward = torch.compile(model.forward, backend="autotp")
    ids = torch.tensor(PROMPT)
    with torch.no_grad(), dynamo_config.patch(recompile_limit=1):
        first = model(input_ids=ids).logits
        try:
            model(input_ids=ids, output_hidden_states=True)  # a second version of the forward
        except AutoTPError as error:
            refused = str(error)
        else:
            refused = None
        want = reference(input_ids=ids).logits
    return {"refused": refused, "first": first, "want": want}


def test_under_the_users_own_compile_a_call_past_the_limit_is_refused_and_names_the_limit(tmp_path: Path) -> None:
    """``torch.compile(model.forward, backend="autotp")`` is the caller's compile, without autotp's
    compile settings: past the limit Dynamo runs the forward's code, whose modules hold shards and
    refuse to run uncompiled (``autotp/released.py``); the refusal names the limit as a cause."""
    folder = save_tiny("llama", tmp_path / "llama")
    for got in run_ranks(_compiled_calls_past_a_limit_of_one, 2, str(folder)):
        torch.testing.assert_close(got["first"], got["want"], atol=1e-5, rtol=1e-4)
        assert got["refused"] is not None, "the second version ran uncompiled"
        assert "recompile_limit (1)" in got["refused"], got["refused"]
