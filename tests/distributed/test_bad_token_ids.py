"""Token ids outside the vocabulary are refused before the graph runs, on every rank, and the model
keeps working for the next call.

One transformers process raises ``IndexError`` for such an id; under tensor parallelism the
vocab-parallel embedding would look it up on no rank and embed zeros, so without the check the
logits are finite and wrong. Tolerance of the follow-up call: logits equal to one process within
``atol=1e-5, rtol=1e-4`` (row-parallel sums reorder fp32 additions).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

VOCAB = 128
GOOD = [[5, 17, 99, 3, 64, 12, 7]]
BAD = {  # name -> (ids, the bad id, its index)
    "equal to the vocabulary size": ([[5, 17, VOCAB, 3]], VOCAB, "[0, 2]"),
    "far above the vocabulary": ([[5, 17, 3, 10**6]], 10**6, "[0, 3]"),
    "negative": ([[-1, 17, 3]], -1, "[0, 0]"),
    "in the second row of a batch": ([[5, 17, 3], [4, 200, 6]], 200, "[1, 1]"),
}


def _errors(model: torch.nn.Module, call: str) -> dict[str, str]:
    from autotp import AutoTPError

    out = {}
    for case, (ids, _, _) in BAD.items():
        try:
            with torch.no_grad():
                if call == "forward":
                    model(torch.tensor(ids))  # by position, as well as by keyword below
                elif call == "keyword":
                    model(input_ids=torch.tensor(ids))
                else:
                    model.generate(torch.tensor(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
        except AutoTPError as e:
            out[case] = str(e)
        else:
            out[case] = "no error"
    return out


def _rank(rank: int, world: int, folder: str) -> dict:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False)
    errors = {call: _errors(model, call) for call in ("forward", "keyword", "generate")}
    ids = torch.tensor(GOOD)
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # the model still works after the refusals
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0].tolist()
    try:
        model(input_ids=torch.tensor([[1.0, 2.0]]))
        float_error = "no error"
    except Exception as e:  # noqa: BLE001 - the test checks the type
        float_error = f"{type(e).__name__}: {e}"
    return {"errors": errors, "logits": logits, "tokens": tokens, "float_error": float_error}


@pytest.mark.parametrize("world", [1, 2])
def test_out_of_range_token_ids_are_refused_with_the_id_its_position_and_the_vocabulary(
        tmp_path: Path, world: int) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    for ids, _, _ in BAD.values():  # one process refuses every case too
        with pytest.raises(IndexError):
            reference(input_ids=torch.tensor(ids))
    with torch.no_grad():
        ref_logits = reference(input_ids=torch.tensor(GOOD)).logits
        ref_tokens = reference.generate(torch.tensor(GOOD), max_new_tokens=4, do_sample=False,
                                        pad_token_id=0)[0].tolist()

    results = run_ranks(_rank, world, str(folder), timeout=600)
    for r in results:  # every rank refuses, by itself
        for call, errors in r["errors"].items():
            for case, (_, bad_id, index) in BAD.items():
                message = errors[case]
                assert f"input_ids{index} is token id {bad_id}," in message, (call, case, message)
                assert f"the vocabulary has {VOCAB} entries" in message, (call, case, message)
        torch.testing.assert_close(r["logits"], ref_logits, atol=1e-5, rtol=1e-4)
        assert r["tokens"] == ref_tokens
        assert r["float_error"].startswith("AutoTPError: input_ids must hold integer token ids")
