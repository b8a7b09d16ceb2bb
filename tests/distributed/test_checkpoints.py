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


def _train_and_save(tmp_path: Path, folder: Path) -> tuple[Path, Path, list[dict]]:
    """(the sharded checkpoint, the export, the ranks' :func:`_train_save_continue_export` results) at tp=2."""
    ckpt, export = tmp_path / "sharded", tmp_path / "export"
    return ckpt, export, run_ranks(_train_save_continue_export, 2, str(folder), str(ckpt), str(export))


def _check_round_trip(folder: Path, ckpt: Path, export: Path, first: list[dict]) -> dict:
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


@pytest.fixture(scope="module")
def llama_at_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, list[dict]]:
    """(the checkpoint, the sharded save, the export, the ranks' results) of a 1-layer tiny Llama
    trained at tp=2 (:func:`_train_and_save`): the round trip resumes its save at tp=2, and the
    across-tp test at tp=4 (its first two steps and save are :func:`_resume`'s at tp=2: same seed,
    same steps; the step after the save is its third)."""
    root = tmp_path_factory.mktemp("llama-tp2")
    folder = save_tiny("llama", root / "llama", seed=0, num_hidden_layers=1)
    return folder, *_train_and_save(root, folder)


def test_llama_resumes_exactly_and_exports_a_checkpoint_transformers_loads(
        llama_at_tp2: tuple[Path, Path, Path, list[dict]]) -> None:
    result = _check_round_trip(*llama_at_tp2)
    assert result["plan"]["model.layers.0.self_attn.q_proj.weight"] == "S(0)"


def test_gpt2_fused_and_tied_weights_round_trip_with_dropout_on(tmp_path: Path) -> None:
    folder = save_tiny("gpt2", tmp_path / "gpt2", seed=0)  # dropout 0.1 everywhere: the rng state matters
    result = _check_round_trip(folder, *_train_and_save(tmp_path, folder))
    assert result["plan"]["transformer.h.0.attn.c_attn.weight"].startswith("S(1|")  # fused q|k|v, strided
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        assert "transformer.wte.weight" in f.keys() and "lm_head.weight" not in f.keys()  # tied: once


def _resume(rank: int, world: int, folder: str, load: str | None, save: str | None, steps_before_save: int) -> dict:
    """Optionally resume from ``load``, take ``steps_before_save`` AdamW steps, optionally save into
    ``save``, then take the next step: its loss is what a resumed run must reproduce."""
    import autotp

    torch.manual_seed(1234)
    model = autotp.parallelize_model(folder, tp_size=world)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if load is not None:
        autotp.load_checkpoint(model, load, optimizer)
    curve = [_step(model, optimizer) for _ in range(steps_before_save)]
    if save is not None:
        autotp.save_checkpoint(model, save, optimizer)
    plan = {fqn: entry["placement"] for fqn, entry in model.autotp.plan["parameters"].items()}
    return {"curve": curve, "next": _step(model, optimizer), "plan": plan}


def _check_across_tp(tmp_path: Path, folder: Path, first: int, second: int,
                     saved: tuple[Path, dict] | None = None) -> tuple[dict, dict, dict]:
    """tp=first trains 2 steps and saves (or ``saved``: such a save, and rank 0's ``curve`` and
    ``next`` step of that run); tp=second resumes, takes the step tp=first took next (same loss),
    trains it, saves, and takes one more; tp=first resumes that and takes the same step.

    Tolerance: rtol 1e-4 on the losses: another tp sums the row-parallel products in another order
    (fp32, ~1e-6 relative per step), and AdamW's first steps amplify that in elements whose gradient
    is near zero."""
    at_first, at_second = tmp_path / f"at_tp{first}", tmp_path / f"at_tp{second}"
    if saved is None:
        a = run_ranks(_resume, first, str(folder), None, str(at_first), 2)[0]
    else:
        at_first, a = saved
    b = run_ranks(_resume, second, str(folder), str(at_first), str(at_second), 1)
    c = run_ranks(_resume, first, str(folder), str(at_second), None, 0)
    for r in b:
        assert r["curve"][0] == pytest.approx(a["next"], rel=1e-4)  # tp=first's third step, at tp=second
    for r in c:
        assert r["next"] == pytest.approx(b[0]["next"], rel=1e-4)  # tp=second's fourth step, at tp=first
    assert a["curve"][1] < a["curve"][0]  # it trains
    return a, b[0], c[0]


def test_a_checkpoint_saved_at_tp2_resumes_at_tp4_and_one_saved_at_tp4_at_tp2(
        llama_at_tp2: tuple[Path, Path, Path, list[dict]], tmp_path: Path) -> None:
    folder, ckpt, _, first = llama_at_tp2
    trained = first[0]  # its two steps before the save, and the step after it
    saved = ckpt, {"curve": trained["curve"][:2], "next": trained["curve"][2], "plan": trained["plan"]}
    a, b, _ = _check_across_tp(tmp_path, folder, 2, 4, saved)
    assert a["plan"]["model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    assert b["plan"]["model.layers.0.self_attn.q_proj.weight"] == "S(0)"  # 2 heads a rank, not 4


def test_fused_strided_phi3_weights_resume_at_another_tp(tmp_path: Path) -> None:
    """Phi-3 stores q | k | v in one ``qkv_proj`` and gate | up in one ``gate_up_proj``, sharded
    strided (chunk r of each segment): tp=2 -> tp=1 -> tp=2."""
    folder = save_tiny("phi3", tmp_path / "phi3", seed=0, num_hidden_layers=1, pad_token_id=120)
    a, _, c = _check_across_tp(tmp_path, folder, 2, 1)
    for plan in (a["plan"], c["plan"]):
        assert plan["model.layers.0.self_attn.qkv_proj.weight"].startswith("S(0|")  # strided over q | k | v
        assert plan["model.layers.0.mlp.gate_up_proj.weight"].startswith("S(0|")
