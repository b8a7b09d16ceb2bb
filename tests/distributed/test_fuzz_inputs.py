"""Fuzz: generated inputs to a model parallelized over two ranks (the other half of the fuzz cases
is ``tests/unit/test_fuzz_bad_checkpoints.py``).

Cases from a seeded generator: token ids out of range (at, above and far above the vocabulary,
negative, at random positions of random shapes), empty batches and empty sequences, ids of the
wrong dtype (float, bool, complex), 2-D attention masks of the wrong batch or too short, and valid
inputs of random lengths with and without a mask. Every case runs on both ranks against one loaded
model; each must end alike on both, in an ``AutoTPError`` for a bad input, or, for a valid one, in
logits equal to one transformers process at ``atol=1e-5, rtol=1e-4`` (row-parallel sums reorder
fp32 additions). The whole run is bounded by the harness's timeout, so a rank left waiting fails
the test instead of hanging it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

VOCAB = 128
SEED = 21


def _cases() -> list[tuple[str, bool, dict[str, Any]]]:
    """``(label, valid, kwargs)``; tensors are built from the seed alone, alike on every rank."""
    rng = random.Random(SEED)
    g = torch.Generator().manual_seed(SEED)
    cases: list[tuple[str, bool, dict[str, Any]]] = []

    def ids(b: int, s: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (b, s), generator=g)

    for _ in range(36):
        b, s = rng.randint(1, 3), rng.randint(1, 12)
        x = ids(b, s)
        bad = rng.choice([VOCAB, VOCAB + 1, rng.randint(VOCAB, 10**9), -1, -rng.randint(2, 10**6)])
        x[rng.randrange(b), rng.randrange(s)] = bad
        cases.append((f"id {bad} in a {b}x{s} batch", False, {"input_ids": x}))
    for b, s in [(0, 5), (1, 0), (3, 0), (0, 0)]:
        cases.append((f"empty {b}x{s} input_ids", False, {"input_ids": torch.zeros(b, s, dtype=torch.long)}))
    for dtype in (torch.float32, torch.float16, torch.bool, torch.complex64, torch.float64):
        cases.append((f"input_ids of dtype {dtype}", False, {"input_ids": ids(1, 4).to(dtype)}))
    for _ in range(24):
        b, s = rng.randint(1, 3), rng.randint(2, 10)
        mb, ms = rng.choice([(b + 1, s), (b, s - 1), (b + 2, max(s - 2, 1)), (max(b - 1, 0), s)])
        if (mb, ms) == (b, s) or mb == 0:
            mb, ms = b, s - 1
        cases.append((f"{mb}x{ms} mask for {b}x{s} ids", False,
                      {"input_ids": ids(b, s), "attention_mask": torch.ones(mb, ms, dtype=torch.long)}))
    for _ in range(12):  # valid: batch 1 (the warm-up's dynamic length), with and without a mask
        s = rng.randint(1, 12)
        kwargs: dict[str, Any] = {"input_ids": ids(1, s)}
        if rng.random() < 0.5:
            kwargs["attention_mask"] = torch.ones(1, s, dtype=torch.long)
        cases.append((f"valid 1x{s}{' with mask' if 'attention_mask' in kwargs else ''}", True, kwargs))
    return cases


def _rank(rank: int, world: int, folder: str) -> list[tuple[str, Any]]:
    from autotp import AutoTPError, parallelize_model

    model = parallelize_model(folder, tp_size=world, progress=False)
    outcomes: list[tuple[str, Any]] = []
    for _, _, kwargs in _cases():
        try:
            with torch.no_grad():
                outcomes.append(("ok", model(**kwargs, use_cache=False).logits))
        except AutoTPError as e:
            outcomes.append(("AutoTPError", str(e)))
        except Exception as e:  # noqa: BLE001 - any other ending is a failure of the case
            outcomes.append((type(e).__name__, str(e)[:300]))
    return outcomes


def test_generated_inputs_end_in_an_autotp_error_or_the_logits_of_one_process(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "llama")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    cases = _cases()
    assert len(cases) >= 80
    results = run_ranks(_rank, 2, str(folder), timeout=1200)
    failures = []
    for i, (label, valid, kwargs) in enumerate(cases):
        kinds = [r[i][0] for r in results]
        if valid:
            with torch.no_grad():
                expected = reference(**kwargs, use_cache=False).logits
            for rank, r in enumerate(results):
                if r[i][0] != "ok":
                    failures.append(f"{label}: rank {rank} {r[i][0]}: {r[i][1]}")
                elif not torch.allclose(r[i][1], expected, atol=1e-5, rtol=1e-4):
                    failures.append(f"{label}: rank {rank} logits differ by {(r[i][1] - expected).abs().max():.2e}")
        elif kinds != ["AutoTPError", "AutoTPError"]:
            failures.append(f"{label}: {[f'{k}: {r[i][1]}' if k != 'ok' else 'ok' for k, r in zip(kinds, results, strict=True)]}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
