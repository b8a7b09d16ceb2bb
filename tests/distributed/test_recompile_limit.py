"""Past Dynamo's recompile limit autotp raises, never runs the forward uncompiled on its shards.

Dynamo runs a frame's own Python code once it has compiled ``torch._dynamo.config.recompile_limit``
versions of it; autotp's modules hold shards, so that code would compute without the collectives
(logits of the right shape, off by up to ~0.5 on this tiny Llama). Each entry is held to it:
``parallelize_model`` with the plan cache on (stored graphs) and off (a bare ``torch.compile`` ran it
uncompiled), an encoder-decoder's encoder, which is compiled apart (it ran uncompiled too), and the
caller's own ``torch.compile(..., backend="autotp")``, where the modules the backend sharded refuse to
run uncompiled and the refusal names the limit. Compared with one plain transformers process: the
first call's output within atol 1e-5 / rtol 1e-4 (fp32, the row-parallel sums reorder additions).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]

#: entry -> the tiny architecture it runs (what each compiles and calls: :func:`_calls_past_a_limit_of_one`)
ENTRIES = {"cache-on": "llama", "cache-off": "llama", "encoder": "t5", "users-compile": "llama"}


def _calls_past_a_limit_of_one(rank: int, world: int, folder: str, entry: str) -> dict:
    """The entry's first call, then a second kind of call (``output_hidden_states``: a second
    compiled version) under a recompile limit of 1: the first call's output, the one-process
    output, and the refusal's text (None: the second call ran)."""
    import os

    import torch._dynamo.config as dynamo_config
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from autotp import parallelize_model
    from autotp.errors import AutoTPError

    plain = AutoModelForSeq2SeqLM if entry == "encoder" else AutoModelForCausalLM
    reference = plain.from_pretrained(folder).eval()
    if entry == "users-compile":
        model = plain.from_pretrained(folder).eval()
        model.forward = torch.compile(model.forward, backend="autotp")
    else:
        os.environ["AUTOTP_CACHE"] = "0" if entry == "cache-off" else "1"  # this rank's process only
        model = parallelize_model(folder, tp_size=world)

    def call(of: torch.nn.Module, **kwargs: bool) -> torch.Tensor:
        if entry == "encoder":
            return of.get_encoder()(input_ids=torch.tensor(PROMPT), **kwargs).last_hidden_state
        return of(input_ids=torch.tensor(PROMPT), **kwargs).logits

    with torch.no_grad(), dynamo_config.patch(recompile_limit=1):
        first = call(model)
        try:
            call(model, output_hidden_states=True)
        except AutoTPError as error:
            refused = str(error)
        else:
            refused = None
        want = call(reference)
    return {"refused": refused, "first": first, "want": want}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_call_past_the_recompile_limit_is_refused_on_every_rank_instead_of_running_uncompiled(
        tmp_path: Path, entry: str) -> None:
    folder = save_tiny(ENTRIES[entry], tmp_path / ENTRIES[entry])
    for got in run_ranks(_calls_past_a_limit_of_one, 2, str(folder), entry):
        torch.testing.assert_close(got["first"], got["want"], atol=1e-5, rtol=1e-4)
        assert got["refused"] is not None, "the second version ran uncompiled"
        assert "recompile_limit (1)" in got["refused"], got["refused"]
        if entry != "users-compile":
            assert "wrong results" in got["refused"], got["refused"]
