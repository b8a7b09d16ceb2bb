"""The CUDA path: parallelize_model on a GPU, compared with one plain transformers process on it.

These tests need a CUDA device and are skipped without one (CI has none); run them where a GPU is
lent: ``python -m pytest -q -o addopts="" tests/gpu``.

* One rank on the GPU (tp=1): the compiled, planned model gives the one-process logits and greedy
  tokens, in fp32 and in bf16, with the eager and the inductor inner compiler.
* Four layers on the GPU: a stack of at least ``regions.MIN_LAYERS`` layers runs each layer through
  a layer region (one traced layer body, stamped out for the others) by default; two ranks sharing
  the GPU give the one-process logits and tokens that way.
* Two ranks sharing one GPU: NCCL refuses two ranks on one device, so the ranks join a gloo group
  and put their shards on ``cuda:0`` (``parallelize_model(..., device="cuda:0")``): the plan, the
  sharded load, the collectives on CUDA tensors and ``generate`` run as on separate GPUs.

Tolerances: fp32 logits at atol 1e-5 / rtol 1e-4 (fused q/k/v GEMMs and, at tp=2, the sum of the
row-parallel partial results reorder fp32 additions, ~1e-6 relative at these sizes; TF32 is off,
torch's default for matmuls); bf16 logits at atol 2e-2 / rtol 2e-2 (bf16 keeps 8 bits of mantissa:
one reordered rounding moves a logit by about 1e-2 at these magnitudes). Greedy tokens must be
identical in fp32; in bf16 the first new token must be.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAD_ID = 120
PROMPT = [[5, 17, 99, 3, 64, 12, 7]]
NEW_TOKENS = 8


def _one_process_on_gpu(folder: Path, dtype: torch.dtype) -> tuple[torch.Tensor, list[int], int]:
    """Plain transformers on the GPU: the reference logits (on the CPU), greedy tokens and the
    model's parameter count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    ids = torch.tensor(PROMPT, device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    return logits.float().cpu(), tokens[0].tolist(), sum(p.numel() for p in model.parameters())


def _autotp_run(folder: str, device: str, dtype: torch.dtype, compile_inner: str | None) -> dict:
    """parallelize_model on ``device``: logits (on the CPU), greedy tokens, where the shards live."""
    from autotp import parallelize_model

    model = parallelize_model(folder, device=device, dtype=dtype, compile_inner=compile_inner)
    ids = torch.tensor(PROMPT, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD_ID)
    params = list(model.parameters())
    return {
        "logits": logits.float().cpu(),
        "logits_device": str(logits.device),
        "tokens": tokens[0].tolist(),
        "param_devices": sorted({str(p.device) for p in params}),
        "param_elements": sum(p.numel() for p in params),
        "collectives": model.autotp.plan["collectives"] if model.autotp.plan else None,
        "regional": all(type(layer).__name__.startswith("Regional") for layer in model.model.layers),
    }


def _shared_gpu_rank(rank: int, world: int, folder: str, dtype: torch.dtype) -> dict:
    return _autotp_run(folder, "cuda:0", dtype, None)


def _check_fp32(got: dict, logits: torch.Tensor, tokens: list[int]) -> None:
    torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-4)
    assert got["tokens"] == tokens
    assert got["logits_device"].startswith("cuda")
    assert got["param_devices"] == ["cuda:0"]


@pytest.mark.parametrize("compile_inner", ["eager", "inductor"])
def test_one_rank_on_the_gpu_gives_one_process_logits_and_tokens(tmp_path: Path, compile_inner: str) -> None:
    folder = save_tiny("llama", tmp_path / "llama")
    logits, tokens, _ = _one_process_on_gpu(folder, torch.float32)
    _check_fp32(_autotp_run(str(folder), "cuda", torch.float32, compile_inner), logits, tokens)


def test_one_rank_on_the_gpu_in_bf16_stays_within_bf16_rounding(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama")
    logits, tokens, _ = _one_process_on_gpu(folder, torch.bfloat16)
    got = _autotp_run(str(folder), "cuda", torch.bfloat16, None)
    torch.testing.assert_close(got["logits"], logits, atol=2e-2, rtol=2e-2)
    assert got["tokens"][:len(PROMPT[0]) + 1] == tokens[:len(PROMPT[0]) + 1]


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_two_ranks_sharing_one_gpu_hold_about_half_and_match_one_process(tmp_path: Path, arch: str) -> None:
    folder = save_tiny(arch, tmp_path / arch)
    logits, tokens, whole = _one_process_on_gpu(folder, torch.float32)
    ranks = run_ranks(_shared_gpu_rank, 2, str(folder), torch.float32, timeout=600)
    for got in ranks:
        _check_fp32(got, logits, tokens)
        # the small norm weights stay replicated: a rank holds a bit over half
        assert got["param_elements"] <= 0.55 * whole
    assert ranks[0]["collectives"] == ranks[1]["collectives"]


def test_two_ranks_sharing_one_gpu_run_bf16_experts_through_cuda_grouped_mm(tmp_path: Path) -> None:
    # bf16 on a GPU is where transformers' grouped_mm experts run torch's CUDA _grouped_mm kernel
    folder = save_tiny("mixtral", tmp_path / "mixtral")
    logits, tokens, _ = _one_process_on_gpu(folder, torch.bfloat16)
    for got in run_ranks(_shared_gpu_rank, 2, str(folder), torch.bfloat16, timeout=600):
        torch.testing.assert_close(got["logits"], logits, atol=2e-2, rtol=2e-2)
        assert got["tokens"][:len(PROMPT[0]) + 1] == tokens[:len(PROMPT[0]) + 1]


def test_two_ranks_sharing_one_gpu_run_four_regional_layers_as_one_process(tmp_path: Path) -> None:
    # four layers reach regions.MIN_LAYERS: the default path of a real model's stack
    folder = save_tiny("llama", tmp_path / "llama", num_hidden_layers=4)
    logits, tokens, _ = _one_process_on_gpu(folder, torch.float32)
    for got in run_ranks(_shared_gpu_rank, 2, str(folder), torch.float32, timeout=600):
        _check_fp32(got, logits, tokens)
        assert got["regional"]
