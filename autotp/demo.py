"""The demo checkpoint: a small, seeded Llama-family model saved as a real Hugging Face folder.

``build_demo_checkpoint(folder)`` writes ``config.json``, ``generation_config.json`` and
``model.safetensors`` with ``save_pretrained``: 4 decoder layers, hidden 128, 8 attention heads
over 4 key/value heads (grouped-query attention), MLP 256, vocabulary 256, fp32, untied embeddings.
The weights are transformers' own initialization (``initializer_range=0.25``) under a fixed seed,
so every run builds the same bytes. There is no tokenizer: the demo feeds :data:`DEMO_PROMPT`, a fixed list of token ids.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["DEMO_PAD_ID", "DEMO_PROMPT", "DEMO_SEED", "build_demo_checkpoint", "demo_config"]

DEMO_SEED = 0
#: In the upper half of the 256-token vocabulary, so with a vocab-parallel embedding it lives on the
#: last rank's rows (the padding row must be found on the right shard).
DEMO_PAD_ID = 250
#: Starts with the BOS id (1); the rest are arbitrary ids spread over the vocabulary.
DEMO_PROMPT: tuple[int, ...] = (1, 17, 99, 3, 64, 12, 7, 200, 131, 45)


def demo_config():  # -> transformers.LlamaConfig (imported lazily: transformers is slow to import)
    """The demo model's ``LlamaConfig``."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=DEMO_PAD_ID,
        dtype="float32",
        # Wider than the default 0.02 so the greedy continuation is varied (at 0.02 it repeats one
        # token) and the top-2 logit gap of every greedy step stays > 0.07 for the first 32 new
        # tokens with seed 0: far above fp32 reordering noise (~1e-5), so "identical tokens" is a
        # meaningful, stable check.
        initializer_range=0.25,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def build_demo_checkpoint(folder: str | os.PathLike[str], *, seed: int = DEMO_SEED) -> Path:
    """Write the demo checkpoint to ``folder`` (created if needed) and return it as a ``Path``.

    The generation config is greedy (``do_sample=False``, one beam) with the pad/bos/eos ids of the
    model config, so ``model.generate(ids, max_new_tokens=K)`` needs no further arguments.
    """
    from transformers import GenerationConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = demo_config()
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    model.generation_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(folder, safe_serialization=True)
    return folder
