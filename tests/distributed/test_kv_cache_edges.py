"""KV-cache cases at tp=2: a StaticCache generates the tokens of one process, and a cache changed
eagerly between steps (its sharded entries replaced) is refused instead of read as NaN.

Tolerance: greedy tokens identical to one transformers process (the tiny model's top-2 logit gaps
are far above fp32 reordering noise, as in test_generation.py).
"""

from __future__ import annotations

from pathlib import Path

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


def _rank_edited_caches(rank: int, world: int, folder: str) -> dict[str, str]:
    from autotp import parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False)
    with torch.no_grad():
        return {edit: _step_after_edit(model, edit) for edit in EDITS}


@pytest.fixture(scope="module")
def edited_cache_messages(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    """Each rank's message per edit: one model on 2 ranks tries every edit, each on a fresh prefill."""
    folder = save_tiny("llama", tmp_path_factory.mktemp("edited") / "llama")
    return run_ranks(_rank_edited_caches, 2, str(folder), timeout=900)


@pytest.mark.parametrize("edit", EDITS)
def test_a_cache_changed_eagerly_between_steps_is_refused(edited_cache_messages: list[dict[str, str]],
                                                          edit: str) -> None:
    for messages in edited_cache_messages:
        message = messages[edit]
        assert "the KV cache passed in was changed outside the model: layer 0's 'keys'" in message, message
