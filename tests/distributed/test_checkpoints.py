"""Checkpoints at tp=2 (gloo, CPU): a sharded save reloaded in fresh processes continues training
exactly as the uninterrupted run, and a full export loads in transformers with the same logits.

Tolerances: the continued loss curve is compared **exactly** (the reload restores every bit of the
parameters, the AdamW state and the random generators, and the same plan runs the same
collectives in the same order). Logits of the export against the parallel model: atol 1e-5 /
rtol 1e-4, because one process sums what the row-parallel all-reduces sum in another order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests._tiny import save_tiny

pytestmark = pytest.mark.dist

IDS = torch.tensor([[5, 17, 99, 3, 64, 12, 7, 9], [8, 1, 2, 3, 4, 77, 31, 40]])
LABELS = torch.where(torch.arange(8) < 2, -100, IDS)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    optimizer.zero_grad()
    loss = model(input_ids=IDS, labels=LABELS).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _train_save_continue_export(rank: int, world: int, folder: str, ckpt: str, export: str) -> dict:
    """Two AdamW steps, a sharded save, two more steps, then a full export and eval logits."""
    import autotp

    torch.manual_seed(1234)
    model = autotp.parallelize_model(folder, tp_size=world)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curve = [_step(model, optimizer) for _ in range(2)]
    autotp.save_checkpoint(model, ckpt, optimizer)
    curve += [_step(model, optimizer) for _ in range(2)]
    autotp.save_pretrained(model, export)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    plan = {fqn: entry["placement"] for fqn, entry in model.autotp.plan["parameters"].items()}
    return {"curve": curve, "logits": logits, "plan": plan}


def _reload_and_continue(rank: int, world: int, folder: str, ckpt: str) -> list[float]:
    import autotp

    torch.manual_seed(999)  # a different seed: the checkpoint's generator state must win
    model = autotp.parallelize_model(folder, tp_size=world)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    autotp.load_checkpoint(model, ckpt, optimizer)
    return [_step(model, optimizer) for _ in range(2)]


def _check_round_trip(tmp_path: Path, folder: Path) -> dict:
    ckpt, export = tmp_path / "sharded", tmp_path / "export"
    first = run_ranks(_train_save_continue_export, 2, str(folder), str(ckpt), str(export))
    resumed = run_ranks(_reload_and_continue, 2, str(folder), str(ckpt))
    for before, after in zip(first, resumed, strict=True):
        assert after == before["curve"][2:]  # exact: bit-identical state, same plan, same order
        assert before["curve"][-1] < before["curve"][0]  # it trains

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        logits = exported(input_ids=IDS).logits
    torch.testing.assert_close(first[0]["logits"], logits, atol=1e-5, rtol=1e-4)
    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert not torch.allclose(original(input_ids=IDS).logits, logits, atol=1e-3)  # trained weights
    return first[0]


def test_llama_resumes_exactly_and_exports_a_checkpoint_transformers_loads(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", seed=0, num_hidden_layers=2)
    result = _check_round_trip(tmp_path, folder)
    assert result["plan"]["model.layers.0.self_attn.q_proj.weight"] == "S(0)"


def test_gpt2_fused_and_tied_weights_round_trip_with_dropout_on(tmp_path: Path) -> None:
    folder = save_tiny("gpt2", tmp_path / "gpt2", seed=0)  # dropout 0.1 everywhere: the rng state matters
    result = _check_round_trip(tmp_path, folder)
    assert result["plan"]["transformer.h.0.attn.c_attn.weight"].startswith("S(1|")  # fused q|k|v, strided
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        assert "transformer.wte.weight" in f.keys() and "lm_head.weight" not in f.keys()  # tied: once


def _load_at_other_tp(rank: int, world: int, folder: str, ckpt: str) -> str:
    import autotp

    model = autotp.parallelize_model(folder, tp_size=world)
    try:
        autotp.load_checkpoint(model, ckpt)
    except autotp.AutoTPError as e:
        return str(e)
    return "loaded"


def test_a_sharded_checkpoint_refuses_another_tp_size_and_names_the_export(tmp_path: Path) -> None:
    folder = save_tiny("llama", tmp_path / "llama", seed=0, num_hidden_layers=1)
    ckpt = tmp_path / "sharded"
    run_ranks(_save_only, 2, str(folder), str(ckpt))
    (message,) = run_ranks(_load_at_other_tp, 1, str(folder), str(ckpt))
    assert "saved at tp=2" in message and "save_pretrained" in message


def _save_only(rank: int, world: int, folder: str, ckpt: str) -> None:
    import autotp

    autotp.save_checkpoint(autotp.parallelize_model(folder, tp_size=world), ckpt)
