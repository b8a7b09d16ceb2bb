"""KV-cache cases at tp=2: a StaticCache generates the tokens of one process, beam search (which
reorders the cache between steps) gives the beams of one process, and a cache changed eagerly
between steps by the user (its sharded entries replaced) is refused instead of read as NaN.

Tolerance: greedy tokens identical to one transformers process (the tiny model's top-2 logit gaps
are far above fp32 reordering noise, as in test_generation.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
PAD_ID = 0


def _rank_static(rank: int, world: int, folder: str) -> list[int]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False)
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID,
                             cache_implementation="static")
    return out[0].tolist()


def test_a_static_cache_generates_the_tokens_of_one_process(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False,
                                      pad_token_id=PAD_ID)[0].tolist()
    for tokens in run_ranks(_rank_static, 2, str(folder), timeout=900):
        assert tokens == expected


EDITS = ("cloned", "cropped")


def _step_after_edit(model: torch.nn.Module, edit: str) -> str:
    """A prefill, ``edit`` applied to its cache eagerly, then a decode step: the refusal's message."""
    from autotp import AutoTPError

    ids = torch.tensor(PROMPT)
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    layer = cache.layers[0]
    if edit == "cloned":  # e.g. a user's copy of the cache (a beam reorder does the same)
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    else:  # "cropped": the last position dropped eagerly
        layer.keys, layer.values = layer.keys[..., :-1, :], layer.values[..., :-1, :]
    step = out.logits[:, -1:].argmax(-1)
    try:
        logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
    except AutoTPError as e:
        return str(e)
    return f"no error; finite: {bool(torch.isfinite(logits).all())}"


def _beam_search(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, num_beams=3,
                              pad_token_id=PAD_ID)[0].tolist()


def _rank_edited_caches(rank: int, world: int, folder: str) -> dict[str, Any]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False)
    with torch.no_grad():
        messages: dict[str, Any] = {edit: _step_after_edit(model, edit) for edit in EDITS}
    messages["beam search"] = _beam_search(model)
    return messages


@pytest.fixture(scope="module")
def edited_cache_messages(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's message per edit (one model on 2 ranks tries every edit, each on a fresh
    prefill), and its beam search's tokens with the one-process tokens under ``"expected"``."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path_factory.mktemp("edited") / "llama")
    expected = _beam_search(AutoModelForCausalLM.from_pretrained(folder).eval())
    return [{**r, "expected": expected} for r in run_ranks(_rank_edited_caches, 2, str(folder), timeout=900)]


def test_beam_search_reorders_the_sharded_cache_and_gives_the_beams_of_one_process(
        edited_cache_messages: list[dict[str, Any]]) -> None:
    # transformers reorders the cache between steps (reorder_cache: index_select on the batch dim);
    # on the stand-ins that lost the shards and the entry refused the cache. The reorder now runs
    # on each rank's heads (autotp/sharded_cache.py).
    for r in edited_cache_messages:
        assert r["beam search"] == r["expected"]


@pytest.mark.parametrize("edit", EDITS)
def test_a_cache_changed_eagerly_between_steps_is_refused(edited_cache_messages: list[dict[str, Any]],
                                                          edit: str) -> None:
    for messages in edited_cache_messages:
        message = messages[edit]
        assert "the KV cache passed in was changed outside the model: layer 0's 'keys'" in message, message
